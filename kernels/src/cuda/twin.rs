//! The one generic twin test: any op, run on the CUDA backend and on its CPU twin with the same
//! random inputs, outputs poisoned first (0xff bytes: NaN in every float dtype, so an element
//! the kernel never wrote can never pass), then compared element by element.
//!
//! A case ([`TwinCase`]) names its buffers and builds its op over views of either backend's
//! buffers; [`run`] does the rest. `tprun selftest` runs every case the decode ops register
//! ([`cases`]).

use super::{CudaBuf, CudaDevice};
use crate::cpu::{CpuBuf, CpuDevice};
use crate::device::{Device, Op, View};
use crate::dtype::decode;
use crate::{DType, Result};

use super::selftest::SelftestResult;

/// One buffer of a case: its dtype, its element count, and its initial contents (`None`:
/// poisoned, i.e. an output the op must write in full).
pub(crate) struct Buf {
    pub dtype: DType,
    pub len: usize,
    pub init: Option<Vec<u8>>,
    /// Compared after the run (outputs and in/out buffers).
    pub check: bool,
}

impl Buf {
    /// An input: given contents, not compared.
    pub(crate) fn input(dtype: DType, bytes: Vec<u8>) -> Buf {
        Buf {
            dtype,
            len: bytes.len() / dtype.size(),
            init: Some(bytes),
            check: false,
        }
    }
    /// An output: poisoned, compared.
    pub(crate) fn output(dtype: DType, len: usize) -> Buf {
        Buf {
            dtype,
            len,
            init: None,
            check: true,
        }
    }
    /// Updated in place: given contents, compared.
    pub(crate) fn inout(dtype: DType, bytes: Vec<u8>) -> Buf {
        Buf {
            dtype,
            len: bytes.len() / dtype.size(),
            init: Some(bytes),
            check: true,
        }
    }
    /// An output that only some elements of are written (a KV cache row, a scratch area):
    /// filled with `init`, compared in full (so stray writes show).
    pub(crate) fn partial(dtype: DType, bytes: Vec<u8>) -> Buf {
        Self::inout(dtype, bytes)
    }
}

/// How close the GPU result must be.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Tol {
    /// Bit for bit.
    Exact,
    /// |gpu − cpu| ≤ tol · (1 + |cpu|) for every float element (u32 must match exactly).
    Rel(f32),
}

/// A twin test case.
pub(crate) trait TwinCase {
    /// "rms_norm f32 rows 3 dim 4096", for the report.
    fn name(&self) -> String;
    /// The dtype and element count the report shows.
    fn shape(&self) -> (DType, usize);
    /// The buffers, in the order [`TwinCase::op`] receives their views.
    fn bufs(&self) -> Vec<Buf>;
    /// The op over views of the buffers (one whole-buffer view each, in `bufs` order).
    fn op<'a, B>(&self, v: &'a [View<'a, B>]) -> Op<'a, B>;
    fn tol(&self) -> Tol;
    /// For [`Tol::Rel`]: per element of checked buffer `buf`, the magnitude its rounding
    /// error scales with, where that is not `1 + |cpu|` (then |gpu − cpu| ≤ tol · magnitude).
    /// E.g. `silu(a) · b` computed from f32 sums a and b: its error is ~|b| · δa, which can
    /// be far above |silu(a) · b| when a is near 0.
    fn magnitudes(&self, _buf: usize) -> Option<Vec<f32>> {
        None
    }
}

fn setup<D: Device>(dev: &D, bufs: &[Buf]) -> Result<Vec<D::Buf>> {
    bufs.iter()
        .map(|b| {
            let bytes = b.len * b.dtype.size();
            let buf = dev.alloc(bytes.max(1))?;
            match &b.init {
                Some(init) => dev.write(&buf, 0, init)?,
                None => dev.write(&buf, 0, &vec![0xffu8; bytes])?,
            }
            Ok(buf)
        })
        .collect()
}

fn views<'a, B>(bufs: &'a [B], spec: &[Buf]) -> Vec<View<'a, B>> {
    bufs.iter()
        .zip(spec)
        .map(|(b, s)| View::new(b, 0, s.len, s.dtype))
        .collect()
}

fn read<D: Device>(dev: &D, buf: &D::Buf, spec: &Buf) -> Result<Vec<u8>> {
    let mut out = vec![0u8; spec.len * spec.dtype.size()];
    dev.read(buf, 0, &mut out)?;
    Ok(out)
}

/// Why `got` is not close enough to `want`, or `None`.
fn differ(spec: &Buf, got: &[u8], want: &[u8], tol: Tol, mags: Option<&[f32]>) -> Option<String> {
    if spec.dtype == DType::U32 || tol == Tol::Exact {
        let e = spec.dtype.size();
        return got
            .chunks(e)
            .zip(want.chunks(e))
            .position(|(a, b)| a != b)
            .map(|i| {
                format!(
                    "element {i}: got {:02x?}, expected {:02x?}",
                    &got[i * e..(i + 1) * e],
                    &want[i * e..(i + 1) * e]
                )
            });
    }
    let Tol::Rel(t) = tol else { unreachable!() };
    let (g, w) = (decode(spec.dtype, got), decode(spec.dtype, want));
    let mag = |i: usize| mags.map_or(1.0 + w[i].abs(), |m| m[i]);
    g.iter()
        .zip(&w)
        .enumerate()
        .position(|(i, (a, b))| {
            let same_nan = a.is_nan() && b.is_nan();
            let close = (a - b).abs() <= t * mag(i);
            !same_nan && !close
        })
        .map(|i| {
            format!(
                "element {i}: got {}, expected {} (tolerance {t} of {})",
                g[i],
                w[i],
                mag(i)
            )
        })
}

