//! tprun's coordinator as a library: the parts of the binary that parse what a user hands it
//! (flags, size lists, tokenizer.json), so that the fuzz targets in `fuzz/` and their replay
//! tests reach the same code as `main.rs`. The binary (`main.rs`) owns everything else: jobs,
//! supervision, output.

pub mod cli;
#[doc(hidden)]
pub mod fuzzing;
pub mod sizes;
pub mod tokenizer;
