//! Owning types for GPU memory, over the driver table: [`CudaBuf`] (private, VMM-shareable,
//! legacy-shareable or imported device memory) and [`HostWords`] (pinned host words the GPU
//! reports errors into). The names say CUDA; the same code serves HIP (renaming is deferred).
//!
//! Owns: allocation, export, import and release; `Drop` releases everything and never panics
//! (errors are logged, as cudarc's `Drop`s record rather than unwrap).
//! Must not: queue work or know about ops.
//!
//! Shareable memory never comes from the stream-ordered pool (`cuMemAllocAsync`): pool memory
//! cannot be exported with `cuIpcGetMemHandle`, and VMM export needs a `cuMemCreate` handle.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use super::ctx::{driver_err, GpuCtx};
use super::IpcMode;
use crate::device::{Export, ExportMeta};
use crate::driver::{DevPtr, IpcHandle, VmmHandle, IPC_HANDLE_BYTES};
use crate::{KernelError, Result};

/// How a [`CudaBuf`]'s memory was obtained, i.e. how it is given back.
enum Backing {
    /// `cuMemAlloc` (private memory, and legacy-shareable memory).
    Alloc,
    /// A VMM mapping: `size` bytes (the padded size) of physical allocation `handle` mapped at
    /// the buffer's address, in a reserved range of the same size.
    Vmm { handle: VmmHandle, size: usize },
    /// A peer's legacy allocation opened with `cuIpcOpenMemHandle`.
    IpcOpened,
    /// Page-locked host memory mapped into the device's address space (`cuMemHostAlloc`
    /// with DEVICEMAP): `host` is its host address, the buffer's address the device's.
    HostMapped { host: *mut u8 },
}

/// Device memory owned by, or mapped into, this process.
pub struct CudaBuf {
    ptr: u64,
    len: usize,
    backing: Backing,
    /// Keeps the context alive (and current-able) for as long as the memory exists.
    ctx: Arc<GpuCtx>,
}

// SAFETY: a CudaBuf is a device address plus ownership; the driver API is thread-safe, and
// concurrent access to the memory is ordered by streams and the communicator's flags, as for
// every device buffer.
unsafe impl Send for CudaBuf {}
// SAFETY: `&CudaBuf` only hands out the device address.
unsafe impl Sync for CudaBuf {}

impl std::fmt::Debug for CudaBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backing {
            Backing::Alloc => "alloc",
            Backing::Vmm { .. } => "vmm",
            Backing::IpcOpened => "ipc",
            Backing::HostMapped { .. } => "host-mapped",
        };
        write!(f, "CudaBuf({kind} {:#x}, {} bytes)", self.ptr, self.len)
    }
}

