//! The HIP implementation of the driver table ([`Driver`]): libamdhip64's C API through fn
//! pointers resolved once at load ([`HipFns`], in [`super::HipRuntime`]), so that no call
//! looks a symbol up.
//!
//! Owns: the mapping of the table to HIP, and the real differences:
//! - no context objects: a [`Ctx`] is the device ordinal + 1, made current by `hipSetDevice`;
//! - legacy IPC only (`hipIpcGetMemHandle`): VMM fd export is not there on gfx906, so the
//!   table reports VMM `Unsupported` ([`Caps::vmm`] false) and `auto` IPC resolves to legacy;
//! - `hipIpcOpenMemHandle`'s flag: ROCm 6 requires `hipIpcMemLazyEnablePeerAccess` = 1, ROCm
//!   5's header defines the same name as 0 (and 5.2 checks for it): chosen by the runtime's
//!   major version;
//! - wavefront 64 (the kernels read it from `portable.h`, never assume 32);
//! - no programmatic dependent launch, no 8-byte peer-store visibility guarantee across PCIe
//!   BAR mappings (the low-latency oneshot's flag-in-data trick), no `mma.sync`: [`Caps`];
//! - the architecture is the gfx name (`gcnArchName`, "gfx90a:sramecc+:xnack-" → "gfx90a"),
//!   read through the ROCm 5 layout of `hipDeviceProp_t`, which ROCm 6 keeps as
//!   `hipGetDevicePropertiesR0000`.
//!
//! Device ordinals are those left by `HIP_VISIBLE_DEVICES` (the coordinator sets it per rank,
//! as it sets CUDA_VISIBLE_DEVICES).
//!
//! Must not: be made twice or unloaded ([`HipDriver::get`] keeps one per process).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

use super::{c_buf, HipRuntime};
use crate::driver::{
    Attr, Caps, Ctx, DResult, DevPtr, Driver, DriverError, Event, Function, Graph, GraphExec,
    IpcHandle, Module, Stream, IPC_HANDLE_BYTES,
};
use crate::KernelError;

/// `hipIpcMemHandle_t`: 64 opaque bytes (HIP_IPC_HANDLE_SIZE), passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct HipIpcMemHandle {
    reserved: [c_char; IPC_HANDLE_BYTES],
}
const _: () = assert!(std::mem::size_of::<HipIpcMemHandle>() == 64);

type P = *mut c_void;

