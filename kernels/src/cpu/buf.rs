//! Host memory for the CPU backend: private (heap) or shareable (memfd, `MAP_SHARED`).

use std::alloc::Layout;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use memmap2::MmapRaw;

use crate::{DType, KernelError, Result};

/// Alignment of every CPU buffer: a cache line, so that vector loads never split lines at 0.
const ALIGN: usize = 64;

enum Backing {
    Heap(Layout),
    /// Held only so that the mapping lives exactly as long as the buffer.
    Map(#[allow(dead_code)] MmapRaw),
}

/// A CPU buffer. Ops access it through raw pointers, like device memory: the type gives no
/// aliasing guarantees, and the caller of [`Device::run`](crate::Device::run) keeps an op's
/// output from overlapping another live op's data.
pub struct CpuBuf {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: a CpuBuf is plain memory; concurrent access is coordinated by the ops and by the
// communicator's flags and barriers, exactly as for device memory.
unsafe impl Send for CpuBuf {}
// SAFETY: as above; `&CpuBuf` hands out only raw pointers.
unsafe impl Sync for CpuBuf {}

impl CpuBuf {
    pub(crate) fn heap(bytes: usize) -> Result<CpuBuf> {
        let layout = Layout::from_size_align(bytes.max(1), ALIGN)
            .map_err(|e| KernelError::Invalid(format!("allocation of {bytes} bytes: {e}")))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            KernelError::Backend(format!("out of host memory allocating {bytes} bytes"))
        })?;
        Ok(CpuBuf {
            ptr,
            len: bytes,
            backing: Backing::Heap(layout),
        })
    }

    /// A new memfd of `bytes` bytes (zero-filled by the kernel), mapped shared.
    pub(crate) fn memfd(bytes: usize) -> Result<(CpuBuf, OwnedFd)> {
        let fd =
            nix::sys::memfd::memfd_create(c"tprun-comm", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
                .map_err(|e| KernelError::os("memfd_create", e))?;
        nix::unistd::ftruncate(&fd, bytes.max(1) as i64)
            .map_err(|e| KernelError::os(format!("sizing a {bytes}-byte memfd"), e))?;
        let buf = Self::map_memfd(std::os::fd::AsFd::as_fd(&fd), bytes)?;
        Ok((buf, fd))
    }

    /// Maps `bytes` bytes of a memfd (our own or a peer's) shared and read-write.
    pub(crate) fn map_memfd(fd: BorrowedFd<'_>, bytes: usize) -> Result<CpuBuf> {
        let real = nix::sys::stat::fstat(fd)
            .map_err(|e| KernelError::os("fstat of a peer's memfd", e))?
            .st_size as usize;
        if real < bytes.max(1) {
            return Err(KernelError::Invalid(format!(
                "memfd holds {real} bytes, the export claims {bytes}"
            )));
        }
        let map = memmap2::MmapOptions::new()
            .len(bytes.max(1))
            .map_raw(&fd)
            .map_err(|e| KernelError::os(format!("mapping a {bytes}-byte memfd"), e))?;
        let ptr = NonNull::new(map.as_mut_ptr()).expect("mmap never returns null");
        Ok(CpuBuf {
            ptr,
            len: bytes,
            backing: Backing::Map(map),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub(crate) fn check(&self, offset: usize, bytes: usize) -> Result<()> {
        crate::device::check_range(offset, bytes, self.len)
    }

    /// A raw typed pointer to element 0 of a view at `offset`, after bounds and alignment
    /// checks.
    pub(crate) fn typed<T>(&self, offset: usize, len: usize, dtype: DType) -> Result<*mut T> {
        debug_assert_eq!(std::mem::size_of::<T>(), dtype.size());
        self.check(offset, len * dtype.size())?;
        let p = self.ptr().wrapping_add(offset);
        if !(p as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(KernelError::Invalid(format!(
                "offset {offset} is not aligned for {dtype}"
            )));
        }
        Ok(p.cast())
    }
}

impl Drop for CpuBuf {
    fn drop(&mut self) {
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: allocated by `alloc_zeroed` with this layout in `heap`, freed once here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
        // Backing::Map unmaps itself when the MmapRaw drops.
    }
}
