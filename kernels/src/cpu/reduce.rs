//! CPU twins of the data-movement ops: `Copy` and `ReduceSum`.

use super::{par_ranges, CpuBuf, CpuDevice};
use crate::dtype::Elem;
use crate::{with_dtype, KernelError, Result, View};

/// Elements per block of the reduction loop: small enough for an f32 accumulator block to stay
/// in L1 (4 KiB), large enough that the inner loops vectorise.
const BLOCK: usize = 1024;
/// Below this many elements per thread, threads cost more than they save.
const MIN_PER_THREAD: usize = 1 << 16;

/// A raw pointer that may cross into scoped worker threads; each worker touches a disjoint
/// element range.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);
// SAFETY: only used to hand disjoint ranges of one buffer to scoped threads.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so that closures capture the whole `SendPtr`, not its field).
    #[inline(always)]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

pub(crate) fn copy(dev: &CpuDevice, src: &View<'_, CpuBuf>, dst: &View<'_, CpuBuf>) -> Result<()> {
    if src.len != dst.len {
        return Err(KernelError::Invalid(format!(
            "copy of {} elements into {}",
            src.len, dst.len
        )));
    }
    if src.dtype == dst.dtype {
        src.buf.check(src.offset, src.bytes())?;
        dst.buf.check(dst.offset, dst.bytes())?;
        let s = SendPtr(src.buf.ptr().wrapping_add(src.offset));
        let d = SendPtr(dst.buf.ptr().wrapping_add(dst.offset));
        par_ranges(dev.threads(), src.bytes(), MIN_PER_THREAD * 4, |r| {
            // SAFETY: both ranges were bounds-checked; `std::ptr::copy` allows overlap.
            unsafe { std::ptr::copy(s.get().add(r.start), d.get().add(r.start), r.len()) };
        });
        return Ok(());
    }
    with_dtype!(src.dtype, S => with_dtype!(dst.dtype, D => {
        let s = SendPtr(src.buf.typed::<S>(src.offset, src.len, src.dtype)?);
        let d = SendPtr(dst.buf.typed::<D>(dst.offset, dst.len, dst.dtype)?);
        par_ranges(dev.threads(), src.len, MIN_PER_THREAD, |r| {
            for i in r {
                // SAFETY: i < len, both views bounds-checked above.
                unsafe { *d.get().add(i) = D::from_f32((*s.get().add(i)).to_f32()) };
            }
        });
    }));
    Ok(())
}

pub(crate) fn reduce_sum(
    dev: &CpuDevice,
    inputs: &[View<'_, CpuBuf>],
    out: &View<'_, CpuBuf>,
) -> Result<()> {
    if inputs.is_empty() {
        return Err(KernelError::Invalid("reduce_sum of no inputs".into()));
    }
    for v in inputs {
        if v.len != out.len || v.dtype != out.dtype {
            return Err(KernelError::Invalid(format!(
                "reduce_sum input of {} {} into {} {}",
                v.len, v.dtype, out.len, out.dtype
            )));
        }
    }
    with_dtype!(out.dtype, T => {
        let ins = inputs
            .iter()
            .map(|v| v.buf.typed::<T>(v.offset, v.len, v.dtype).map(SendPtr))
            .collect::<Result<Vec<_>>>()?;
        let o = SendPtr(out.buf.typed::<T>(out.offset, out.len, out.dtype)?);
        par_ranges(dev.threads(), out.len, MIN_PER_THREAD, |r| {
            // SAFETY: every pointer was bounds-checked for out.len elements; ranges are
            // disjoint across threads; `out` may equal an input, which is fine because each
            // element is read from every input before it is written.
            unsafe { sum_range::<T>(&ins, o, r) };
        });
    });
    Ok(())
}

/// `out[i] = ((in0[i] + in1[i]) + in2[i]) + …` in f32, then rounded once to `T`.
///
/// The accumulator starts at `in0[i]` (not at 0.0, which would turn a -0.0 sum into +0.0):
/// GPU kernels follow the same order so that every backend and every rank gets the same bits.
///
/// # Safety
/// Every pointer must be valid for the elements of `r`; `out` may alias an input only
/// element-for-element.
pub(crate) unsafe fn sum_range<T: Elem>(
    ins: &[SendPtr<T>],
    out: SendPtr<T>,
    r: std::ops::Range<usize>,
) {
    let mut acc = [0f32; BLOCK];
    let mut start = r.start;
    while start < r.end {
        let n = BLOCK.min(r.end - start);
        let acc = &mut acc[..n];
        // SAFETY: start..start+n lies inside r, valid per the contract.
        let first = unsafe { std::slice::from_raw_parts(ins[0].get().add(start), n) };
        for (a, x) in acc.iter_mut().zip(first) {
            *a = x.to_f32();
        }
        for p in &ins[1..] {
            // SAFETY: as above.
            let xs = unsafe { std::slice::from_raw_parts(p.get().add(start), n) };
            for (a, x) in acc.iter_mut().zip(xs) {
                *a += x.to_f32();
            }
        }
        for (i, a) in acc.iter().enumerate() {
            // SAFETY: as above; written after every input element i was read.
            unsafe { *out.get().add(start + i) = T::from_f32(*a) };
        }
        start += n;
    }
}
