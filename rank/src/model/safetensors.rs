//! Reading a rank's slices of a Hugging Face checkpoint: `model.safetensors`, or the shards
//! named by `model.safetensors.index.json`, memory-mapped. The `safetensors` crate (the
//! format's reference implementation) parses and validates each header: dtype names, byte
//! counts against shapes, and data offsets that tile the data section in order, with no
//! overlap and no gap. What tprun adds on top: the bound of every range against the file (before
//! the crate sums offsets, see [`parse`]), errors that name the file and the tensor, the
//! sharded index, the per-rank slicing and the dtype conversion.
//!
//! Only the bytes of this rank's slice are touched (a row range is one contiguous run; a
//! column range is one run per row), so a rank of an 8-way job reads about an eighth of the
//! checkpoint from the page cache.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Metadata, SafeTensorError, TensorInfo as Entry};
use safetensors::Dtype;
use serde_json::Value;
use tprun_kernels::dtype::{decode, encode};
use tprun_kernels::DType;

use super::ModelError;

/// Largest JSON header accepted: the `safetensors` crate's own limit (`MAX_HEADER_SIZE`,
/// 100 MB), so that what it would refuse we refuse first, with the file's name.
const MAX_HEADER: u64 = 100_000_000;
/// Bytes of converted data handed to the sink at a time: bounds the host staging memory.
const CHUNK_BYTES: usize = 8 << 20;

/// Receives converted bytes of a slice: `(byte offset in the slice, bytes)`.
pub type Sink<'a> = dyn FnMut(usize, &[u8]) -> Result<(), ModelError> + 'a;
/// Produces tensor `i`'s bytes for [`write`], passing them to the writer it is given.
pub type TensorSource<'a> =
    dyn FnMut(usize, &mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> + 'a;

/// Where one tensor lives in its file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// The element type the file stores; tprun reads F32, F16 and BF16 ([`TensorInfo::dtype`]).
    pub stored: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    range: Range<usize>,
}

impl TensorInfo {
    /// The stored element type as tprun's, if tprun can read it as a float tensor. I32
    /// (GPTQ's packed int4 tensors and `g_idx`) is read by [`Checkpoint::read_i32`] instead.
    pub fn dtype(&self) -> Option<DType> {
        match self.stored {
            Dtype::F32 => Some(DType::F32),
            Dtype::F16 => Some(DType::F16),
            Dtype::BF16 => Some(DType::BF16),
            _ => None,
        }
    }
}

/// One mapped safetensors file and its parsed header.
pub struct SafeFile {
    path: PathBuf,
    map: Mmap,
    tensors: HashMap<String, TensorInfo>,
}

/// Which part of a tensor a rank reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slice {
    /// The whole tensor.
    Full,
    /// Rows `r` of a tensor with at least one dimension (column-parallel weights, vocab
    /// shards, biases).
    Rows(Range<usize>),
    /// Columns `c` of a 2-D tensor (row-parallel weights).
    Cols(Range<usize>),
}