impl CudaBuf {
    /// Usable bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (valid in this process's context).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn check(&self, offset: usize, bytes: usize) -> Result<()> {
        crate::device::check_range(offset, bytes, self.len)
    }

    /// The device address of byte `offset`, after a bounds check of `bytes` bytes there.
    pub(crate) fn addr(&self, offset: usize, bytes: usize) -> Result<u64> {
        self.check(offset, bytes)?;
        Ok(self.ptr + offset as u64)
    }

    /// Private memory from `cuMemAlloc`, not yet zeroed (the caller queues the memset).
    pub(crate) fn alloc(ctx: &Arc<GpuCtx>, bytes: usize) -> Result<CudaBuf> {
        ctx.bind()?;
        // SAFETY: the context is current (bound above). At least 1 byte: cuMemAlloc rejects 0.
        let ptr = unsafe { ctx.driver().mem_alloc(bytes.max(1)) }
            .map_err(driver_err(format!("allocating {bytes} bytes")))?;
        Ok(CudaBuf {
            ptr: ptr.0,
            len: bytes,
            backing: Backing::Alloc,
            ctx: ctx.clone(),
        })
    }

    /// Page-locked host memory that kernels write through the returned buffer's device
    /// address and the host reads with [`CudaBuf::read_host`]; zeroed.
    pub(crate) fn alloc_mapped(ctx: &Arc<GpuCtx>, bytes: usize) -> Result<CudaBuf> {
        ctx.bind()?;
        // SAFETY: context current; at least 1 byte.
        let (host, d) = unsafe { ctx.driver().host_alloc_mapped(bytes.max(1)) }.map_err(
            driver_err(format!("mapped host allocation of {bytes} bytes")),
        )?;
        // SAFETY: a fresh allocation of at least `bytes` bytes.
        unsafe { std::ptr::write_bytes(host, 0, bytes.max(1)) };
        Ok(CudaBuf {
            ptr: d.0,
            len: bytes,
            backing: Backing::HostMapped { host },
            ctx: ctx.clone(),
        })
    }

    /// The host address of a host-mapped buffer ([`CudaBuf::alloc_mapped`]).
    pub(crate) fn host_ptr(&self) -> Option<*mut u8> {
        match self.backing {
            Backing::HostMapped { host } => Some(host),
            _ => None,
        }
    }

    /// Copies `dst.len()` bytes at `offset` of a host-mapped buffer to `dst`, with volatile
    /// reads (kernels write it behind the compiler's back). The caller has waited for the
    /// work that wrote them (an event; kernels' writes to mapped memory are visible to the
    /// host once an event after them completed).
    pub(crate) fn read_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        let Backing::HostMapped { host } = self.backing else {
            return Err(KernelError::Invalid(
                "read_mapped of a buffer that is not host-mapped".into(),
            ));
        };
        for (i, d) in dst.iter_mut().enumerate() {
            // SAFETY: bounds-checked above; a live pinned allocation.
            *d = unsafe { host.add(offset + i).read_volatile() };
        }
        Ok(())
    }

    /// Shareable memory and its export, in the given (resolved) mode. Not yet zeroed.
    pub(crate) fn alloc_shared(
        ctx: &Arc<GpuCtx>,
        mode: IpcMode,
        bytes: usize,
    ) -> Result<(CudaBuf, Export)> {
        match mode {
            IpcMode::Legacy => {
                let buf = Self::alloc(ctx, bytes)?;
                // SAFETY: `buf.ptr` is the base of a live mem_alloc allocation; context bound
                // in `alloc`.
                let h = unsafe { ctx.driver().ipc_get(DevPtr(buf.ptr)) }
                    .map_err(driver_err("exporting a legacy IPC handle"))?;
                let handle = h.0.to_vec();
                Ok((
                    buf,
                    Export {
                        meta: ExportMeta::CudaLegacy { bytes, handle },
                        fd: None,
                    },
                ))
            }
            IpcMode::Fd | IpcMode::Auto => {
                let (buf, size) = Self::vmm_create(ctx, bytes)?;
                let Backing::Vmm { handle, .. } = buf.backing else {
                    unreachable!("vmm_create returns a VMM buffer")
                };
                // SAFETY: `handle` is live (owned by `buf`) and was created with the POSIX fd
                // handle type.
                let fd = unsafe { ctx.driver().vmm_export_fd(handle) }
                    .map_err(driver_err("exporting a VMM allocation"))?;
                // SAFETY: the driver just created this descriptor for us; nobody else owns it.
                let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                Ok((
                    buf,
                    Export {
                        meta: ExportMeta::CudaVmmFd { bytes: size },
                        fd: Some(fd),
                    },
                ))
            }
        }
    }

    /// A VMM allocation of at least `bytes` bytes, mapped read-write for this device.
    /// Returns the buffer (len = `bytes`) and the padded size.
    fn vmm_create(ctx: &Arc<GpuCtx>, bytes: usize) -> Result<(CudaBuf, usize)> {
        ctx.bind()?;
        let drv = ctx.driver();
        let gran = drv
            .vmm_granularity(ctx.ordinal())
            .map_err(driver_err("VMM granularity"))?
            .max(1);
        let size = bytes.max(1).div_ceil(gran) * gran;
        // SAFETY: context current; size is a multiple of the granularity.
        let handle = unsafe { drv.vmm_create(ctx.ordinal(), size) }
            .map_err(driver_err(format!("VMM allocation of {size} bytes")))?;
        let buf = Self::vmm_map(ctx, handle, size, bytes)?;
        Ok((buf, size))
    }

    /// Reserves an address range for `handle` (`size` bytes), maps it and grants this device
    /// read-write access. Takes ownership of `handle` (released on error).
    fn vmm_map(ctx: &Arc<GpuCtx>, handle: VmmHandle, size: usize, len: usize) -> Result<CudaBuf> {
        let drv = ctx.driver();
        let release = |e: KernelError| {
            // SAFETY: `handle` is owned here and released once, on this error path only.
            if let Err(re) = unsafe { drv.vmm_release(handle) } {
                tracing::warn!("releasing a VMM allocation after a failed mapping: {re}");
            }
            e
        };
        // SAFETY: context bound by the caller.
        let ptr = unsafe { drv.vmm_reserve(size) }
            .map_err(driver_err(format!(
                "reserving {size} bytes of address space"
            )))
            .map_err(release)?;
        // SAFETY: `ptr..ptr+size` was just reserved and is unmapped; `handle` is live.
        if let Err(e) = unsafe { drv.vmm_map(ptr, size, handle) } {
            // SAFETY: reserved above, nothing mapped, freed once.
            let _ = unsafe { drv.vmm_address_free(ptr, size) };
            return Err(release(driver_err("mapping a VMM allocation")(e)));
        }
        // From here on the buffer's Drop undoes everything.
        let buf = CudaBuf {
            ptr: ptr.0,
            len,
            backing: Backing::Vmm { handle, size },
            ctx: ctx.clone(),
        };
        // SAFETY: the range is mapped.
        unsafe { drv.vmm_set_access(ptr, size, ctx.ordinal()) }
            .map_err(driver_err("granting access to a VMM mapping"))?;
        Ok(buf)
    }

    /// Maps a peer's export into this process.
    pub(crate) fn import(ctx: &Arc<GpuCtx>, export: Export) -> Result<CudaBuf> {
        ctx.bind()?;
        match (export.meta, export.fd) {
            (ExportMeta::CudaVmmFd { bytes }, Some(fd)) => {
                // SAFETY: `fd` is open (we own it) and a context is current. The fd is not
                // consumed: it closes when `fd` drops at the end of this function, and the
                // imported handle keeps the memory alive.
                let handle = unsafe { ctx.driver().vmm_import_fd(fd.as_raw_fd()) }
                    .map_err(driver_err("importing a VMM allocation"))?;
                Self::vmm_map(ctx, handle, bytes, bytes)
            }
            (ExportMeta::CudaLegacy { bytes, handle }, _) => {
                let h: [u8; IPC_HANDLE_BYTES] = handle.as_slice().try_into().map_err(|_| {
                    KernelError::Invalid(format!(
                        "a legacy IPC handle has {IPC_HANDLE_BYTES} bytes, got {}",
                        handle.len()
                    ))
                })?;
                // SAFETY: context current.
                let ptr = unsafe { ctx.driver().ipc_open(&IpcHandle(h)) }.map_err(driver_err(
                    "opening a legacy IPC handle (a handle from this same process cannot be \
                     opened)",
                ))?;
                Ok(CudaBuf {
                    ptr: ptr.0,
                    len: bytes,
                    backing: Backing::IpcOpened,
                    ctx: ctx.clone(),
                })
            }
            (meta, _) => Err(KernelError::Invalid(format!(
                "the cuda backend cannot import {meta:?} (a peer on another backend, or an fd \
                 that did not arrive?)"
            ))),
        }
    }
}

