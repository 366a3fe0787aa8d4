//! The driver-API table the GPU backend is written over: the few runtime operations it needs
//! (devices, contexts, memory, legacy IPC, VMM, streams, graphs, events, modules, launches),
//! with two implementations loaded at run time: CUDA ([`crate::cuda::driver::CudaDriver`],
//! through cudarc) and HIP ([`crate::hip::driver::HipDriver`], libamdhip64 through
//! libloading). What runs on NVIDIA exercises the same backend logic (`crate::cuda`) that runs
//! on AMD; only the calls below differ.
//!
//! Owns: the handle newtypes, the device attributes the backend asks for, the capability
//! flags ([`Caps`]) that say which kernels and launch features a runtime can be trusted with,
//! and [`DriverError`].
//! Must not: own anything. Handles are plain values; the owning types with `Drop` are in
//! `crate::cuda` (`ctx`, `mem`, `launch`).
//!
//! Handles are opaque `u64`s: a pointer-sized runtime handle (`CUstream`, `hipStream_t`, ...)
//! widened, except [`Ctx`] on HIP, which has no context objects in its runtime API: there a
//! `Ctx` is the device ordinal + 1 (so that 0 is never a valid context, as a null `CUcontext`
//! is not), and making it current is `hipSetDevice(ctx - 1)`.

use std::ffi::c_void;

use crate::KernelError;

/// A context: `CUcontext` (CUDA, the device's primary context), ordinal + 1 (HIP).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ctx(pub u64);
/// A stream (`CUstream`, `hipStream_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stream(pub u64);
/// An event (`CUevent`, `hipEvent_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event(pub u64);
/// A captured graph (`CUgraph`, `hipGraph_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Graph(pub u64);
/// An instantiated graph (`CUgraphExec`, `hipGraphExec_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphExec(pub u64);
/// A loaded code module (`CUmodule`, `hipModule_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Module(pub u64);
/// A kernel of a loaded module (`CUfunction`, `hipFunction_t`); valid while its module is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Function(pub u64);
/// A device address (`CUdeviceptr`, `hipDeviceptr_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevPtr(pub u64);
/// A VMM physical allocation (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmmHandle(pub u64);

/// Bytes of a legacy IPC handle: `CU_IPC_HANDLE_SIZE` (cuda.h) and `HIP_IPC_HANDLE_SIZE`
/// (hip_runtime_api.h) are both 64.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A legacy IPC memory handle (`CUipcMemHandle`, `hipIpcMemHandle_t`), passed by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; IPC_HANDLE_BYTES]);

/// The device attributes the backend reads (each implementation maps them to its own enum:
/// the numbering is the runtime's business, not the backend's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attr {
    /// SMs (CUDA), compute units (HIP).
    MultiprocessorCount,
    ComputeCapabilityMajor,
    ComputeCapabilityMinor,
    /// 32 on NVIDIA, 64 on gfx9 AMD.
    WarpSize,
    /// VMM (`cuMemCreate` & co.) usable; 0 where the table has no VMM.
    VirtualMemoryManagement,
    /// VMM allocations exportable as POSIX file descriptors.
    PosixFdHandles,
}

/// What a runtime can be trusted with, beyond the table's common ground. `CudaDevice` masks
/// its kernel and launch choices by these, and `auto` never picks what a flag rules out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caps {
    /// "cuda" or "hip": the backend name in messages and `DeviceInfo`.
    pub backend: &'static str,
    /// Programmatic dependent launch (CUDA 12 `cuLaunchKernelEx` with
    /// PROGRAMMATIC_STREAM_SERIALIZATION; the device must also be sm_90+).
    pub pdl: bool,
    /// VMM allocations with POSIX-fd export (the `Fd` IPC mode).
    pub vmm: bool,
    /// 8-byte stores to a peer's memory are seen whole by a reader polling that memory: the
    /// low-latency oneshot writes a flag inside each 8-byte data line and relies on it
    /// (comm.cu). Shown on NVIDIA over NVLink and PCIe; not shown for AMD over PCIe BAR
    /// mappings (xGMI or not), so not claimed there.
    pub atomic_u64_peer_stores: bool,
    /// Warp-level `mma.sync` tensor-core instructions (NVIDIA sm_80+ only; the AMD
    /// equivalents, MFMA, have other shapes and are not used).
    pub mma_sync: bool,
    /// An async copy from pageable host memory returns only after the runtime staged the
    /// source, so the caller may reuse it at once (CUDA's documented "API synchronization
    /// behavior"). Where false (HIP makes no such promise), small host → device writes are
    /// synchronised before returning.
    pub pageable_copy_staged: bool,
}

