//! What the coordinator's fuzz targets in `fuzz/` run, and the replay of their committed
//! inputs as ordinary tests (see `tprun_rank::fuzzing`, which holds the ranks' targets and
//! the replay). Errors are correct answers to bad input; only a broken invariant panics.

use clap::Parser;

use crate::cli::{BenchCommand, Cli, Command, MAX_COUNT, MAX_DEVICE, MAX_MESSAGE_BYTES};
use crate::sizes;
use crate::tokenizer::{TextStream, Tokenizer};

/// `cli_lists`: up to three lines, the values of `--sizes`, `--counts` and `--devices`, parsed
/// as the command line `tprun --devices=D bench allreduce --sizes=S` (and `--counts=C`) is.
/// What parses must be within the bounds the value parsers promise (`cli`'s constants).
pub fn cli_lists(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut lines = text.splitn(3, '\n');
    let (s, c, d) = (
        lines.next().unwrap_or(""),
        lines.next().unwrap_or(""),
        lines.next().unwrap_or(""),
    );
    let devices = format!("--devices={d}");
    for (flag, value) in [("--sizes", s), ("--counts", c)] {
        let list = format!("{flag}={value}");
        let argv = [
            "tprun",
            "--backend",
            "cpu",
            &devices,
            "bench",
            "allreduce",
            &list,
        ];
        let Ok(cli) = Cli::try_parse_from(argv) else {
            continue;
        };
        if let Some(devs) = &cli.devices {
            assert_eq!(
                devs.len(),
                d.split(',').count(),
                "one device per item: {d:?}"
            );
            assert!(devs.iter().all(|&v| v <= MAX_DEVICE), "{d:?} → {devs:?}");
        }
        let Command::Bench {
            what: BenchCommand::Allreduce(args),
        } = &cli.command
        else {
            panic!("parsed as another command: {argv:?}");
        };
        if let Some(counts) = &args.counts {
            assert_eq!(
                counts.len(),
                c.split(',').count(),
                "one count per item: {c:?}"
            );
            assert!(
                counts.iter().all(|&n| (1..=MAX_COUNT).contains(&n)),
                "{c:?} → {counts:?}"
            );
        }
        if flag == "--sizes" {
            // Parsed by clap through `sizes::byte_sizes`: here only when it accepted `s`.
            let sizes = &args.sizes.0;
            assert!(
                sizes.iter().all(|&b| (1..=MAX_MESSAGE_BYTES).contains(&b)),
                "{s:?} → {sizes:?}"
            );
            assert_eq!(sizes::parse_sizes(s).as_ref(), Ok(sizes), "{s:?}");
            match s.split_once(':') {
                // A range doubles from its start up to its end.
                Some(_) => assert!(
                    sizes.windows(2).all(|w| w[1] == 2 * w[0]) && !sizes.is_empty(),
                    "{s:?} → {sizes:?}"
                ),
                None => assert_eq!(sizes.len(), s.split(',').count()),
            }
        }
    }
}

/// `tokenizer`: the bytes as a tokenizer.json, loaded as the coordinator loads one; a tokenizer
/// that loads then encodes a prompt and streams its ids back to text.
pub fn tokenizer(data: &[u8]) {
    let Ok(tok) = Tokenizer::from_json("tokenizer.json", data) else {
        return;
    };
    let Ok(ids) = tok.encode("Once upon a time, a 🦀 said \"héllo\"\n\t42.") else {
        return;
    };
    let _ = tok.decode(&ids);
    // Streamed from the start, and after the first half as the prompt (decode and serve).
    for cut in [0, ids.len() / 2] {
        let mut stream = TextStream::after(&ids[..cut]);
        for &id in ids[cut..].iter().chain(&[0, 1, 255, 256, u32::MAX]) {
            if stream.push(&tok, id).is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;
    use tprun_rank::fuzzing::replay;

    fn fuzz_dir() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
    }

    /// Every committed input of the coordinator's targets, through the fuzzer's functions.
    #[test]
    fn committed_fuzz_inputs_replay() {
        for (target, f) in [
            ("cli_lists", cli_lists as fn(&[u8])),
            ("tokenizer", tokenizer),
        ] {
            let n = replay(&fuzz_dir(), target, f);
            assert!(n > 0, "fuzz/corpus/{target}/ is empty or missing");
        }
    }

    /// Writes the seed inputs of the coordinator's targets into `fuzz/corpus/` (by hand:
    /// `cargo test -p tprun --lib write_fuzz_seeds -- --ignored`).
    #[test]
    #[ignore]
    fn write_fuzz_seeds() {
        let seed = |target: &str, name: &str, bytes: &[u8]| {
            let dir = fuzz_dir().join("corpus").join(target);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
        };
        seed("cli_lists", "defaults", b"8:64M\n1,7,1001\n0,1");
        seed("cli_lists", "lists", b"4K,1M,1G\n4096\n0,0,0,0");
        seed("cli_lists", "units", b"1k:2g\n3\n7");
        let synth = tprun_rank::model::synth::tokenizer_json(512).to_string();
        seed("tokenizer", "synth", synth.as_bytes());
        let stories = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../shared/models/stories260k/tokenizer.json");
        if let Ok(json) = std::fs::read(stories) {
            seed("tokenizer", "stories260k", &json);
        }
    }
}
