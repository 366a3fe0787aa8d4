//! The CUDA implementation of the driver table ([`Driver`]): cudarc's `result` layer and ours
//! ([`super::result`]: VMM, legacy IPC, mapped host memory), one call per operation.
//!
//! Owns: the mapping of the table's handles, attributes and flags to CUDA's.
//! Must not: keep state (every handle belongs to the owning types in `super::ctx` and
//! `super::mem`), or exist before the driver was found and initialised: [`CudaDriver::new`] is
//! the only way to make one, after [`super::probe::init`] (cudarc's loader panics on a
//! missing library).

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::result as dr;
use cudarc::driver::sys;

use super::{probe, program, result};
use crate::driver::{
    Attr, Caps, Ctx, DResult, DevPtr, Driver, DriverError, Event, Function, Graph, GraphExec,
    IpcHandle, Module, Stream, VmmHandle, IPC_HANDLE_BYTES,
};
use crate::{KernelError, Result};

/// The CUDA driver API (libcuda), loaded and initialised.
pub struct CudaDriver {
    /// Private: only [`CudaDriver::new`] makes one, after the presence check and `cuInit`.
    _checked: (),
}

impl CudaDriver {
    /// Loads and initialises libcuda, or says why the backend is unusable (`Unavailable`).
    pub fn new() -> Result<Arc<CudaDriver>> {
        probe::init()?;
        Ok(Arc::new(CudaDriver { _checked: () }))
    }
}

/// A cudarc error as the table's: the call, CUDA's error name and description.
fn err(call: &'static str) -> impl Fn(dr::DriverError) -> DriverError {
    move |e| {
        let name = e
            .error_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let what = e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        DriverError {
            code: e.0 as i32,
            call,
            message: format!("{name}: {what}"),
        }
    }
}

fn dev(ordinal: usize) -> DResult<sys::CUdevice> {
    dr::device::get(ordinal as i32).map_err(err("cuDeviceGet"))
}

fn attribute(ordinal: usize, a: sys::CUdevice_attribute) -> DResult<i32> {
    let d = dev(ordinal)?;
    // SAFETY: `d` is a valid handle of an initialised driver.
    unsafe { dr::device::get_attribute(d, a) }.map_err(err("cuDeviceGetAttribute"))
}

// Handles are pointers widened to u64 and back (64-bit targets only; CUDA has no other).
const _: () = assert!(std::mem::size_of::<usize>() == 8);

fn stream(s: Stream) -> sys::CUstream {
    s.0 as usize as sys::CUstream
}

fn event(e: Event) -> sys::CUevent {
    e.0 as usize as sys::CUevent
}

// SAFETY: every method makes the CUDA call it names with the arguments as given and returns
// its handles unchanged (the trait's contract); the unsafe ones pass their callers' promises
// on.
unsafe impl Driver for CudaDriver {
    fn caps(&self) -> Caps {
        Caps {
            backend: "cuda",
            pdl: true,
            vmm: true,
            atomic_u64_peer_stores: true,
            mma_sync: true,
            pageable_copy_staged: true,
        }
    }

    fn device_count(&self) -> DResult<usize> {
        Ok(dr::device::get_count()
            .map_err(err("cuDeviceGetCount"))?
            .max(0) as usize)
    }

    fn device_name(&self, ordinal: usize) -> DResult<String> {
        dr::device::get_name(dev(ordinal)?).map_err(err("cuDeviceGetName"))
    }

    fn device_arch(&self, ordinal: usize) -> DResult<String> {
        let major = self.attribute(ordinal, Attr::ComputeCapabilityMajor)?;
        let minor = self.attribute(ordinal, Attr::ComputeCapabilityMinor)?;
        Ok(format!("sm_{major}{minor}"))
    }

    fn attribute(&self, ordinal: usize, a: Attr) -> DResult<i32> {
        use sys::CUdevice_attribute as A;
        attribute(
            ordinal,
            match a {
                Attr::MultiprocessorCount => A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                Attr::ComputeCapabilityMajor => A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                Attr::ComputeCapabilityMinor => A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                Attr::WarpSize => A::CU_DEVICE_ATTRIBUTE_WARP_SIZE,
                Attr::VirtualMemoryManagement => {
                    A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
                }
                Attr::PosixFdHandles => {
                    A::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
                }
            },
        )
    }

    fn total_mem(&self, ordinal: usize) -> DResult<u64> {
        let d = dev(ordinal)?;
        // SAFETY: a valid handle of an initialised driver.
        Ok(unsafe { dr::device::total_mem(d) }.map_err(err("cuDeviceTotalMem"))? as u64)
    }