impl Drop for CudaBuf {
    fn drop(&mut self) {
        // Never panics: every failure is logged and the rest is still released. Queued work
        // using this memory must be finished by now (callers sync before dropping buffers;
        // CudaDevice::drop synchronises its stream).
        // A failed bind is logged and the release still tried (the context is most likely
        // current anyway; the runtime reports it if not).
        if let Err(e) = self.ctx.bind() {
            tracing::warn!("freeing {self:?}: cannot bind its context: {e}");
        }
        let drv = self.ctx.driver();
        let p = DevPtr(self.ptr);
        // In every arm the memory was obtained as `backing` says, in this context, and is
        // released exactly once, here.
        let r = match self.backing {
            // SAFETY: see above (mem_alloc'd).
            Backing::Alloc => unsafe { drv.mem_free(p) },
            // SAFETY: see above (opened with ipc_open).
            Backing::IpcOpened => unsafe { drv.ipc_close(p) },
            // SAFETY: see above (host_alloc_mapped).
            Backing::HostMapped { host } => unsafe { drv.host_free(host) },
            // SAFETY: see above; unmapped before its range is freed, and the physical handle
            // released last (the driver frees the memory once no mapping refers to it).
            Backing::Vmm { handle, size } => unsafe {
                let a = drv.vmm_unmap(p, size);
                let b = drv.vmm_address_free(p, size);
                let c = drv.vmm_release(handle);
                a.and(b).and(c)
            },
        };
        if let Err(e) = r {
            tracing::warn!("freeing {self:?}: {e}");
        }
    }
}