/// `DriverError::code` of an operation the table does not have (VMM on HIP).
pub const UNSUPPORTED: i32 = -1;

/// A failed driver call: the runtime's status code, the call, and the runtime's own words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverError {
    /// The runtime's status (`CUresult`, `hipError_t`), or [`UNSUPPORTED`].
    pub code: i32,
    /// The runtime call that failed, e.g. "cuMemAlloc", "hipIpcOpenMemHandle".
    pub call: &'static str,
    /// The runtime's name and description of `code`.
    pub message: String,
}

impl DriverError {
    /// The table has no such operation on this runtime.
    pub fn unsupported(call: &'static str) -> DriverError {
        DriverError {
            code: UNSUPPORTED,
            call,
            message: "not supported by this runtime".into(),
        }
    }

    pub fn is_unsupported(&self) -> bool {
        self.code == UNSUPPORTED
    }
}

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {} (code {})", self.call, self.message, self.code)
    }
}

impl std::error::Error for DriverError {}

impl From<DriverError> for KernelError {
    fn from(e: DriverError) -> KernelError {
        KernelError::Backend(e.to_string())
    }
}

pub type DResult<T> = Result<T, DriverError>;

/// The operations the GPU backend makes on a runtime. One virtual call per operation; nothing
/// here allocates on the launch path.
///
/// Device queries take an ordinal (after `CUDA_VISIBLE_DEVICES` / `HIP_VISIBLE_DEVICES`).
/// Everything else acts in the calling thread's current context ([`Driver::set_current`]),
/// which the owning types in `crate::cuda` bind before each call, as cudarc's do.
///
/// # Safety
/// Implementors promise that each method makes the runtime call its docs name with the
/// arguments as given, returns the runtime's handles unchanged, and reports failures as
/// errors, never as made-up handles; the owning types rely on this to free what they got,
/// once. The unsafe methods' callers promise what the wrapped runtime call requires (live
/// handles of this driver, a current context, memory ranges that stay valid until the stream
/// passes the operation).
pub unsafe trait Driver: Send + Sync {
    /// What this runtime can be trusted with.
    fn caps(&self) -> Caps;

    // ---- devices

    fn device_count(&self) -> DResult<usize>;
    fn device_name(&self, ordinal: usize) -> DResult<String>;
    /// The architecture kernels are compiled for: "sm_90" (CUDA), "gfx90a" (HIP, without
    /// feature suffixes such as ":sramecc+:xnack-").
    fn device_arch(&self, ordinal: usize) -> DResult<String>;
    fn attribute(&self, ordinal: usize, attr: Attr) -> DResult<i32>;
    fn total_mem(&self, ordinal: usize) -> DResult<u64>;
    /// "0000:3b:00.0".
    fn pci_bus_id(&self, ordinal: usize) -> DResult<String>;
    fn uuid(&self, ordinal: usize) -> DResult<[u8; 16]>;
    /// Whether device `ordinal` can map device `peer`'s memory directly.
    fn can_access_peer(&self, ordinal: usize, peer: usize) -> DResult<bool>;
    /// (free, total) bytes of the current context's device.
    fn mem_get_info(&self) -> DResult<(u64, u64)>;

    // ---- contexts

    /// The device's primary context, retained (released by [`Driver::primary_ctx_release`]).
    fn primary_ctx_retain(&self, ordinal: usize) -> DResult<Ctx>;
    /// # Safety
    /// Once per successful retain, after everything made in the context is gone.
    unsafe fn primary_ctx_release(&self, ordinal: usize) -> DResult<()>;
    /// Makes `ctx` current on the calling thread (a no-op when it already is).
    ///
    /// # Safety
    /// `ctx` came from [`Driver::primary_ctx_retain`] and is still retained.
    unsafe fn set_current(&self, ctx: Ctx) -> DResult<()>;

    // ---- memory

