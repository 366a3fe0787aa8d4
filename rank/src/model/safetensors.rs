//! Reading a rank's slices of a Hugging Face checkpoint: `model.safetensors`, or the shards
//! named by `model.safetensors.index.json`, memory-mapped and parsed here (the format is an
//! 8-byte little-endian header length, a JSON header, then the tensors' bytes).
//!
//! Only the bytes of this rank's slice are touched (a row range is one contiguous run; a
//! column range is one run per row), so a rank of an 8-way job reads about an eighth of the
//! checkpoint from the page cache. Every failure names the file and, where there is one, the
//! tensor.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde_json::Value;
use tprun_kernels::dtype::{decode, encode};
use tprun_kernels::DType;

use super::ModelError;

/// Largest JSON header accepted (the format's own reference reader caps it at 100 MB).
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
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    range: Range<usize>,
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
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: a file-backed map is undefined behaviour if another process truncates or
        // rewrites the file while it is mapped. Checkpoints are read-only inputs; we map them
        // read-only and copy each slice out once, at load time (memmap2's documented caveat).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let tensors = parse_header(path, &map)?;
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

fn parse_header(path: &Path, map: &[u8]) -> Result<HashMap<String, TensorInfo>, ModelError> {
    let bad = |why: String| ModelError::Header {
        file: path.to_path_buf(),
        why,
    };
    if map.len() < 8 {
        return Err(bad(format!(
            "truncated: {} bytes, shorter than the 8-byte header length",
            map.len()
        )));
    }
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER || 8 + n > map.len() as u64 {
        return Err(bad(format!(
            "corrupted or truncated header: it claims {n} bytes, the file has {}",
            map.len()
        )));
    }
    let base = 8 + n as usize;
    let header: Value = serde_json::from_slice(&map[8..base])
        .map_err(|e| bad(format!("corrupted header: not valid JSON ({e})")))?;
    let Value::Object(entries) = header else {
        return Err(bad("corrupted header: not a JSON object".into()));
    };
    let mut out = HashMap::new();
    for (name, e) in &entries {
        if name == "__metadata__" {
            continue;
        }
        let tbad = |why: String| ModelError::Tensor {
            file: path.to_path_buf(),
            tensor: name.clone(),
            why,
        };
        let dtype_s = e
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| tbad("header entry has no dtype".into()))?;
        let dtype = match dtype_s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            other => {
                return Err(tbad(format!(
                    "dtype {other} is not supported (F32, F16, BF16)"
                )))
            }
        };
        let shape = e
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().map(|x| x as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| tbad("header entry has no valid shape".into()))?;
        let offs = e
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| match a.as_slice() {
                [s, t] => Some((s.as_u64()? as usize, t.as_u64()? as usize)),
                _ => None,
            })
            .ok_or_else(|| tbad("header entry has no valid data_offsets".into()))?;
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| tbad(format!("shape {shape:?} overflows")))?;
        if offs.1 < offs.0 || offs.1 - offs.0 != numel * dtype.size() {
            return Err(tbad(format!(
                "data_offsets {:?} do not hold {shape:?} {dtype}",
                [offs.0, offs.1]
            )));
        }
        let range = base + offs.0..base + offs.1;
        if range.end > map.len() {
            return Err(tbad(format!(
                "truncated file: the tensor ends at byte {}, the file has {}",
                range.end,
                map.len()
            )));
        }
        out.insert(
            name.clone(),
            TensorInfo {
                dtype,
                shape,
                range,
            },
        );
    }
    Ok(out)
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
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| ModelError::io(&index_path, e))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
                file: index_path.clone(),
                field: "(syntax)".into(),
                why: format!("not valid JSON: {e}"),
            })?;
            let wm = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ModelError::Config {
                    file: index_path.clone(),
                    field: "weight_map".into(),
                    why: "missing or not an object".into(),
                })?;
            for (t, f) in wm {
                let f = f.as_str().ok_or_else(|| ModelError::Config {
                    file: index_path.clone(),
                    field: format!("weight_map.{t}"),
                    why: "expected a file name".into(),
                })?;
                if f.contains('/') || f.contains("..") {
                    return Err(ModelError::Config {
                        file: index_path.clone(),
                        field: format!("weight_map.{t}"),
                        why: format!("{f:?} is not a file name in the model directory"),
                    });
                }
                if !names.iter().any(|n| n == f) {
                    names.push(f.to_string());
                }
                weight_map.push((t.clone(), f.to_string()));
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
        let tbad = |why: String| ModelError::Tensor {
            file: f.path.clone(),
            tensor: name.into(),
            why,
        };
        if t.shape != shape {
            return Err(tbad(format!("shape {:?}, expected {shape:?}", t.shape)));
        }
        let data = &f.map[t.range.clone()];
        let es = t.dtype.size();
        let rows = shape.first().copied().unwrap_or(1);
        let row_elems: usize = shape.iter().skip(1).product();
        // The source runs to copy, as (first element, elements).
        let runs: Vec<(usize, usize)> = match slice {
            Slice::Full => vec![(0, rows * row_elems)],
            Slice::Rows(r) if r.end <= rows => vec![(r.start * row_elems, r.len() * row_elems)],
            Slice::Cols(c) if shape.len() == 2 && c.end <= row_elems => (0..rows)
                .map(|i| (i * row_elems + c.start, c.len()))
                .collect(),
            _ => return Err(tbad(format!("cannot take {slice:?} of shape {shape:?}"))),
        };
        let mut out_off = 0;
        // Gather runs into chunks of about CHUNK_BYTES source bytes, convert, hand over.
        let mut pending: Vec<u8> = Vec::new();
        let mut flush = |pending: &mut Vec<u8>, out_off: &mut usize| -> Result<(), ModelError> {
            if pending.is_empty() {
                return Ok(());
            }
            if t.dtype == dtype {
                sink(*out_off, pending)?;
                *out_off += pending.len();
            } else {
                let conv = encode(dtype, &decode(t.dtype, pending));
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

    /// The dtype the checkpoint stores `name` in.
    pub fn dtype_of(&self, name: &str) -> Result<DType, ModelError> {
        Ok(self.info(name)?.1.dtype)
    }
}

/// Writes a safetensors file from `(name, dtype, shape)` entries, pulling each tensor's bytes
/// from `data` in order, so that nothing larger than one chunk is held in memory.
pub fn write(
    path: &Path,
    tensors: &[(String, DType, Vec<usize>)],
    data: &mut TensorSource<'_>,
) -> Result<(), ModelError> {
    use std::io::Write;
    let io = |e| ModelError::io(path, e);
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut off = 0usize;
    for (name, dtype, shape) in tensors {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let dt = match dtype {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::U32 => "U32",
        };
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [off, off + bytes]}),
        );
        off += bytes;
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).expect("json");
    // Pad with spaces to a multiple of 8 so that the data starts aligned (as the format's
    // reference writer does).
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let f = std::fs::File::create(path).map_err(io)?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    w.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&h).map_err(io)?;
    for (i, (name, dtype, shape)) in tensors.iter().enumerate() {
        let want = shape.iter().product::<usize>() * dtype.size();
        let mut got = 0usize;
        data(i, &mut |b: &[u8]| {
            got += b.len();
            w.write_all(b)
        })
        .map_err(io)?;
        if got != want {
            return Err(ModelError::Tensor {
                file: path.into(),
                tensor: name.clone(),
                why: format!("writer produced {got} bytes, expected {want}"),
            });
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

        // Unsupported dtype.
        let hdr = br#"{"w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
        let mut f = (hdr.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(hdr);
        f.extend_from_slice(&[0; 8]);
        std::fs::write(&p, &f).unwrap();
        let e = Checkpoint::open(&d).err().unwrap().to_string();
        assert!(e.contains("`w`") && e.contains("I64"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