impl SafeFile {
    pub fn open(path: &Path) -> Result<SafeFile, ModelError> {
        crate::files::regular(path).map_err(|e| ModelError::io(path, e))?;
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: a file-backed map is undefined behaviour if another process truncates or
        // rewrites the file while it is mapped. Checkpoints are read-only inputs; we map them
        // read-only and copy each slice out once, at load time (memmap2's documented caveat).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        // Parsing reads the header's pages only; the tensors' pages are touched by `read`.
        let tensors = parse(path, &map)?;
        Ok(SafeFile {
            path: path.to_path_buf(),
            map,
            tensors,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensors(&self) -> &HashMap<String, TensorInfo> {
        &self.tensors
    }
}

/// Parses and validates the header of `file`, a whole safetensors file (`path` names it in
/// errors). Reads only the first `8 + header length` bytes of `file`, and the length.
///
/// The layout is an 8-byte little-endian header length, a JSON header, then the data section,
/// which the tensors' `data_offsets` (relative to it) must tile exactly. The crate checks the
/// entries ([`Metadata::new`]); two checks come first here, both where the value enters: the
/// header length against the file, and every offset against the data section's length. The
/// second keeps the crate's own whole-file entry point (`SafeTensors::read_metadata`) out of
/// it: that one adds the last offset to the header length unchecked, which overflows on
/// offsets near 2^64 (a panic where overflow checks are on).
pub fn parse(path: &Path, file: &[u8]) -> Result<HashMap<String, TensorInfo>, ModelError> {
    let bad = |why: String| ModelError::Header {
        file: path.to_path_buf(),
        why,
    };
    let Some(len_bytes) = file.first_chunk::<8>() else {
        return Err(bad(format!(
            "truncated: {} bytes, shorter than the 8-byte header length",
            file.len()
        )));
    };
    let n = u64::from_le_bytes(*len_bytes);
    let data_len = (file.len() as u64 - 8).checked_sub(n);
    let (Some(data_len), true) = (data_len, n <= MAX_HEADER) else {
        return Err(bad(format!(
            "corrupted or truncated header: it claims {n} bytes, the file has {}",
            file.len()
        )));
    };
    let base = 8 + n as usize;
    let header: HashMap<String, Value> = serde_json::from_slice(&file[8..base])
        .map_err(|e| bad(format!("corrupted header: not a JSON object ({e})")))?;
    let mut entries = Vec::with_capacity(header.len());
    for (name, v) in header {
        if name == "__metadata__" {
            // Free-form strings; the crate's type for them is the check.
            serde_json::from_value::<HashMap<String, String>>(v)
                .map_err(|e| bad(format!("corrupted header: __metadata__: {e}")))?;
            continue;
        }
        let tbad = |why: String| ModelError::Tensor {
            file: path.to_path_buf(),
            tensor: name.clone(),
            why,
        };
        let e: Entry =
            serde_json::from_value(v).map_err(|e| tbad(format!("corrupted header entry: {e}")))?;
        // Slicing multiplies the dimensions after the first; with a zero among the others
        // their product is never formed by the crate's check (0 · 2^33 · 2^33 is 0).
        if e.shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .is_none()
        {
            return Err(tbad(format!("shape {:?} overflows", e.shape)));
        }
        let (start, end) = e.data_offsets;
        if start.max(end) as u64 > data_len {
            return Err(tbad(format!(
                "truncated or out of bounds: data_offsets [{start}, {end}] run past the data \
                 section's {data_len} bytes (the file has {})",
                file.len()
            )));
        }
        entries.push((name, e));
    }
    // The crate wants the entries in file order: the order of their ranges.
    entries.sort_by_key(|(_, e)| e.data_offsets);
    let metadata = Metadata::new(None, entries.clone()).map_err(|e| explain(path, &entries, e))?;
    if metadata.data_len() as u64 != data_len {
        let last = entries.last().map_or("(none)", |(n, _)| n.as_str());
        return Err(bad(format!(
            "the tensors end at byte {} of the data section, which has {data_len}: {} bytes \
             after the last tensor `{last}` (a corrupted or appended-to file)",
            metadata.data_len(),
            data_len - metadata.data_len() as u64
        )));
    }
    Ok(entries
        .into_iter()
        .map(|(name, e)| {
            let (start, end) = e.data_offsets;
            let info = TensorInfo {
                stored: e.dtype,
                shape: e.shape,
                range: base + start..base + end,
            };
            (name, info)
        })
        .collect())
}

/// The crate's error for `entries` (sorted by range), with the tensor named and the ranges
/// or sizes that disagree spelled out.
fn explain(path: &Path, entries: &[(String, Entry)], e: SafeTensorError) -> ModelError {
    let tensor = |name: &str, why: String| ModelError::Tensor {
        file: path.to_path_buf(),
        tensor: name.into(),
        why,
    };
    let offs = |e: &Entry| format!("[{}, {}]", e.data_offsets.0, e.data_offsets.1);
    match e {
        SafeTensorError::InvalidOffset(name) => {
            let Some(i) = entries.iter().position(|(n, _)| *n == name) else {
                return tensor(&name, "invalid data_offsets".into());
            };
            let (s, t) = entries[i].1.data_offsets;
            let why = if t < s {
                "ends before it starts".to_string()
            } else if i == 0 {
                format!("leave a gap of {s} bytes at the start of the data section")
            } else {
                let (prev, p) = &entries[i - 1];
                let rel = if s < p.data_offsets.1 {
                    "overlap"
                } else {
                    "leave a gap after"
                };
                format!("{rel} tensor `{prev}`'s {}", offs(p))
            };
            tensor(
                &name,
                format!(
                    "data_offsets {} {why} (ranges must tile the data section in order)",
                    offs(&entries[i].1)
                ),
            )
        }
        SafeTensorError::TensorInvalidInfo
        | SafeTensorError::ValidationOverflow
        | SafeTensorError::MisalignedSlice => {
            // The crate checks in this order and stops at the first; find that one.
            let bits = |e: &Entry| {
                e.shape
                    .iter()
                    .try_fold(1usize, |a, &d| a.checked_mul(d))
                    .and_then(|n| n.checked_mul(e.dtype.bitsize()))
            };
            let culprit = entries.iter().find(|(_, e)| {
                bits(e).is_none_or(|b| {
                    !b.is_multiple_of(8) || b / 8 != e.data_offsets.1 - e.data_offsets.0
                })
            });
            match culprit {
                Some((name, en)) => tensor(
                    name,
                    match bits(en) {
                        None => format!("shape {:?} of {} overflows", en.shape, en.dtype),
                        Some(b) => format!(
                            "data_offsets {} hold {} bytes, but shape {:?} of {} is {} bits",
                            offs(en),
                            en.data_offsets.1 - en.data_offsets.0,
                            en.shape,
                            en.dtype,
                            b
                        ),
                    },
                ),
                None => ModelError::Header {
                    file: path.to_path_buf(),
                    why: format!("invalid header: {e}"),
                },
            }
        }
        other => ModelError::Header {
            file: path.to_path_buf(),
            why: format!("invalid header: {other}"),
        },
    }
}

/// A checkpoint directory's tensors, across one or more mapped files.
pub struct Checkpoint {
    files: Vec<SafeFile>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
    dir: PathBuf,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` and the shards it names, or else
    /// `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Checkpoint, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut names: Vec<String> = Vec::new();
        let mut weight_map: Vec<(String, String)> = Vec::new();
        if index_path.exists() {
            let text = crate::files::read_json_text(&index_path)
                .map_err(|e| ModelError::io(&index_path, e))?;
            weight_map = parse_index(&index_path, &text)?;
            for (_, f) in &weight_map {
                if !names.contains(f) {
                    names.push(f.clone());
                }
            }
        } else {
            names.push("model.safetensors".into());
        }
        let mut files = Vec::new();
        for n in &names {
            files.push(SafeFile::open(&dir.join(n))?);
        }
        let mut index = HashMap::new();
        if weight_map.is_empty() {
            for (i, f) in files.iter().enumerate() {
                for t in f.tensors.keys() {
                    index.insert(t.clone(), i);
                }
            }
        } else {
            for (t, f) in weight_map {
                let i = names.iter().position(|n| *n == f).expect("listed above");
                index.insert(t, i);
            }
        }
        Ok(Checkpoint {
            files,
            index,
            dir: dir.to_path_buf(),
        })
    }

    /// A checkpoint of the one safetensors file at `path` (no index), called `name` in
    /// messages (a path that will not outlive the opening, such as a memfd's in /proc).
    pub fn single(path: &Path, name: &Path) -> Result<Checkpoint, ModelError> {
        let mut file = SafeFile::open(path)?;
        file.path = name.to_path_buf();
        let index = file.tensors.keys().map(|t| (t.clone(), 0)).collect();
        Ok(Checkpoint {
            files: vec![file],
            index,
            dir: name.parent().unwrap_or(Path::new("")).to_path_buf(),
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor name, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The file holding `name` and its header entry.
    pub fn info(&self, name: &str) -> Result<(&SafeFile, &TensorInfo), ModelError> {
        let missing = |file: PathBuf| ModelError::Tensor {
            file,
            tensor: name.into(),
            why: "missing from the checkpoint".into(),
        };
        let &i = self.index.get(name).ok_or_else(|| {
            let file = match self.files.as_slice() {
                [one] => one.path.clone(),
                _ => self.dir.join("model.safetensors.index.json"),
            };
            missing(file)
        })?;
        let f = &self.files[i];
        let t = f.tensors.get(name).ok_or_else(|| missing(f.path.clone()))?;
        Ok((f, t))
    }

    /// Reads `slice` of tensor `name`, which must have shape `shape`, converted to `dtype`,
    /// handing the bytes to `sink(byte_offset, bytes)` in order, a few MiB at a time.
    pub fn read(
        &self,
        name: &str,
        shape: &[usize],
        slice: &Slice,
        dtype: DType,
        sink: &mut Sink<'_>,
    ) -> Result<(), ModelError> {
        let (f, t) = self.info(name)?;
        read_slice(&f.path, &f.map, name, t, shape, slice, dtype, sink)
    }

    /// Reads a whole slice into host memory as f32 (for small tensors: norms, biases).
    pub fn read_f32(
        &self,
        name: &str,
        shape: &[usize],
        slice: &Slice,
    ) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::new();
        self.read(name, shape, slice, DType::F32, &mut |_, b| {
            out.extend(decode(DType::F32, b));
            Ok(())
        })?;
        Ok(out)
    }

    /// Reads a whole slice of an I32 tensor (GPTQ's `qweight`, `qzeros`, `g_idx`) as stored,
    /// with no conversion: any other stored dtype is refused, naming the tensor.
    pub fn read_i32(
        &self,
        name: &str,
        shape: &[usize],
        slice: &Slice,
    ) -> Result<Vec<i32>, ModelError> {
        let (f, t) = self.info(name)?;
        let tbad = |why: String| ModelError::Tensor {
            file: f.path.clone(),
            tensor: name.into(),
            why,
        };
        if t.shape != shape {
            return Err(tbad(format!("shape {:?}, expected {shape:?}", t.shape)));
        }
        if t.stored != Dtype::I32 {
            return Err(tbad(format!("dtype {}, expected I32", t.stored)));
        }
        let runs = slice_runs(shape, slice)
            .ok_or_else(|| tbad(format!("cannot take {slice:?} of shape {shape:?}")))?;
        let data = &f.map[t.range.clone()];
        let mut out = Vec::with_capacity(runs.iter().map(|r| r.1).sum());
        for (start, len) in runs {
            out.extend(
                data[start * 4..(start + len) * 4]
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            );
        }
        Ok(out)
    }

    /// The dtype the checkpoint stores `name` in.
    pub fn dtype_of(&self, name: &str) -> Result<DType, ModelError> {
        let (f, t) = self.info(name)?;
        t.dtype().ok_or_else(|| unsupported(&f.path, name, t))
    }
}

fn unsupported(file: &Path, name: &str, t: &TensorInfo) -> ModelError {
    ModelError::Tensor {
        file: file.to_path_buf(),
        tensor: name.into(),
        why: format!("dtype {} is not supported (F32, F16, BF16)", t.stored),
    }
}

/// The `weight_map` of a `model.safetensors.index.json` (`path` names it in errors): (tensor,
/// file) pairs, each file a plain name in the model's folder.
pub fn parse_index(path: &Path, text: &str) -> Result<Vec<(String, String)>, ModelError> {
    let err = |field: String, why: String| ModelError::Config {
        file: path.to_path_buf(),
        field,
        why,
    };
    let v: Value = serde_json::from_str(text)
        .map_err(|e| err("(syntax)".into(), format!("not valid JSON: {e}")))?;
    let wm = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| err("weight_map".into(), "missing or not an object".into()))?;
    let mut out = Vec::with_capacity(wm.len());
    for (t, f) in wm {
        let f = f
            .as_str()
            .ok_or_else(|| err(format!("weight_map.{t}"), "expected a file name".into()))?;
        // A plain name: nothing that leaves the folder or names the folder itself.
        if f.is_empty() || f.contains('/') || f.contains('\0') || f == "." || f.contains("..") {
            return Err(err(
                format!("weight_map.{t}"),
                format!("{f:?} is not a file name in the model directory"),
            ));
        }
        out.push((t.clone(), f.to_string()));
    }
    Ok(out)
}

/// Reads `slice` of tensor `name` (its header entry `t`) from `file`, the whole mapped file
/// at `path`: see [`Checkpoint::read`].
#[allow(clippy::too_many_arguments)]
pub fn read_slice(
    path: &Path,
    file: &[u8],
    name: &str,
    t: &TensorInfo,
    shape: &[usize],
    slice: &Slice,
    dtype: DType,
    sink: &mut Sink<'_>,
) -> Result<(), ModelError> {
    let tbad = |why: String| ModelError::Tensor {
        file: path.to_path_buf(),
        tensor: name.into(),
        why,
    };
    if t.shape != shape {
        return Err(tbad(format!("shape {:?}, expected {shape:?}", t.shape)));
    }
    let stored = t.dtype().ok_or_else(|| unsupported(path, name, t))?;
    let data = &file[t.range.clone()];
    let es = stored.size();
    let runs = slice_runs(shape, slice)
        .ok_or_else(|| tbad(format!("cannot take {slice:?} of shape {shape:?}")))?;
    let mut out_off = 0;
    // Gather runs into chunks of about CHUNK_BYTES source bytes, convert, hand over.
    let mut pending: Vec<u8> = Vec::new();
    let mut flush = |pending: &mut Vec<u8>, out_off: &mut usize| -> Result<(), ModelError> {
        if pending.is_empty() {
            return Ok(());
        }
        if stored == dtype {
            sink(*out_off, pending)?;
            *out_off += pending.len();
        } else {
            let conv = encode(dtype, &decode(stored, pending));
            sink(*out_off, &conv)?;
            *out_off += conv.len();
        }
        pending.clear();
        Ok(())
    };
    for (start, len) in runs {
        let mut s = start * es;
        let end = (start + len) * es;
        while s < end {
            let take = (end - s).min(CHUNK_BYTES - pending.len());
            pending.extend_from_slice(&data[s..s + take]);
            s += take;
            if pending.len() >= CHUNK_BYTES {
                flush(&mut pending, &mut out_off)?;
            }
        }
    }
    flush(&mut pending, &mut out_off)
}

/// The source runs of `slice` of a tensor of `shape`, as (first element, elements), in order;
/// `None` if the slice is out of range or a column slice of a tensor that is not 2-D.
fn slice_runs(shape: &[usize], slice: &Slice) -> Option<Vec<(usize, usize)>> {
    let rows = shape.first().copied().unwrap_or(1);
    let row_elems: usize = shape.iter().skip(1).product();
    match slice {
        Slice::Full => Some(vec![(0, rows * row_elems)]),
        Slice::Rows(r) if r.start <= r.end && r.end <= rows => {
            Some(vec![(r.start * row_elems, r.len() * row_elems)])
        }
        Slice::Cols(c) if shape.len() == 2 && c.start <= c.end && c.end <= row_elems => Some(
            (0..rows)
                .map(|i| (i * row_elems + c.start, c.len()))
                .collect(),
        ),
        _ => None,
    }
}

/// The crate's name of a tprun dtype.
pub(crate) fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::U32 => Dtype::U32,
    }
}

/// Writes a safetensors file from `(name, dtype, shape)` entries, in that order, pulling each
/// tensor's bytes from `data` in order, so that nothing larger than one chunk is held in
/// memory.
///
/// The header is the crate's: its [`Metadata`] checks the entries and serializes them. The
/// data is streamed here because the crate's writers (`serialize`, `serialize_to_file`) take
/// each tensor as one in-memory buffer: a whole embedding table (2 GB of Qwen3-32B's in bf16)
/// where `synth` holds one 1 MiB chunk.
pub fn write(
    path: &Path,
    tensors: &[(String, DType, Vec<usize>)],
    data: &mut TensorSource<'_>,
) -> Result<(), ModelError> {
    let tensors: Vec<(String, Dtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, d, s)| (n.clone(), st_dtype(*d), s.clone()))
        .collect();
    write_stored(path, &tensors, data)
}