/// [`TwinCase::magnitudes`] of a SiluMul epilogue's output y = silu(a) · b, [m, h]: (1 + |a|) ·
/// (1 + |b|) per element, from `sum(t, row)`, the f64 product of token t and row `row` (gate
/// rows j < h, up rows h + j).
pub(crate) fn glu_magnitudes(m: usize, h: usize, sum: impl Fn(usize, usize) -> f64) -> Vec<f32> {
    let mut out = Vec::with_capacity(m * h);
    for t in 0..m {
        for j in 0..h {
            out.push(((1.0 + sum(t, j).abs()) * (1.0 + sum(t, h + j).abs())) as f32);
        }
    }
    out
}

/// Runs `case` on one device alone (outputs poisoned first) and returns every buffer's bytes
/// afterwards, in `bufs` order: for tests that look at one backend's results.
#[cfg(test)]
pub(crate) fn run_alone<D: Device, C: TwinCase>(dev: &D, case: &C) -> Result<Vec<Vec<u8>>> {
    let spec = case.bufs();
    let bufs: Vec<D::Buf> = setup(dev, &spec)?;
    {
        let v = views(&bufs, &spec);
        dev.run(&case.op(&v))?;
    }
    bufs.iter()
        .zip(&spec)
        .map(|(b, s)| read(dev, b, s))
        .collect()
}

/// Runs `case` on the GPU and on the CPU twin and compares every checked buffer.
pub(crate) fn run<C: TwinCase>(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    case: &C,
) -> Result<SelftestResult> {
    let spec = case.bufs();
    let gb: Vec<CudaBuf> = setup(gpu, &spec)?;
    let cb: Vec<CpuBuf> = setup(cpu, &spec)?;
    {
        let gv = views(&gb, &spec);
        gpu.run(&case.op(&gv))?;
        gpu.sync()?;
        let cv = views(&cb, &spec);
        cpu.run(&case.op(&cv))?;
    }
    let (dtype, elems) = case.shape();
    let mut detail = String::new();
    for (i, s) in spec.iter().enumerate().filter(|(_, s)| s.check) {
        let (g, c) = (read(gpu, &gb[i], s)?, read(cpu, &cb[i], s)?);
        if let Some(d) = differ(s, &g, &c, case.tol(), case.magnitudes(i).as_deref()) {
            detail = format!("buffer {i}: {d}");
            break;
        }
    }
    Ok(SelftestResult {
        op: case.name(),
        dtype,
        elems,
        ok: detail.is_empty(),
        detail,
    })
}

/// Every decode-op twin case, over random inputs from `seed`: the op families register
/// theirs here.
pub(crate) fn cases(gpu: &CudaDevice, cpu: &CpuDevice, seed: u64) -> Result<Vec<SelftestResult>> {
    let mut out = Vec::new();
    out.extend(super::ops_decode::selftest(gpu, cpu, seed)?);
    out.extend(super::ops_gemv::selftest(gpu, cpu, seed)?);
    out.extend(super::ops_gemv_q4::selftest(gpu, cpu, seed)?);
    out.extend(super::ops_attention::selftest(gpu, cpu, seed)?);
    out.extend(super::ops_sample::selftest(gpu, cpu, seed)?);
    out.extend(super::ops_delta::selftest(gpu, cpu, seed)?);
    Ok(out)
}

/// Helpers the op families' tests share.
#[cfg(test)]
pub(crate) mod testing {
    use super::super::CudaDevice;
    use super::SelftestResult;

    /// The value of `#define NAME value` in a kernel source (a trailing `//` comment cut), so
    /// that tests can hold the Rust mirrors of the sources' constants to them.
    pub(crate) fn cu_define(src: &str, name: &str) -> String {
        let head = format!("#define {name} ");
        let line = src
            .lines()
            .find(|l| l.starts_with(&head))
            .unwrap_or_else(|| panic!("{name} not defined"));
        line[head.len()..]
            .split("//")
            .next()
            .unwrap_or("")
            .trim()
            .to_string()
    }

    /// The GPU, or None after printing "skipped: no GPU" (a panic under
    /// `TPRUN_REQUIRE_GPU=1`).
    pub(crate) fn gpu_or_skip() -> Option<CudaDevice> {
        super::super::selftest::tests::gpu_or_skip()?;
        Some(CudaDevice::new(0, crate::cuda::IpcMode::Auto).expect("a usable GPU"))
    }

    /// Prints the count and every failure of a family's twin cases, and fails on any.
    pub(crate) fn assert_all_ok(what: &str, results: &[SelftestResult]) {
        let bad: Vec<_> = results.iter().filter(|r| !r.ok).collect();
        println!(
            "{what} twins: {} cases, {} failed",
            results.len(),
            bad.len()
        );
        for r in &bad {
            println!("FAIL {}: {}", r.op, r.detail);
        }
        assert!(bad.is_empty());
    }
}