crate::hip_fn_table! {
    /// Every HIP runtime function the backend calls (hip_runtime_api.h signatures, the same
    /// in ROCm 5.2 and 6; `hipError_t` and enums are C ints).
    HipFns, RUNTIME_SYMBOLS, c_int;
    init = ["hipInit"]: fn(u32);
    get_error_name = ["hipGetErrorName"]: fn(c_int) -> *const c_char;
    get_error_string = ["hipGetErrorString"]: fn(c_int) -> *const c_char;
    runtime_get_version = ["hipRuntimeGetVersion"]: fn(*mut c_int);
    get_device_count = ["hipGetDeviceCount"]: fn(*mut c_int);
    device_get = ["hipDeviceGet"]: fn(*mut c_int, c_int);
    device_get_name = ["hipDeviceGetName"]: fn(*mut c_char, c_int, c_int);
    device_total_mem = ["hipDeviceTotalMem"]: fn(*mut usize, c_int);
    device_get_attribute = ["hipDeviceGetAttribute"]: fn(*mut c_int, c_int, c_int);
    device_get_pci_bus_id = ["hipDeviceGetPCIBusId"]: fn(*mut c_char, c_int, c_int);
    device_get_uuid = ["hipDeviceGetUuid"]: fn(*mut [u8; 16], c_int);
    device_can_access_peer = ["hipDeviceCanAccessPeer"]: fn(*mut c_int, c_int, c_int);
    // ROCm 6 renamed the ROCm 5 layout's entry point; both take hipDeviceProp_tR0000.
    get_device_properties = ["hipGetDevicePropertiesR0000", "hipGetDeviceProperties"]:
        fn(P, c_int);
    set_device = ["hipSetDevice"]: fn(c_int);
    get_device = ["hipGetDevice"]: fn(*mut c_int);
    mem_get_info = ["hipMemGetInfo"]: fn(*mut usize, *mut usize);
    malloc = ["hipMalloc"]: fn(*mut P, usize);
    free = ["hipFree"]: fn(P);
    host_malloc = ["hipHostMalloc"]: fn(*mut P, usize, u32);
    host_free = ["hipHostFree"]: fn(P);
    host_get_device_pointer = ["hipHostGetDevicePointer"]: fn(*mut P, P, u32);
    memset_d8_async = ["hipMemsetD8Async"]: fn(P, u8, usize, P);
    memcpy_htod_async = ["hipMemcpyHtoDAsync"]: fn(P, P, usize, P);
    memcpy_dtoh_async = ["hipMemcpyDtoHAsync"]: fn(P, P, usize, P);
    memcpy_dtod_async = ["hipMemcpyDtoDAsync"]: fn(P, P, usize, P);
    stream_create_with_flags = ["hipStreamCreateWithFlags"]: fn(*mut P, u32);
    stream_synchronize = ["hipStreamSynchronize"]: fn(P);
    stream_destroy = ["hipStreamDestroy"]: fn(P);
    stream_is_capturing = ["hipStreamIsCapturing"]: fn(P, *mut c_int);
    stream_begin_capture = ["hipStreamBeginCapture"]: fn(P, c_int);
    stream_end_capture = ["hipStreamEndCapture"]: fn(P, *mut P);
    graph_instantiate = ["hipGraphInstantiate"]: fn(*mut P, P, *mut P, *mut c_char, usize);
    graph_launch = ["hipGraphLaunch"]: fn(P, P);
    graph_exec_destroy = ["hipGraphExecDestroy"]: fn(P);
    graph_destroy = ["hipGraphDestroy"]: fn(P);
    event_create_with_flags = ["hipEventCreateWithFlags"]: fn(*mut P, u32);
    event_record = ["hipEventRecord"]: fn(P, P);
    event_synchronize = ["hipEventSynchronize"]: fn(P);
    event_query = ["hipEventQuery"]: fn(P);
    event_elapsed_time = ["hipEventElapsedTime"]: fn(*mut f32, P, P);
    event_destroy = ["hipEventDestroy"]: fn(P);
    module_load_data = ["hipModuleLoadData"]: fn(*mut P, *const c_void);
    module_get_function = ["hipModuleGetFunction"]: fn(*mut P, P, *const c_char);
    module_unload = ["hipModuleUnload"]: fn(P);
    module_occupancy = ["hipModuleOccupancyMaxActiveBlocksPerMultiprocessor"]:
        fn(*mut c_int, P, c_int, usize);
    module_launch_kernel = ["hipModuleLaunchKernel"]:
        fn(P, u32, u32, u32, u32, u32, u32, u32, P, *mut P, *mut P);
    ipc_get_mem_handle = ["hipIpcGetMemHandle"]: fn(*mut HipIpcMemHandle, P);
    ipc_open_mem_handle = ["hipIpcOpenMemHandle"]: fn(*mut P, HipIpcMemHandle, u32);
    ipc_close_mem_handle = ["hipIpcCloseMemHandle"]: fn(P);
}

/// hip_runtime_api.h values (the same in ROCm 5.2 and 6.x; checked against the installed
/// header by a test where one is installed). `hipDeviceAttribute_t` is renumbered between
/// ROCm versions in places, but not for these four.
pub(crate) mod abi {
    pub const ATTR_COMPUTE_CAPABILITY_MAJOR: i32 = 23;
    pub const ATTR_COMPUTE_CAPABILITY_MINOR: i32 = 61;
    pub const ATTR_MULTIPROCESSOR_COUNT: i32 = 63;
    pub const ATTR_WARP_SIZE: i32 = 87;
    /// `hipErrorNotReady`.
    pub const ERROR_NOT_READY: i32 = 600;
    /// `hipStreamNonBlocking`.
    pub const STREAM_NON_BLOCKING: u32 = 1;
    /// `hipEventDefault`, `hipEventDisableTiming`.
    pub const EVENT_DEFAULT: u32 = 0;
    pub const EVENT_DISABLE_TIMING: u32 = 2;
    /// `hipHostMallocPortable | hipHostMallocMapped`.
    pub const HOST_MALLOC_PORTABLE: u32 = 1;
    pub const HOST_MALLOC_MAPPED: u32 = 2;
    /// `hipStreamCaptureModeRelaxed`.
    pub const CAPTURE_MODE_RELAXED: i32 = 2;
    /// `hipStreamCaptureStatusNone`.
    pub const CAPTURE_STATUS_NONE: i32 = 0;
    /// `offsetof(hipDeviceProp_tR0000, gcnArchName)` (ROCm 5's `hipDeviceProp_t`, kept as
    /// `hipDeviceProp_tR0000` in ROCm 6's hip_deprecated.h), and that struct's size.
    pub const PROP_GCN_ARCH_NAME: usize = 396;
    pub const PROP_SIZE: usize = 792;
    /// `hipIpcMemLazyEnablePeerAccess`: 0 in ROCm 5's header, 1 from ROCm 6 on.
    pub const IPC_LAZY_ROCM5: u32 = 0;
    pub const IPC_LAZY_ROCM6: u32 = 1;
}

