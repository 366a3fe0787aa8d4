//! CPU twins of the decode ops: embedding, RMSNorm, RoPE, attention, the elementwise ops and
//! the matrix products. Each file owns one op family and its test against a plain f64
//! reference on seeded random inputs.
//!
//! Activations are f32 on every backend; weights and KV caches may be f32, f16 or bf16 and are
//! widened to f32 as they are read (one `with_dtype!` per op). Threads split the output rows
//! with [`par_ranges`](super::par_ranges); each worker writes only its own rows.

pub(crate) mod attention;
pub(crate) mod decode;
pub(crate) mod delta;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod int4;
pub(crate) mod matmul;
pub(crate) mod norm;
pub(crate) mod rope;

use super::reduce::SendPtr;
use super::CpuBuf;
use crate::dtype::Elem;
use crate::{DType, KernelError, Result, View};

/// Below this many multiply–adds per thread, starting a thread (~20 µs) costs more than it
/// saves (a rough figure for current x86-64 cores at a few GFLOP/s per core).
pub(crate) const MIN_WORK_PER_THREAD: usize = 1 << 15;

/// Checks that `v` is an f32 view of at least `len` elements and returns its element 0.
pub(crate) fn f32_ptr(v: &View<'_, CpuBuf>, len: usize, what: &str) -> Result<SendPtr<f32>> {
    if v.dtype != DType::F32 {
        return Err(KernelError::Invalid(format!(
            "{what} must be f32, got {}",
            v.dtype
        )));
    }
    typed_ptr::<f32>(v, len, what)
}

/// Checks that `v` holds at least `len` elements and returns a typed pointer to element 0.
pub(crate) fn typed_ptr<T>(v: &View<'_, CpuBuf>, len: usize, what: &str) -> Result<SendPtr<T>> {
    if v.len < len {
        return Err(KernelError::Invalid(format!(
            "{what} holds {} elements, the op needs {len}",
            v.len
        )));
    }
    Ok(SendPtr(v.buf.typed::<T>(v.offset, len, v.dtype)?))
}

/// Accumulator lanes of [`dot`]: 16 f32 = two AVX2 or four SSE registers.
pub(crate) const DOT_LANES: usize = 16;

/// `Σ a[i]·b[i]` in f32 with 16 independent accumulators (lane j sums the elements j mod 16),
/// so that the loop vectorises and the rounding error grows with len/16 rather than len; the
/// lanes are then folded pairwise and the tail added.
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    const L: usize = DOT_LANES;
    let mut acc = [0f32; L];
    let ca = a.chunks_exact(L);
    let cb = b.chunks_exact(L);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for j in 0..L {
            acc[j] += x[j] * y[j];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ta.iter().zip(tb) {
        tail += x * y;
    }
    fold_lanes(acc) + tail
}

/// Pairwise sum of the lanes: ((0+8)+(4+12)) + … in a fixed order.
#[inline(always)]
pub(crate) fn fold_lanes(mut acc: [f32; DOT_LANES]) -> f32 {
    let mut w = DOT_LANES;
    while w > 1 {
        w /= 2;
        for j in 0..w {
            acc[j] += acc[j + w];
        }
    }
    acc[0]
}

/// Widens `src` to f32 into `dst` (same length), with the `half` crate's slice conversions,
/// which use F16C on x86-64 CPUs that have it (per-element f16 conversion does not).
#[inline(always)]
pub(crate) fn widen<T: Elem>(src: &[T], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    debug_assert_eq!(src.len(), dst.len());
    match T::DTYPE {
        DType::F32 | DType::U32 => {
            for (d, s) in dst.iter_mut().zip(src) {
                *d = s.to_f32();
            }
        }
        DType::F16 => {
            // SAFETY: the only Elem whose DTYPE is F16 is half::f16, so this is a same-type
            // view of `src`.
            let s =
                unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<half::f16>(), src.len()) };
            s.convert_to_f32_slice(dst);
        }
        DType::BF16 => {
            // SAFETY: as above, for half::bf16.
            let s =
                unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<half::bf16>(), src.len()) };
            s.convert_to_f32_slice(dst);
        }
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    //! Seeded inputs and buffer helpers shared by the op tests.
    use crate::cpu::{CpuBuf, CpuDevice};
    use crate::dtype::{decode, encode};
    use crate::{DType, Device};

    pub use crate::rng::Rng;

    /// The values as `dtype` would store them (what a reference must use).
    pub fn rounded(dtype: DType, v: &[f32]) -> Vec<f32> {
        decode(dtype, &encode(dtype, v))
    }

    pub fn upload(dev: &CpuDevice, dtype: DType, v: &[f32]) -> CpuBuf {
        let b = dev.alloc(v.len() * dtype.size()).unwrap();
        dev.write(&b, 0, &encode(dtype, v)).unwrap();
        b
    }

    pub fn download(dev: &CpuDevice, b: &CpuBuf, dtype: DType, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; n * dtype.size()];
        dev.read(b, 0, &mut bytes).unwrap();
        decode(dtype, &bytes)
    }

    /// A buffer of u32 values (ids, positions) and its view.
    pub fn upload_u32(dev: &CpuDevice, v: &[u32]) -> CpuBuf {
        let b = dev.alloc(v.len() * 4).unwrap();
        dev.write(&b, 0, &crate::dtype::encode_u32(v)).unwrap();
        b
    }

    /// Largest |a − b| / (1 + |b|).
    pub fn max_err(a: &[f32], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (x as f64 - y).abs() / (1.0 + y.abs()))
            .fold(0.0, f64::max)
    }
}