    /// # Safety
    /// A context is current.
    unsafe fn mem_alloc(&self, bytes: usize) -> DResult<DevPtr>;
    /// # Safety
    /// `p` came from [`Driver::mem_alloc`], no queued work uses it, freed once.
    unsafe fn mem_free(&self, p: DevPtr) -> DResult<()>;
    /// # Safety
    /// `p..p+bytes` is device memory alive until the stream passes this point.
    unsafe fn memset_d8_async(&self, p: DevPtr, value: u8, bytes: usize, s: Stream) -> DResult<()>;
    /// # Safety
    /// `src..src+bytes` is readable host memory, `dst..dst+bytes` device memory; both stay
    /// valid until the copy is done (pageable sources: see [`Caps::pageable_copy_staged`]).
    unsafe fn memcpy_htod_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        s: Stream,
    ) -> DResult<()>;
    /// # Safety
    /// As [`Driver::memcpy_htod_async`], with `dst` writable host memory.
    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> DResult<()>;
    /// # Safety
    /// Both ranges are device memory alive until the stream passes the copy.
    unsafe fn memcpy_dtod_async(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> DResult<()>;
    /// Page-locked, portable host memory mapped into the device's address space: (host
    /// address, device address).
    ///
    /// # Safety
    /// A context is current.
    unsafe fn host_alloc_mapped(&self, bytes: usize) -> DResult<(*mut u8, DevPtr)>;
    /// # Safety
    /// `h` came from [`Driver::host_alloc_mapped`], no queued work uses it, freed once.
    unsafe fn host_free(&self, h: *mut u8) -> DResult<()>;

    // ---- legacy IPC

    /// # Safety
    /// `p` is the base of a live [`Driver::mem_alloc`] allocation.
    unsafe fn ipc_get(&self, p: DevPtr) -> DResult<IpcHandle>;
    /// Opens a peer process's handle, with lazy peer access.
    ///
    /// # Safety
    /// A context is current.
    unsafe fn ipc_open(&self, h: &IpcHandle) -> DResult<DevPtr>;
    /// # Safety
    /// `p` came from [`Driver::ipc_open`], no queued work uses it, closed once.
    unsafe fn ipc_close(&self, p: DevPtr) -> DResult<()>;

    // ---- VMM (optional: [`Caps::vmm`]; the defaults say Unsupported)

    /// The recommended granularity of device-pinned, POSIX-fd-exportable allocations.
    fn vmm_granularity(&self, _ordinal: usize) -> DResult<usize> {
        Err(DriverError::unsupported("vmm granularity"))
    }
    /// A physical allocation of `size` bytes (a multiple of the granularity) on `ordinal`.
    ///
    /// # Safety
    /// A context is current.
    unsafe fn vmm_create(&self, _ordinal: usize, _size: usize) -> DResult<VmmHandle> {
        Err(DriverError::unsupported("vmm create"))
    }
    /// The allocation's POSIX fd, owned by the caller.
    ///
    /// # Safety
    /// `h` is live and was created exportable.
    unsafe fn vmm_export_fd(&self, _h: VmmHandle) -> DResult<i32> {
        Err(DriverError::unsupported("vmm export"))
    }
    /// Imports a peer's allocation from its fd (not consumed).
    ///
    /// # Safety
    /// `fd` is open; a context is current.
    unsafe fn vmm_import_fd(&self, _fd: i32) -> DResult<VmmHandle> {
        Err(DriverError::unsupported("vmm import"))
    }
    /// # Safety
    /// A context is current.
    unsafe fn vmm_reserve(&self, _size: usize) -> DResult<DevPtr> {
        Err(DriverError::unsupported("vmm reserve"))
    }
    /// Maps all of `h` at `p`.
    ///
    /// # Safety
    /// `p..p+size` is reserved and unmapped; `h` is a live allocation of `size` bytes.
    unsafe fn vmm_map(&self, _p: DevPtr, _size: usize, _h: VmmHandle) -> DResult<()> {
        Err(DriverError::unsupported("vmm map"))
    }
    /// Read-write access for device `ordinal`.
    ///
    /// # Safety
    /// `p..p+size` is mapped.
    unsafe fn vmm_set_access(&self, _p: DevPtr, _size: usize, _ordinal: usize) -> DResult<()> {
        Err(DriverError::unsupported("vmm set access"))
    }
    /// # Safety
    /// Mapped by [`Driver::vmm_map`]; no queued work uses it.
    unsafe fn vmm_unmap(&self, _p: DevPtr, _size: usize) -> DResult<()> {
        Err(DriverError::unsupported("vmm unmap"))
    }
    /// # Safety
    /// Reserved by [`Driver::vmm_reserve`], nothing mapped, freed once.
    unsafe fn vmm_address_free(&self, _p: DevPtr, _size: usize) -> DResult<()> {
        Err(DriverError::unsupported("vmm address free"))
    }
    /// # Safety
    /// Created or imported, released once.
    unsafe fn vmm_release(&self, _h: VmmHandle) -> DResult<()> {
        Err(DriverError::unsupported("vmm release"))
    }

    // ---- streams and graphs

    /// A non-blocking stream (it does not synchronise with the legacy default stream).
    ///
    /// # Safety
    /// A context is current.
    unsafe fn stream_create(&self) -> DResult<Stream>;
    /// # Safety
    /// `s` is live.
    unsafe fn stream_sync(&self, s: Stream) -> DResult<()>;
    /// # Safety
    /// `s` is live, destroyed once.
    unsafe fn stream_destroy(&self, s: Stream) -> DResult<()>;
    /// True while `s` records into a graph.
    ///
    /// # Safety
    /// `s` is live.
    unsafe fn stream_is_capturing(&self, s: Stream) -> DResult<bool>;
    /// Starts capturing `s` in relaxed mode (other threads may make runtime calls meanwhile).
    ///
    /// # Safety
    /// `s` is live and not capturing.
    unsafe fn begin_capture(&self, s: Stream) -> DResult<()>;
    /// # Safety
    /// `s` is capturing.
    unsafe fn end_capture(&self, s: Stream) -> DResult<Graph>;
    /// # Safety
    /// `g` is a complete, live graph.
    unsafe fn graph_instantiate(&self, g: Graph) -> DResult<GraphExec>;
    /// # Safety
    /// `e` and `s` are live, of one context; the graph's buffers outlive the replay.
    unsafe fn graph_launch(&self, e: GraphExec, s: Stream) -> DResult<()>;
    /// # Safety
    /// Live, no replay queued, destroyed once.
    unsafe fn graph_exec_destroy(&self, e: GraphExec) -> DResult<()>;
    /// # Safety
    /// Live, destroyed once.
    unsafe fn graph_destroy(&self, g: Graph) -> DResult<()>;

    // ---- events

    /// # Safety
    /// A context is current.
    unsafe fn event_create(&self, timing: bool) -> DResult<Event>;
    /// # Safety
    /// `e` and `s` are live, of one context.
    unsafe fn event_record(&self, e: Event, s: Stream) -> DResult<()>;
    /// # Safety
    /// `e` is live.
    unsafe fn event_sync(&self, e: Event) -> DResult<()>;
    /// True once the work recorded in `e` completed.
    ///
    /// # Safety
    /// `e` is live.
    unsafe fn event_query(&self, e: Event) -> DResult<bool>;
    /// Milliseconds between two completed timing events.
    ///
    /// # Safety
    /// Both live, created with timing, recorded and complete.
    unsafe fn event_elapsed_ms(&self, start: Event, end: Event) -> DResult<f32>;
    /// # Safety
    /// Live, destroyed once.
    unsafe fn event_destroy(&self, e: Event) -> DResult<()>;

    // ---- modules and launches

    /// Machine code of kernel module `name` (source `src`, includes not yet expanded) for
    /// `arch` (from [`Driver::device_arch`]): from the kernel cache, or compiled (NVRTC,
    /// hiprtc) and stored there. `fresh`: skip the cache (its file would not load).
    fn module_image(
        &self,
        name: &str,
        src: &str,
        arch: &str,
        fresh: bool,
    ) -> Result<Vec<u8>, KernelError>;
    /// Loads a code object (cubin, hsaco); the runtime keeps its own copy of `image`.
    ///
    /// # Safety
    /// A context is current; `image` is a code object for this device.
    unsafe fn module_load(&self, image: &[u8]) -> DResult<Module>;
    /// # Safety
    /// `m` is live.
    unsafe fn module_function(&self, m: Module, name: &str) -> DResult<Function>;
    /// # Safety
    /// Live, none of its kernels queued, unloaded once.
    unsafe fn module_unload(&self, m: Module) -> DResult<()>;
    /// Blocks of `block` threads (and `smem` bytes of dynamic shared memory) of `f` that fit
    /// on one SM / CU at once.
    ///
    /// # Safety
    /// `f` belongs to a live module.
    unsafe fn occupancy(&self, f: Function, block: u32, smem: usize) -> DResult<u32>;
    /// Queues `f` on `s`. `params` is the kernel's argument array (one pointer per argument);
    /// the runtime copies the values before returning. `pdl`: with programmatic dependent
    /// launch (only where [`Caps::pdl`]).
    ///
    /// # Safety
    /// `f` belongs to a live module of the current context; `params` matches its signature;
    /// every device address in them stays valid until the stream passes the launch.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        f: Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        s: Stream,
        params: *mut *mut c_void,
        pdl: bool,
    ) -> DResult<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_read_as_one_line_naming_the_call() {
        let e = DriverError {
            code: 2,
            call: "cuMemAlloc",
            message: "CUDA_ERROR_OUT_OF_MEMORY: out of memory".into(),
        };
        assert_eq!(
            e.to_string(),
            "cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY: out of memory (code 2)"
        );
        let k: KernelError = e.into();
        assert!(matches!(k, KernelError::Backend(s) if s.starts_with("cuMemAlloc:")));
        let u = DriverError::unsupported("vmm create");
        assert!(u.is_unsupported());
        assert!(!u.to_string().contains('\n'));
    }
}