/// The HIP runtime as the driver table.
pub struct HipDriver {
    rt: &'static HipRuntime,
    /// `hipIpcOpenMemHandle`'s flag for this runtime's version ([`abi::IPC_LAZY_ROCM5`]).
    ipc_flags: u32,
    /// Copies of the loaded code objects, by module: ROCm 5's `hipModuleLoadData` may keep
    /// reading the image after it returns, so each lives until its module is unloaded (a lock
    /// taken at load and unload only, never on the launch path).
    images: Mutex<HashMap<u64, Vec<u64>>>,
}

static DRIVER: OnceLock<Result<Arc<HipDriver>, String>> = OnceLock::new();

impl HipDriver {
    /// The process's HIP driver table: the runtime loaded ([`HipRuntime::get`]), `hipInit`
    /// run and at least one device seen; else the one line that says why ("hip: runtime not
    /// found (libamdhip64.so)", "no HIP device (hipInit: hipErrorNoDevice)").
    pub fn get() -> Result<Arc<HipDriver>, String> {
        DRIVER
            .get_or_init(|| {
                let rt = HipRuntime::get()?;
                rt.devices()?;
                let major = rt.version().unwrap_or(0) / 10_000_000;
                Ok(Arc::new(HipDriver {
                    rt,
                    ipc_flags: if major >= 6 {
                        abi::IPC_LAZY_ROCM6
                    } else {
                        abi::IPC_LAZY_ROCM5
                    },
                    images: Mutex::new(HashMap::new()),
                }))
            })
            .clone()
    }

    fn f(&self) -> &HipFns {
        &self.rt.fns
    }

    /// `Ok` for hipSuccess, else the error naming `call`.
    #[inline]
    fn check(&self, e: c_int, call: &'static str) -> DResult<()> {
        if e == 0 {
            Ok(())
        } else {
            Err(DriverError {
                code: e,
                call,
                message: self.rt.error_string(e),
            })
        }
    }

    fn device(&self, ordinal: usize) -> DResult<c_int> {
        let mut d = 0;
        self.check(
            // SAFETY: hipDeviceGet(hipDevice_t*, int).
            unsafe { (self.f().device_get)(&mut d, ordinal as c_int) },
            "hipDeviceGet",
        )?;
        Ok(d)
    }
}

/// A raw HIP handle as a table handle, and back (64-bit targets only, as ROCm).
fn h(p: P) -> u64 {
    p as usize as u64
}

fn p(x: u64) -> P {
    x as usize as P
}

/// "gfx90a" of "gfx90a:sramecc+:xnack-" (hiprtc takes the bare name; the feature suffixes
/// are the defaults of the device it compiles for).
pub(crate) fn bare_arch(gcn_arch_name: &str) -> &str {
    gcn_arch_name.split(':').next().unwrap_or(gcn_arch_name)
}

// SAFETY: every method makes the HIP call it names with the arguments as given and returns its
// handles unchanged (the trait's contract); the unsafe ones pass their callers' promises on.
unsafe impl Driver for HipDriver {
    fn caps(&self) -> Caps {
        Caps {
            backend: "hip",
            pdl: false,
            vmm: false,
            atomic_u64_peer_stores: false,
            mma_sync: false,
            pageable_copy_staged: false,
        }
    }

    fn device_count(&self) -> DResult<usize> {
        let mut n = 0;
        self.check(
            // SAFETY: hipGetDeviceCount(int*).
            unsafe { (self.f().get_device_count)(&mut n) },
            "hipGetDeviceCount",
        )?;
        Ok(n.max(0) as usize)
    }