    fn pci_bus_id(&self, ordinal: usize) -> DResult<String> {
        let d = dev(ordinal)?;
        // SAFETY: as above.
        unsafe { result::device::pci_bus_id(d) }.map_err(err("cuDeviceGetPCIBusId"))
    }

    fn uuid(&self, ordinal: usize) -> DResult<[u8; 16]> {
        let u = dr::device::get_uuid(dev(ordinal)?).map_err(err("cuDeviceGetUuid"))?;
        Ok(u.bytes.map(|b| b as u8))
    }

    fn can_access_peer(&self, ordinal: usize, peer: usize) -> DResult<bool> {
        let (a, b) = (dev(ordinal)?, dev(peer)?);
        // SAFETY: valid handles of an initialised driver.
        unsafe { result::device::can_access_peer(a, b) }.map_err(err("cuDeviceCanAccessPeer"))
    }

    fn mem_get_info(&self) -> DResult<(u64, u64)> {
        dr::mem_get_info()
            .map(|(f, t)| (f as u64, t as u64))
            .map_err(err("cuMemGetInfo"))
    }

    fn primary_ctx_retain(&self, ordinal: usize) -> DResult<Ctx> {
        let d = dev(ordinal)?;
        // SAFETY: a valid device of an initialised driver.
        let c = unsafe { dr::primary_ctx::retain(d) }.map_err(err("cuDevicePrimaryCtxRetain"))?;
        Ok(Ctx(c as usize as u64))
    }

    unsafe fn primary_ctx_release(&self, ordinal: usize) -> DResult<()> {
        let d = dev(ordinal)?;
        // SAFETY: per the contract.
        unsafe { dr::primary_ctx::release(d) }.map_err(err("cuDevicePrimaryCtxRelease"))
    }

    unsafe fn set_current(&self, ctx: Ctx) -> DResult<()> {
        let c = ctx.0 as usize as sys::CUcontext;
        // As cudarc's `bind_to_thread`: a get (cheap, thread-local in the driver) saves the
        // set when the context is current already, which it nearly always is.
        let current = dr::ctx::get_current().map_err(err("cuCtxGetCurrent"))?;
        if current != Some(c) {
            // SAFETY: a retained context (the contract).
            unsafe { dr::ctx::set_current(c) }.map_err(err("cuCtxSetCurrent"))?;
        }
        Ok(())
    }

    unsafe fn mem_alloc(&self, bytes: usize) -> DResult<DevPtr> {
        // SAFETY: per the contract.
        Ok(DevPtr(
            unsafe { result::mem::alloc(bytes) }.map_err(err("cuMemAlloc"))?,
        ))
    }