/// Words of pinned host memory that kernels write (through their device address) and the host
/// reads after synchronising: the channel for device-side errors (timeouts, epoch mismatch).
pub(crate) struct HostWords {
    host: *mut u32,
    dev: u64,
    n: usize,
    ctx: Arc<GpuCtx>,
}

// SAFETY: pinned host memory addressed by raw pointer; the host reads it only after a stream
// synchronisation, when no kernel writes it, and writes it only then too.
unsafe impl Send for HostWords {}
// SAFETY: as above.
unsafe impl Sync for HostWords {}

impl HostWords {
    pub(crate) fn new(ctx: &Arc<GpuCtx>, n: usize) -> Result<HostWords> {
        ctx.bind()?;
        // SAFETY: context current.
        let (h, d) = unsafe { ctx.driver().host_alloc_mapped(n * 4) }
            .map_err(driver_err("mapped host allocation of the error words"))?;
        let w = HostWords {
            host: h.cast(),
            dev: d.0,
            n,
            ctx: ctx.clone(),
        };
        for i in 0..n {
            w.set(i, 0);
        }
        Ok(w)
    }

    pub(crate) fn device_addr(&self) -> u64 {
        self.dev
    }

    /// Reads word `i`. Volatile: the GPU wrote it behind the compiler's back. Call only after
    /// the stream that writes it has synchronised (which orders the GPU's writes, made with a
    /// system-scope fence, before this read).
    pub(crate) fn get(&self, i: usize) -> u32 {
        assert!(i < self.n);
        // SAFETY: in bounds of a live pinned allocation, 4-byte aligned.
        unsafe { self.host.add(i).read_volatile() }
    }

    /// Writes word `i` (only while no kernel that writes these words is queued or running).
    pub(crate) fn set(&self, i: usize, v: u32) {
        assert!(i < self.n);
        // SAFETY: as in `get`.
        unsafe { self.host.add(i).write_volatile(v) }
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.bind() {
            tracing::warn!("freeing the error words: cannot bind the context: {e}");
        }
        // SAFETY: allocated by host_alloc_mapped in this context, freed once; the owning
        // device synchronised its stream before dropping us.
        if let Err(e) = unsafe { self.ctx.driver().host_free(self.host.cast()) } {
            tracing::warn!("freeing the error words: {e}");
        }
    }
}