    fn device_name(&self, ordinal: usize) -> DResult<String> {
        let d = self.device(ordinal)?;
        let mut buf = [0u8; 256];
        self.check(
            // SAFETY: the length is the buffer's.
            unsafe { (self.f().device_get_name)(buf.as_mut_ptr().cast(), buf.len() as c_int, d) },
            "hipDeviceGetName",
        )?;
        Ok(c_buf(&buf))
    }

    fn device_arch(&self, ordinal: usize) -> DResult<String> {
        // Bigger and more aligned than any hipDeviceProp_t (R0000: 792 bytes, R0600: ~1.5 KB)
        // so that whichever layout the runtime writes fits.
        #[repr(C, align(16))]
        struct Props([u8; 4096]);
        const _: () =
            assert!(abi::PROP_GCN_ARCH_NAME + 256 <= abi::PROP_SIZE && abi::PROP_SIZE <= 4096);
        let mut props = Props([0; 4096]);
        self.check(
            // SAFETY: hipGetDevicePropertiesR0000(hipDeviceProp_tR0000*, int) (or ROCm 5's
            // hipGetDeviceProperties, the same layout) into a zeroed buffer larger than it.
            unsafe {
                (self.f().get_device_properties)(props.0.as_mut_ptr().cast(), ordinal as c_int)
            },
            "hipGetDeviceProperties",
        )?;
        let full = c_buf(&props.0[abi::PROP_GCN_ARCH_NAME..abi::PROP_GCN_ARCH_NAME + 256]);
        Ok(bare_arch(&full).to_string())
    }

    fn attribute(&self, ordinal: usize, a: Attr) -> DResult<i32> {
        let id = match a {
            Attr::MultiprocessorCount => abi::ATTR_MULTIPROCESSOR_COUNT,
            Attr::ComputeCapabilityMajor => abi::ATTR_COMPUTE_CAPABILITY_MAJOR,
            Attr::ComputeCapabilityMinor => abi::ATTR_COMPUTE_CAPABILITY_MINOR,
            Attr::WarpSize => abi::ATTR_WARP_SIZE,
            // No VMM in this table (Caps::vmm).
            Attr::VirtualMemoryManagement | Attr::PosixFdHandles => return Ok(0),
        };
        let mut v = 0;
        self.check(
            // SAFETY: hipDeviceGetAttribute(int*, hipDeviceAttribute_t, int).
            unsafe { (self.f().device_get_attribute)(&mut v, id, ordinal as c_int) },
            "hipDeviceGetAttribute",
        )?;
        Ok(v)
    }

    fn total_mem(&self, ordinal: usize) -> DResult<u64> {
        let d = self.device(ordinal)?;
        let mut n = 0usize;
        self.check(
            // SAFETY: hipDeviceTotalMem(size_t*, hipDevice_t).
            unsafe { (self.f().device_total_mem)(&mut n, d) },
            "hipDeviceTotalMem",
        )?;
        Ok(n as u64)
    }

    fn pci_bus_id(&self, ordinal: usize) -> DResult<String> {
        let mut buf = [0u8; 32];
        self.check(
            // SAFETY: the length is the buffer's.
            unsafe {
                (self.f().device_get_pci_bus_id)(
                    buf.as_mut_ptr().cast(),
                    buf.len() as c_int,
                    ordinal as c_int,
                )
            },
            "hipDeviceGetPCIBusId",
        )?;
        Ok(c_buf(&buf))
    }

    fn uuid(&self, ordinal: usize) -> DResult<[u8; 16]> {
        let d = self.device(ordinal)?;
        let mut u = [0u8; 16];
        self.check(
            // SAFETY: hipDeviceGetUuid(hipUUID*, hipDevice_t); hipUUID is 16 chars.
            unsafe { (self.f().device_get_uuid)(&mut u, d) },
            "hipDeviceGetUuid",
        )?;
        Ok(u)
    }

    fn can_access_peer(&self, ordinal: usize, peer: usize) -> DResult<bool> {
        let mut v = 0;
        self.check(
            // SAFETY: hipDeviceCanAccessPeer(int*, int, int).
            unsafe { (self.f().device_can_access_peer)(&mut v, ordinal as c_int, peer as c_int) },
            "hipDeviceCanAccessPeer",
        )?;
        Ok(v != 0)
    }

    fn mem_get_info(&self) -> DResult<(u64, u64)> {
        let (mut free, mut total) = (0usize, 0usize);
        self.check(
            // SAFETY: hipMemGetInfo(size_t*, size_t*) of the current device.
            unsafe { (self.f().mem_get_info)(&mut free, &mut total) },
            "hipMemGetInfo",
        )?;
        Ok((free as u64, total as u64))
    }