    unsafe fn mem_free(&self, p: DevPtr) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::mem::free(p.0) }.map_err(err("cuMemFree"))
    }

    unsafe fn memset_d8_async(&self, p: DevPtr, value: u8, bytes: usize, s: Stream) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::mem::memset_d8_async(p.0, value, bytes, stream(s)) }
            .map_err(err("cuMemsetD8Async"))
    }

    unsafe fn memcpy_htod_async(
        &self,
        dst: DevPtr,
        src: *const u8,
        bytes: usize,
        s: Stream,
    ) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst.0, src.cast(), bytes, stream(s)) }
            .result()
            .map_err(err("cuMemcpyHtoDAsync"))
    }

    unsafe fn memcpy_dtoh_async(
        &self,
        dst: *mut u8,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src.0, bytes, stream(s)) }
            .result()
            .map_err(err("cuMemcpyDtoHAsync"))
    }

    unsafe fn memcpy_dtod_async(
        &self,
        dst: DevPtr,
        src: DevPtr,
        bytes: usize,
        s: Stream,
    ) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::memcpy_dtod_async(dst.0, src.0, bytes, stream(s)) }
            .map_err(err("cuMemcpyDtoDAsync"))
    }

    unsafe fn host_alloc_mapped(&self, bytes: usize) -> DResult<(*mut u8, DevPtr)> {
        // SAFETY: per the contract.
        let (h, d) = unsafe { result::mem::host_alloc_mapped(bytes) }
            .map_err(err("cuMemHostAlloc (DEVICEMAP)"))?;
        Ok((h.cast(), DevPtr(d)))
    }

    unsafe fn host_free(&self, h: *mut u8) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::mem::host_free(h.cast()) }.map_err(err("cuMemFreeHost"))
    }

    unsafe fn ipc_get(&self, p: DevPtr) -> DResult<IpcHandle> {
        // SAFETY: per the contract.
        let h = unsafe { result::mem::ipc_get(p.0) }.map_err(err("cuIpcGetMemHandle"))?;
        Ok(IpcHandle(h.reserved.map(|c| c as u8)))
    }

    unsafe fn ipc_open(&self, h: &IpcHandle) -> DResult<DevPtr> {
        const _: () = assert!(std::mem::size_of::<sys::CUipcMemHandle>() == IPC_HANDLE_BYTES);
        let raw = sys::CUipcMemHandle {
            reserved: h.0.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: per the contract.
        Ok(DevPtr(
            unsafe { result::mem::ipc_open(raw) }.map_err(err("cuIpcOpenMemHandle"))?,
        ))
    }

    unsafe fn ipc_close(&self, p: DevPtr) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::mem::ipc_close(p.0) }.map_err(err("cuIpcCloseMemHandle"))
    }

    fn vmm_granularity(&self, ordinal: usize) -> DResult<usize> {
        let prop = result::vmm::device_prop(dev(ordinal)?);
        // SAFETY: driver initialised (a CudaDriver exists).
        unsafe { result::vmm::granularity(&prop) }.map_err(err("cuMemGetAllocationGranularity"))
    }

    unsafe fn vmm_create(&self, ordinal: usize, size: usize) -> DResult<VmmHandle> {
        let prop = result::vmm::device_prop(dev(ordinal)?);
        // SAFETY: per the contract.
        Ok(VmmHandle(
            unsafe { result::vmm::create(size, &prop) }.map_err(err("cuMemCreate"))?,
        ))
    }

    unsafe fn vmm_export_fd(&self, h: VmmHandle) -> DResult<i32> {
        // SAFETY: per the contract.
        unsafe { result::vmm::export_fd(h.0) }
            .map_err(err("cuMemExportToShareableHandle (POSIX fd)"))
    }

    unsafe fn vmm_import_fd(&self, fd: i32) -> DResult<VmmHandle> {
        // SAFETY: per the contract.
        Ok(VmmHandle(unsafe { result::vmm::import_fd(fd) }.map_err(
            err("cuMemImportFromShareableHandle (POSIX fd)"),
        )?))
    }

    unsafe fn vmm_reserve(&self, size: usize) -> DResult<DevPtr> {
        // SAFETY: per the contract. Alignment 0 = the granularity.
        Ok(DevPtr(
            unsafe { result::vmm::reserve(size, 0) }.map_err(err("cuMemAddressReserve"))?,
        ))
    }

    unsafe fn vmm_map(&self, p: DevPtr, size: usize, h: VmmHandle) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::vmm::map(p.0, size, h.0) }.map_err(err("cuMemMap"))
    }

    unsafe fn vmm_set_access(&self, p: DevPtr, size: usize, ordinal: usize) -> DResult<()> {
        let d = dev(ordinal)?;
        // SAFETY: per the contract.
        unsafe { result::vmm::set_access_rw(p.0, size, d) }.map_err(err("cuMemSetAccess"))
    }

    unsafe fn vmm_unmap(&self, p: DevPtr, size: usize) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::vmm::unmap(p.0, size) }.map_err(err("cuMemUnmap"))
    }

    unsafe fn vmm_address_free(&self, p: DevPtr, size: usize) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::vmm::address_free(p.0, size) }.map_err(err("cuMemAddressFree"))
    }

    unsafe fn vmm_release(&self, h: VmmHandle) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { result::vmm::release(h.0) }.map_err(err("cuMemRelease"))
    }

    unsafe fn stream_create(&self) -> DResult<Stream> {
        let s = dr::stream::create(dr::stream::StreamKind::NonBlocking)
            .map_err(err("cuStreamCreate"))?;
        Ok(Stream(s as usize as u64))
    }

    unsafe fn stream_sync(&self, s: Stream) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::stream::synchronize(stream(s)) }.map_err(err("cuStreamSynchronize"))
    }

    unsafe fn stream_destroy(&self, s: Stream) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::stream::destroy(stream(s)) }.map_err(err("cuStreamDestroy"))
    }

    unsafe fn stream_is_capturing(&self, s: Stream) -> DResult<bool> {
        // SAFETY: per the contract.
        unsafe { result::stream::is_capturing(stream(s)) }.map_err(err("cuStreamIsCapturing"))
    }

    unsafe fn begin_capture(&self, s: Stream) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe {
            dr::stream::begin_capture(
                stream(s),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        }
        .map_err(err("cuStreamBeginCapture"))
    }

    unsafe fn end_capture(&self, s: Stream) -> DResult<Graph> {
        // SAFETY: per the contract.
        let g = unsafe { dr::stream::end_capture(stream(s)) }.map_err(err("cuStreamEndCapture"))?;
        Ok(Graph(g as usize as u64))
    }

    unsafe fn graph_instantiate(&self, g: Graph) -> DResult<GraphExec> {
        // SAFETY: per the contract.
        let e = unsafe {
            dr::graph::instantiate(
                g.0 as usize as sys::CUgraph,
                sys::CUgraphInstantiate_flags(0),
            )
        }
        .map_err(err("cuGraphInstantiate"))?;
        Ok(GraphExec(e as usize as u64))
    }

    unsafe fn graph_launch(&self, e: GraphExec, s: Stream) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::graph::launch(e.0 as usize as sys::CUgraphExec, stream(s)) }
            .map_err(err("cuGraphLaunch"))
    }

    unsafe fn graph_exec_destroy(&self, e: GraphExec) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::graph::exec_destroy(e.0 as usize as sys::CUgraphExec) }
            .map_err(err("cuGraphExecDestroy"))
    }

    unsafe fn graph_destroy(&self, g: Graph) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::graph::destroy(g.0 as usize as sys::CUgraph) }.map_err(err("cuGraphDestroy"))
    }

    unsafe fn event_create(&self, timing: bool) -> DResult<Event> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let e = dr::event::create(flags).map_err(err("cuEventCreate"))?;
        Ok(Event(e as usize as u64))
    }

    unsafe fn event_record(&self, e: Event, s: Stream) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::event::record(event(e), stream(s)) }.map_err(err("cuEventRecord"))
    }

    unsafe fn event_sync(&self, e: Event) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::event::synchronize(event(e)) }.map_err(err("cuEventSynchronize"))
    }

    unsafe fn event_query(&self, e: Event) -> DResult<bool> {
        // SAFETY: per the contract.
        match unsafe { dr::event::query(event(e)) } {
            Ok(()) => Ok(true),
            Err(dr::DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(err("cuEventQuery")(e)),
        }
    }

    unsafe fn event_elapsed_ms(&self, start: Event, end: Event) -> DResult<f32> {
        // SAFETY: per the contract.
        unsafe { dr::event::elapsed(event(start), event(end)) }.map_err(err("cuEventElapsedTime"))
    }

    unsafe fn event_destroy(&self, e: Event) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::event::destroy(event(e)) }.map_err(err("cuEventDestroy"))
    }

    fn module_image(
        &self,
        name: &str,
        src: &str,
        arch: &str,
        fresh: bool,
    ) -> Result<Vec<u8>, KernelError> {
        if fresh {
            program::compile(name, &program::expand(src), arch)
        } else {
            program::cubin(name, src, arch)
        }
    }

    unsafe fn module_load(&self, image: &[u8]) -> DResult<Module> {
        // SAFETY: per the contract; cuModuleLoadData reads the image during the call only.
        let m = unsafe { dr::module::load_data(image.as_ptr().cast()) }
            .map_err(err("cuModuleLoadData"))?;
        Ok(Module(m as usize as u64))
    }

    unsafe fn module_function(&self, m: Module, name: &str) -> DResult<Function> {
        let cname = CString::new(name).map_err(|_| DriverError {
            code: sys::CUresult::CUDA_ERROR_INVALID_VALUE as i32,
            call: "cuModuleGetFunction",
            message: "a NUL in the kernel name".into(),
        })?;
        // SAFETY: per the contract.
        let f = unsafe { dr::module::get_function(m.0 as usize as sys::CUmodule, cname) }
            .map_err(err("cuModuleGetFunction"))?;
        Ok(Function(f as usize as u64))
    }

    unsafe fn module_unload(&self, m: Module) -> DResult<()> {
        // SAFETY: per the contract.
        unsafe { dr::module::unload(m.0 as usize as sys::CUmodule) }.map_err(err("cuModuleUnload"))
    }

    unsafe fn occupancy(&self, f: Function, block: u32, smem: usize) -> DResult<u32> {
        // SAFETY: per the contract.
        let n = unsafe {
            dr::occupancy::max_active_block_per_multiprocessor(
                f.0 as usize as sys::CUfunction,
                block as i32,
                smem,
            )
        }
        .map_err(err("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
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
        let func = f.0 as usize as sys::CUfunction;
        if pdl {
            // SAFETY: a plain C struct (an id and a union of plain values): all-zero is valid.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: smem,
                hStream: stream(s),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: per the contract; `cfg` and `attr` live across the call, which copies
            // the parameters before it returns.
            return unsafe { sys::cuLaunchKernelEx(&cfg, func, params, std::ptr::null_mut()) }
                .result()
                .map_err(err("cuLaunchKernelEx (PDL)"));
        }
        // SAFETY: per the contract; cuLaunchKernel copies the parameter values before it
        // returns.
        unsafe {
            sys::cuLaunchKernel(
                func,
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                smem,
                stream(s),
                params,
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(err("cuLaunchKernel"))
    }
}