/// [`write`] with the file's own dtypes, for tensors that are no tprun dtype (GPTQ's I32
/// `qweight`, `qzeros` and `g_idx`). Each dtype must be whole bytes per element.
pub fn write_stored(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>)],
    data: &mut TensorSource<'_>,
) -> Result<(), ModelError> {
    use std::io::Write;
    let io = |e| ModelError::io(path, e);
    let tbad = |name: &str, why: String| ModelError::Tensor {
        file: path.into(),
        tensor: name.into(),
        why,
    };
    let mut entries = Vec::with_capacity(tensors.len());
    let mut sizes = Vec::with_capacity(tensors.len());
    let mut off = 0usize;
    for (name, dtype, shape) in tensors {
        if !dtype.bitsize().is_multiple_of(8) {
            return Err(tbad(name, format!("dtype {dtype} is not whole bytes")));
        }
        let bytes = shape
            .iter()
            .try_fold(dtype.bitsize() / 8, |a, &d| a.checked_mul(d))
            .ok_or_else(|| tbad(name, format!("shape {shape:?} overflows")))?;
        if entries.iter().any(|(n, _)| n == name) {
            return Err(tbad(name, "listed twice".into()));
        }
        let entry = Entry {
            dtype: *dtype,
            shape: shape.clone(),
            data_offsets: (off, off + bytes),
        };
        entries.push((name.clone(), entry));
        sizes.push(bytes);
        off += bytes;
    }
    let format = HashMap::from([("format".to_string(), "pt".to_string())]);
    let metadata = Metadata::new(Some(format), entries).map_err(|e| ModelError::Header {
        file: path.into(),
        why: format!("cannot write this header: {e}"),
    })?;
    let mut h = serde_json::to_vec(&metadata).expect("a validated header serializes");
    // Pad with spaces to a multiple of 8 so that the data starts aligned (as the crate's
    // writer does).
    h.resize(h.len().next_multiple_of(8), b' ');
    let f = std::fs::File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    w.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&h).map_err(io)?;
    for (i, ((name, _, _), &want)) in tensors.iter().zip(&sizes).enumerate() {
        let mut got = 0usize;
        data(i, &mut |b: &[u8]| {
            got += b.len();
            w.write_all(b)
        })
        .map_err(io)?;
        if got != want {
            return Err(tbad(
                name,
                format!("writer produced {got} bytes, expected {want}"),
            ));
        }
    }
    w.flush().map_err(io)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tprun-st-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn write_one(path: &Path, name: &str, dtype: DType, shape: &[usize], vals: &[f32]) {
        let bytes = encode(dtype, vals);
        write(
            path,
            &[(name.into(), dtype, shape.to_vec())],
            &mut |_, out| out(&bytes),
        )
        .unwrap();
    }

    #[test]
    fn reads_row_and_column_slices_with_conversion() {
        let d = tmpdir("slices");
        let vals: Vec<f32> = (0..12).map(|i| i as f32).collect();
        write_one(
            &d.join("model.safetensors"),
            "w",
            DType::BF16,
            &[3, 4],
            &vals,
        );
        let ck = Checkpoint::open(&d).unwrap();
        assert_eq!(ck.read_f32("w", &[3, 4], &Slice::Full).unwrap(), vals);
        assert_eq!(
            ck.read_f32("w", &[3, 4], &Slice::Rows(1..2)).unwrap(),
            vec![4.0, 5.0, 6.0, 7.0]
        );
        assert_eq!(
            ck.read_f32("w", &[3, 4], &Slice::Cols(1..3)).unwrap(),
            vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn sharded_checkpoints_follow_the_index() {
        let d = tmpdir("index");
        write_one(
            &d.join("model-00001-of-00002.safetensors"),
            "a",
            DType::F32,
            &[2],
            &[1.0, 2.0],
        );
        write_one(
            &d.join("model-00002-of-00002.safetensors"),
            "b",
            DType::F16,
            &[1],
            &[3.0],
        );
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                "b": "model-00002-of-00002.safetensors"}}"#,
        )
        .unwrap();
        let ck = Checkpoint::open(&d).unwrap();
        assert_eq!(
            ck.read_f32("a", &[2], &Slice::Full).unwrap(),
            vec![1.0, 2.0]
        );
        assert_eq!(ck.read_f32("b", &[1], &Slice::Full).unwrap(), vec![3.0]);
        let e = ck
            .read_f32("c", &[1], &Slice::Full)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("index.json") && e.contains("`c`") && e.contains("missing"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn broken_files_name_file_and_tensor() {
        let d = tmpdir("broken");
        let p = d.join("model.safetensors");
        write_one(&p, "w", DType::F32, &[4, 4], &[0.5; 16]);
        let good = std::fs::read(&p).unwrap();

        // Truncated: the last tensor's bytes run past the end.
        std::fs::write(&p, &good[..good.len() - 5]).unwrap();
        let e = Checkpoint::open(&d).err().unwrap().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("truncated") && e.contains("`w`"),
            "{e}"
        );
        // Truncated to less than the length prefix, or to nothing.
        for len in [3, 0] {
            std::fs::write(&p, &good[..len]).unwrap();
            let e = Checkpoint::open(&d).err().unwrap().to_string();
            assert!(
                e.contains("model.safetensors") && e.contains("truncated"),
                "{e}"
            );
        }
        // Corrupted header: bad JSON.
        let mut bad = good.clone();
        bad[9] = b'#';
        std::fs::write(&p, &bad).unwrap();
        let e = Checkpoint::open(&d).err().unwrap().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("corrupted header"),
            "{e}"
        );
        // Corrupted header: an absurd length.
        let mut bad = good.clone();
        bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&p, &bad).unwrap();
        assert!(Checkpoint::open(&d)
            .err()
            .unwrap()
            .to_string()
            .contains("corrupted"));

        // Wrong shape and missing tensor, on a good file.
        std::fs::write(&p, &good).unwrap();
        let ck = Checkpoint::open(&d).unwrap();
        let e = ck
            .read_f32("w", &[4, 5], &Slice::Full)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("`w`") && e.contains("shape"),
            "{e}"
        );
        let e = ck
            .read_f32("x", &[1], &Slice::Full)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`x`") && e.contains("missing"), "{e}");

        // A dtype tprun does not read is refused when that tensor is read, naming it; the
        // other tensors of the file stay readable.
        let hdr = br#"{"i":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},
                        "w":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
        std::fs::write(&p, raw(hdr, 12)).unwrap();
        let ck = Checkpoint::open(&d).unwrap();
        assert_eq!(ck.read_f32("w", &[1], &Slice::Full).unwrap(), [0.0]);
        for e in [
            ck.read_f32("i", &[1], &Slice::Full).unwrap_err(),
            ck.dtype_of("i").unwrap_err(),
        ] {
            let e = e.to_string();
            assert!(e.contains("`i`") && e.contains("I64"), "{e}");
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A file of `header` and `data` zero bytes.
    fn raw(header: &[u8], data: usize) -> Vec<u8> {
        let mut f = (header.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(header);
        f.resize(f.len() + data, 0);
        f
    }

    /// The one-line error of parsing `header` followed by `data` bytes.
    fn parse_err(header: &str, data: usize) -> String {
        let p = Path::new("m.safetensors");
        match parse(p, &raw(header.as_bytes(), data)) {
            Ok(t) => panic!("accepted: {t:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn overlapping_ranges_are_refused() {
        // `b` reads the second half of `a`'s bytes as its own (the hand-written parser of old
        // accepted this).
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},
                "b":{"dtype":"F32","shape":[4],"data_offsets":[8,24]}}"#,
            24,
        );
        assert!(
            e.starts_with("m.safetensors: tensor `b`")
                && e.contains("overlap")
                && e.contains("`a`"),
            "{e}"
        );
        // Two tensors on the same bytes.
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                "b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(e.contains("overlap"), "{e}");
    }

    #[test]
    fn out_of_bounds_ranges_are_refused() {
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            12,
        );
        assert!(
            e.contains("tensor `a`") && e.contains("out of bounds") && e.contains("12 bytes"),
            "{e}"
        );
        // Eight tensors of 2^61 - 1 bytes (each size matches its shape) that tile the data
        // section up to 2^64 - 8: refused before anything adds an offset to the header length.
        let k = (1u64 << 61) - 1;
        let entries: Vec<String> = (0..8)
            .map(|i| {
                format!(
                    r#""t{i}":{{"dtype":"U8","shape":[{k}],"data_offsets":[{},{}]}}"#,
                    i * k,
                    (i + 1) * k
                )
            })
            .collect();
        let e = parse_err(&format!("{{{}}}", entries.join(",")), 8);
        assert!(e.contains("out of bounds"), "{e}");
        // Bytes after the last tensor.
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            8,
        );
        assert!(e.contains("4 bytes after the last tensor `a`"), "{e}");
    }

    #[test]
    fn out_of_order_ranges_are_refused() {
        // A range that ends before it starts.
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                "b":{"dtype":"F32","shape":[2],"data_offsets":[16,8]}}"#,
            16,
        );
        assert!(
            e.contains("tensor `b`") && e.contains("ends before it starts"),
            "{e}"
        );
        // A gap between two tensors, and one before the first.
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
            12,
        );
        assert!(
            e.contains("tensor `b`") && e.contains("gap after tensor `a`"),
            "{e}"
        );
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        );
        assert!(
            e.contains("tensor `a`") && e.contains("gap of 4 bytes"),
            "{e}"
        );
        // Listed out of file order is fine: the header is a map.
        let ok = r#"{"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},
                     "a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let t = parse(Path::new("m"), &raw(ok.as_bytes(), 8)).unwrap();
        assert_eq!(t["b"].range.start - t["a"].range.start, 4);
    }

    #[test]
    fn sizes_that_disagree_with_shapes_name_the_tensor() {
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                "b":{"dtype":"BF16","shape":[3],"data_offsets":[4,12]}}"#,
            12,
        );
        assert!(
            e.contains("tensor `b`") && e.contains("hold 8 bytes") && e.contains("[3]"),
            "{e}"
        );
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#,
            0,
        );
        assert!(e.contains("tensor `a`") && e.contains("overflows"), "{e}");
        // No elements, but dimensions after the first that multiply past 2^64.
        let e = parse_err(
            r#"{"a":{"dtype":"F32","shape":[0,8589934592,8589934592],"data_offsets":[0,0]}}"#,
            0,
        );
        assert!(e.contains("tensor `a`") && e.contains("overflows"), "{e}");
    }

    /// I32 tensors (GPTQ's) are written with the file's dtype and read back as stored, in
    /// slices; a float reader refuses them and the I32 reader refuses floats.
    #[test]
    fn i32_tensors_round_trip_in_slices() {
        let d = tmpdir("i32");
        let vals: Vec<i32> = (0..12i32)
            .map(|i| i.wrapping_mul(0x1111_1111) - 7)
            .collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_stored(
            &d.join("model.safetensors"),
            &[
                ("q".into(), Dtype::I32, vec![3, 4]),
                ("f".into(), Dtype::F32, vec![1]),
            ],
            &mut |i, out| match i {
                0 => out(&bytes),
                _ => out(&encode(DType::F32, &[1.0])),
            },
        )
        .unwrap();
        let ck = Checkpoint::open(&d).unwrap();
        assert_eq!(ck.read_i32("q", &[3, 4], &Slice::Full).unwrap(), vals);
        assert_eq!(
            ck.read_i32("q", &[3, 4], &Slice::Rows(2..3)).unwrap(),
            &vals[8..]
        );
        assert_eq!(
            ck.read_i32("q", &[3, 4], &Slice::Cols(3..4)).unwrap(),
            [vals[3], vals[7], vals[11]]
        );
        let e = ck.read_f32("q", &[3, 4], &Slice::Full).unwrap_err();
        assert!(e.to_string().contains("dtype I32 is not supported"), "{e}");
        let e = ck.read_i32("f", &[1], &Slice::Full).unwrap_err();
        assert!(
            e.to_string().contains("`f`: dtype F32, expected I32"),
            "{e}"
        );
        let e = ck.read_i32("q", &[4, 3], &Slice::Full).unwrap_err();
        assert!(
            e.to_string().contains("shape [3, 4], expected [4, 3]"),
            "{e}"
        );
        let e = ck.read_i32("q", &[3, 4], &Slice::Rows(2..4)).unwrap_err();
        assert!(e.to_string().contains("cannot take"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// The writer's header is the crate's: its reader reads the file back.
    #[test]
    fn written_files_read_back_with_the_crate() {
        let d = tmpdir("crate");
        let p = d.join("model.safetensors");
        let bytes = encode(DType::BF16, &[1.0, 2.0, 3.0]);
        write(
            &p,
            &[
                ("z".into(), DType::BF16, vec![3]),
                ("a".into(), DType::F32, vec![1, 1]),
            ],
            &mut |i, out| match i {
                0 => out(&bytes),
                _ => out(&encode(DType::F32, &[4.0])),
            },
        )
        .unwrap();
        let file = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(st.tensor("z").unwrap().data(), &bytes[..]);
        assert_eq!(st.tensor("a").unwrap().shape(), [1, 1]);
        // The header is padded so that the data starts 8-byte aligned.
        let n = u64::from_le_bytes(file[..8].try_into().unwrap());
        assert_eq!(n % 8, 0);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