    fn primary_ctx_retain(&self, ordinal: usize) -> DResult<Ctx> {
        let n = self.device_count()?;
        if ordinal >= n {
            return Err(DriverError {
                code: 101, // hipErrorInvalidDevice
                call: "hipSetDevice",
                message: format!("no device {ordinal} ({n} visible)"),
            });
        }
        Ok(Ctx(ordinal as u64 + 1))
    }

    unsafe fn primary_ctx_release(&self, _ordinal: usize) -> DResult<()> {
        // The runtime owns the device's one context; nothing was retained.
        Ok(())
    }

    unsafe fn set_current(&self, ctx: Ctx) -> DResult<()> {
        let want = ctx.0.wrapping_sub(1) as c_int;
        let mut cur = -1;
        // SAFETY: hipGetDevice(int*): thread-local, cheap; saves the set nearly always.
        self.check(unsafe { (self.f().get_device)(&mut cur) }, "hipGetDevice")?;
        if cur != want {
            // SAFETY: hipSetDevice(int) of a device checked at retain.
            self.check(unsafe { (self.f().set_device)(want) }, "hipSetDevice")?;
        }
        Ok(())
    }

    unsafe fn mem_alloc(&self, bytes: usize) -> DResult<DevPtr> {
        let mut d: P = std::ptr::null_mut();
        // SAFETY: hipMalloc(void**, size_t).
        self.check(unsafe { (self.f().malloc)(&mut d, bytes) }, "hipMalloc")?;
        Ok(DevPtr(h(d)))
    }

    unsafe fn mem_free(&self, ptr: DevPtr) -> DResult<()> {
        // SAFETY: per the contract.
        self.check(unsafe { (self.f().free)(p(ptr.0)) }, "hipFree")
    }

    unsafe fn memset_d8_async(
        &self,
        ptr: DevPtr,
        value: u8,
        bytes: usize,
        s: Stream,
    ) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().memset_d8_async)(p(ptr.0), value, bytes, p(s.0)) },
            "hipMemsetD8Async",
        )
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        s: Stream,
    ) -> DResult<()> {
        self.check(
            // SAFETY: per the contract (HIP takes the source as a non-const pointer; it only
            // reads it).
            unsafe { (self.f().memcpy_htod_async)(p(dst.0), src as P, bytes, p(s.0)) },
            "hipMemcpyHtoDAsync",
        )
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().memcpy_dtoh_async)(dst.cast(), p(src.0), bytes, p(s.0)) },
            "hipMemcpyDtoHAsync",
        )
    }

    unsafe fn memcpy_dtod_async(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().memcpy_dtod_async)(p(dst.0), p(src.0), bytes, p(s.0)) },
            "hipMemcpyDtoDAsync",
        )
    }

    unsafe fn host_alloc_mapped(&self, bytes: usize) -> DResult<(*mut u8, DevPtr)> {
        let mut host: P = std::ptr::null_mut();
        let flags = abi::HOST_MALLOC_MAPPED | abi::HOST_MALLOC_PORTABLE;
        self.check(
            // SAFETY: hipHostMalloc(void**, size_t, unsigned).
            unsafe { (self.f().host_malloc)(&mut host, bytes, flags) },
            "hipHostMalloc (mapped)",
        )?;
        let mut dev: P = std::ptr::null_mut();
        // SAFETY: a live mapped allocation; flags must be 0.
        let e = unsafe { (self.f().host_get_device_pointer)(&mut dev, host, 0) };
        if let Err(err) = self.check(e, "hipHostGetDevicePointer") {
            // SAFETY: allocated just above, freed once.
            let _ = unsafe { (self.f().host_free)(host) };
            return Err(err);
        }
        Ok((host.cast(), DevPtr(h(dev))))
    }

    unsafe fn host_free(&self, host: *mut u8) -> DResult<()> {
        // SAFETY: per the contract.
        self.check(unsafe { (self.f().host_free)(host.cast()) }, "hipHostFree")
    }

    unsafe fn ipc_get(&self, ptr: DevPtr) -> DResult<IpcHandle> {
        let mut hd = HipIpcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        self.check(
            // SAFETY: per the contract; HIP fills the whole handle.
            unsafe { (self.f().ipc_get_mem_handle)(&mut hd, p(ptr.0)) },
            "hipIpcGetMemHandle",
        )?;
        Ok(IpcHandle(hd.reserved.map(|c| c as u8)))
    }

    unsafe fn ipc_open(&self, handle: &IpcHandle) -> DResult<DevPtr> {
        let hd = HipIpcMemHandle {
            reserved: handle.0.map(|b| b as c_char),
        };
        let mut d: P = std::ptr::null_mut();
        self.check(
            // SAFETY: per the contract; the handle is passed by value.
            unsafe { (self.f().ipc_open_mem_handle)(&mut d, hd, self.ipc_flags) },
            "hipIpcOpenMemHandle",
        )?;
        Ok(DevPtr(h(d)))
    }

    unsafe fn ipc_close(&self, ptr: DevPtr) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().ipc_close_mem_handle)(p(ptr.0)) },
            "hipIpcCloseMemHandle",
        )
    }

    unsafe fn stream_create(&self) -> DResult<Stream> {
        let mut s: P = std::ptr::null_mut();
        self.check(
            // SAFETY: hipStreamCreateWithFlags(hipStream_t*, unsigned).
            unsafe { (self.f().stream_create_with_flags)(&mut s, abi::STREAM_NON_BLOCKING) },
            "hipStreamCreateWithFlags",
        )?;
        Ok(Stream(h(s)))
    }

    unsafe fn stream_sync(&self, s: Stream) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().stream_synchronize)(p(s.0)) },
            "hipStreamSynchronize",
        )
    }

    unsafe fn stream_destroy(&self, s: Stream) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().stream_destroy)(p(s.0)) },
            "hipStreamDestroy",
        )
    }

    unsafe fn stream_is_capturing(&self, s: Stream) -> DResult<bool> {
        let mut st = abi::CAPTURE_STATUS_NONE;
        self.check(
            // SAFETY: per the contract; HIP writes the status (a C enum).
            unsafe { (self.f().stream_is_capturing)(p(s.0), &mut st) },
            "hipStreamIsCapturing",
        )?;
        Ok(st != abi::CAPTURE_STATUS_NONE)
    }

    unsafe fn begin_capture(&self, s: Stream) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().stream_begin_capture)(p(s.0), abi::CAPTURE_MODE_RELAXED) },
            "hipStreamBeginCapture",
        )
    }

    unsafe fn end_capture(&self, s: Stream) -> DResult<Graph> {
        let mut g: P = std::ptr::null_mut();
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().stream_end_capture)(p(s.0), &mut g) },
            "hipStreamEndCapture",
        )?;
        Ok(Graph(h(g)))
    }

    unsafe fn graph_instantiate(&self, g: Graph) -> DResult<GraphExec> {
        let mut e: P = std::ptr::null_mut();
        self.check(
            // SAFETY: per the contract; no error node or log buffer asked for.
            unsafe {
                (self.f().graph_instantiate)(
                    &mut e,
                    p(g.0),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                )
            },
            "hipGraphInstantiate",
        )?;
        Ok(GraphExec(h(e)))
    }

    unsafe fn graph_launch(&self, e: GraphExec, s: Stream) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().graph_launch)(p(e.0), p(s.0)) },
            "hipGraphLaunch",
        )
    }

    unsafe fn graph_exec_destroy(&self, e: GraphExec) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().graph_exec_destroy)(p(e.0)) },
            "hipGraphExecDestroy",
        )
    }

    unsafe fn graph_destroy(&self, g: Graph) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().graph_destroy)(p(g.0)) },
            "hipGraphDestroy",
        )
    }

    unsafe fn event_create(&self, timing: bool) -> DResult<Event> {
        let flags = if timing {
            abi::EVENT_DEFAULT
        } else {
            abi::EVENT_DISABLE_TIMING
        };
        let mut e: P = std::ptr::null_mut();
        self.check(
            // SAFETY: hipEventCreateWithFlags(hipEvent_t*, unsigned).
            unsafe { (self.f().event_create_with_flags)(&mut e, flags) },
            "hipEventCreateWithFlags",
        )?;
        Ok(Event(h(e)))
    }

    unsafe fn event_record(&self, e: Event, s: Stream) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().event_record)(p(e.0), p(s.0)) },
            "hipEventRecord",
        )
    }

    unsafe fn event_sync(&self, e: Event) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().event_synchronize)(p(e.0)) },
            "hipEventSynchronize",
        )
    }

    unsafe fn event_query(&self, e: Event) -> DResult<bool> {
        // SAFETY: per the contract.
        match unsafe { (self.f().event_query)(p(e.0)) } {
            0 => Ok(true),
            abi::ERROR_NOT_READY => Ok(false),
            code => self.check(code, "hipEventQuery").map(|()| false),
        }
    }

    unsafe fn event_elapsed_ms(&self, start: Event, end: Event) -> DResult<f32> {
        let mut ms = 0f32;
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().event_elapsed_time)(&mut ms, p(start.0), p(end.0)) },
            "hipEventElapsedTime",
        )?;
        Ok(ms)
    }

    unsafe fn event_destroy(&self, e: Event) -> DResult<()> {
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().event_destroy)(p(e.0)) },
            "hipEventDestroy",
        )
    }

    fn module_image(
        &self,
        name: &str,
        src: &str,
        arch: &str,
        fresh: bool,
    ) -> Result<Vec<u8>, KernelError> {
        let built = if fresh {
            self.rt
                .compile(name, &crate::cuda::program::expand(src), arch)
        } else {
            self.rt.code_object(name, src, arch)
        };
        built.map_err(KernelError::Backend)
    }

    unsafe fn module_load(&self, image: &[u8]) -> DResult<Module> {
        // An 8-byte aligned copy, kept until unload (see `images`).
        let mut copy = vec![0u64; image.len().div_ceil(8)];
        // SAFETY: `copy` has at least image.len() bytes; the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(image.as_ptr(), copy.as_mut_ptr().cast(), image.len())
        };
        let mut m: P = std::ptr::null_mut();
        self.check(
            // SAFETY: per the contract; the copy outlives the module.
            unsafe { (self.f().module_load_data)(&mut m, copy.as_ptr().cast()) },
            "hipModuleLoadData",
        )?;
        if let Ok(mut images) = self.images.lock() {
            images.insert(h(m), copy);
        } else {
            // A poisoned lock: keep the image for the process's life rather than free it
            // under the runtime.
            std::mem::forget(copy);
        }
        Ok(Module(h(m)))
    }

    unsafe fn module_function(&self, m: Module, name: &str) -> DResult<Function> {
        let cname = CString::new(name).map_err(|_| DriverError {
            code: 1, // hipErrorInvalidValue
            call: "hipModuleGetFunction",
            message: "a NUL in the kernel name".into(),
        })?;
        let mut f: P = std::ptr::null_mut();
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().module_get_function)(&mut f, p(m.0), cname.as_ptr()) },
            "hipModuleGetFunction",
        )?;
        Ok(Function(h(f)))
    }

    unsafe fn module_unload(&self, m: Module) -> DResult<()> {
        let r = self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().module_unload)(p(m.0)) },
            "hipModuleUnload",
        );
        if let Ok(mut images) = self.images.lock() {
            images.remove(&m.0);
        }
        r
    }

    unsafe fn occupancy(&self, f: Function, block: u32, smem: usize) -> DResult<u32> {
        let mut n = 0;
        self.check(
            // SAFETY: per the contract.
            unsafe { (self.f().module_occupancy)(&mut n, p(f.0), block as c_int, smem) },
            "hipModuleOccupancyMaxActiveBlocksPerMultiprocessor",
        )?;
        Ok(n.max(0) as u32)
    }

    unsafe fn launch(
        &self,
        f: Function,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        s: Stream,
        params: *mut *mut c_void,
        pdl: bool,
    ) -> DResult<()> {
        if pdl {
            return Err(DriverError::unsupported(
                "hipModuleLaunchKernel (programmatic dependent launch)",
            ));
        }
        self.check(
            // SAFETY: per the contract; HIP copies the parameter values before it returns.
            unsafe {
                (self.f().module_launch_kernel)(
                    p(f.0),
                    grid.0,
                    grid.1,
                    grid.2,
                    block.0,
                    block.1,
                    block.2,
                    smem,
                    p(s.0),
                    params,
                    std::ptr::null_mut(),
                )
            },
            "hipModuleLaunchKernel",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names_lose_their_feature_suffixes() {
        assert_eq!(bare_arch("gfx90a:sramecc+:xnack-"), "gfx90a");
        assert_eq!(bare_arch("gfx906"), "gfx906");
        assert_eq!(bare_arch(""), "");
    }

    /// Every entry of the table resolves against the installed runtime (where there is one),
    /// and the runtime's own symbol list is the table's.
    #[test]
    fn the_table_resolves_against_the_installed_runtime() {
        let lib = ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"]
            .into_iter()
            // SAFETY: dlopen runs the runtime's initialisers only; nothing else is called.
            .find_map(|n| unsafe { libloading::Library::new(n) }.ok());
        let Some(lib) = lib else {
            println!("skipped: no libamdhip64 installed");
            return;
        };
        if let Err(missing) = HipFns::resolve(&lib) {
            panic!("the installed runtime lacks {missing:?}");
        }
        // Leaked: a HIP runtime is never unloaded (module docs).
        std::mem::forget(lib);
    }

    /// The ABI values above against the installed hip_runtime_api.h (a C compiler prints
    /// them); skipped where the header or a compiler is missing.
    #[test]
    fn abi_values_match_the_installed_header() {
        let header = std::path::Path::new("/usr/include/hip/hip_runtime_api.h");
        if !header.exists() {
            println!("skipped: no {}", header.display());
            return;
        }
        let dir = std::env::temp_dir().join(format!("tprun-hip-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("abi.c");
        std::fs::write(
            &src,
            r#"
#include <hip/hip_runtime_api.h>
#include <stdio.h>
#include <stddef.h>
int main(void) {
    printf("%d %d %d %d %d %d %d %d %d %d %d %d %zu %zu %zu %d\n",
        (int)hipDeviceAttributeComputeCapabilityMajor,
        (int)hipDeviceAttributeComputeCapabilityMinor,
        (int)hipDeviceAttributeMultiprocessorCount,
        (int)hipDeviceAttributeWarpSize,
        (int)hipErrorNotReady,
        (int)hipStreamNonBlocking,
        (int)hipEventDefault,
        (int)hipEventDisableTiming,
        (int)hipHostMallocPortable,
        (int)hipHostMallocMapped,
        (int)hipStreamCaptureModeRelaxed,
        (int)hipStreamCaptureStatusNone,
        offsetof(hipDeviceProp_t, gcnArchName),
        sizeof(hipDeviceProp_t),
        sizeof(hipIpcMemHandle_t),
        (int)hipIpcMemLazyEnablePeerAccess);
    return 0;
}
"#,
        )
        .unwrap();
        let exe = dir.join("abi");
        let built = ["cc", "clang", "clang-15", "gcc"].iter().find_map(|cc| {
            std::process::Command::new(cc)
                .args(["-D__HIP_PLATFORM_AMD__", "-I/usr/include", "-o"])
                .arg(&exe)
                .arg(&src)
                .output()
                .ok()
                .filter(|o| o.status.success())
        });
        if built.is_none() {
            let _ = std::fs::remove_dir_all(&dir);
            println!("skipped: no C compiler builds against the HIP header");
            return;
        }
        let out = std::process::Command::new(&exe).output().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let v: Vec<u64> = String::from_utf8(out.stdout)
            .unwrap()
            .split_whitespace()
            .map(|x| x.parse().unwrap())
            .collect();
        let header_major = if v[15] == 0 { 5 } else { 6 };
        println!("HIP header: ROCm {header_major}-style");
        // ROCm 6's hipDeviceProp_t is the R0600 layout: the R0000 offsets hold for ROCm 5.
        let (off, size) = if header_major == 5 {
            (abi::PROP_GCN_ARCH_NAME as u64, abi::PROP_SIZE as u64)
        } else {
            (v[12], v[13])
        };
        let want = [
            abi::ATTR_COMPUTE_CAPABILITY_MAJOR as u64,
            abi::ATTR_COMPUTE_CAPABILITY_MINOR as u64,
            abi::ATTR_MULTIPROCESSOR_COUNT as u64,
            abi::ATTR_WARP_SIZE as u64,
            abi::ERROR_NOT_READY as u64,
            abi::STREAM_NON_BLOCKING as u64,
            abi::EVENT_DEFAULT as u64,
            abi::EVENT_DISABLE_TIMING as u64,
            abi::HOST_MALLOC_PORTABLE as u64,
            abi::HOST_MALLOC_MAPPED as u64,
            abi::CAPTURE_MODE_RELAXED as u64,
            abi::CAPTURE_STATUS_NONE as u64,
            off,
            size,
            IPC_HANDLE_BYTES as u64,
            if header_major == 5 {
                abi::IPC_LAZY_ROCM5
            } else {
                abi::IPC_LAZY_ROCM6
            } as u64,
        ];
        assert_eq!(v, want);
    }
}
