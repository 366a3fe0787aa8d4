//! The `result` layer for the driver and NVRTC calls cudarc does not wrap: thin functions over
//! `cudarc::driver::sys` / `cudarc::nvrtc::sys` that turn status codes into `Result`, one per
//! call, grouped by the part of the API they belong to (cudarc's `result` style).
//!
//! Owns: nothing. Every function is as unsafe as the call it wraps; the owning types that make
//! them safe are in [`super::mem`] and [`super`].
//! Must not: keep state, or be called before the library's presence was checked
//! ([`super::probe::libraries_present`]): cudarc's loader panics on a missing library.

use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

/// Virtual memory management: physical allocations, address ranges, mappings, and their
/// shareable handles. <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html>
pub mod vmm {
    use super::*;

    /// The allocation properties tprun uses: pinned device memory on `dev`, exportable as a
    /// POSIX file descriptor.
    pub fn device_prop(dev: sys::CUdevice) -> sys::CUmemAllocationProp {
        // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero is the documented
        // "no flags, no metadata" value; the fields that matter are set below.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = dev;
        prop
    }

    /// [cuMemGetAllocationGranularity](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__VA.html)
    /// with the recommended granularity.
    ///
    /// # Safety
    /// The driver must be initialised.
    pub unsafe fn granularity(prop: &sys::CUmemAllocationProp) -> Result<usize, DriverError> {
        let mut g = 0usize;
        // SAFETY: `g` and `prop` are valid for the call (caller: driver initialised).
        unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut g,
                prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
            .result()?
        };
        Ok(g)
    }

    /// `cuMemCreate`: a physical allocation of `size` bytes (a multiple of the granularity).
    ///
    /// # Safety
    /// A context must be current on this thread.
    pub unsafe fn create(
        size: usize,
        prop: &sys::CUmemAllocationProp,
    ) -> Result<sys::CUmemGenericAllocationHandle, DriverError> {
        let mut h = 0;
        // SAFETY: out-pointer and prop valid; caller guarantees a current context.
        unsafe { sys::cuMemCreate(&mut h, size, prop, 0).result()? };
        Ok(h)
    }

    /// `cuMemRelease`.
    ///
    /// # Safety
    /// `h` came from [`create`] or [`import_fd`] and is released once.
    pub unsafe fn release(h: sys::CUmemGenericAllocationHandle) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemRelease(h).result() }
    }

    /// `cuMemAddressReserve`: a virtual address range of `size` bytes.
    ///
    /// # Safety
    /// A context must be current on this thread.
    pub unsafe fn reserve(size: usize, align: usize) -> Result<sys::CUdeviceptr, DriverError> {
        let mut p = 0;
        // SAFETY: out-pointer valid; no fixed address requested.
        unsafe { sys::cuMemAddressReserve(&mut p, size, align, 0, 0).result()? };
        Ok(p)
    }

    /// `cuMemAddressFree`.
    ///
    /// # Safety
    /// `(p, size)` came from [`reserve`], nothing is mapped in it any more, freed once.
    pub unsafe fn address_free(p: sys::CUdeviceptr, size: usize) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemAddressFree(p, size).result() }
    }

    /// `cuMemMap` of the whole of `h` at `p`.
    ///
    /// # Safety
    /// `p..p+size` is a reserved, unmapped range; `h` is a live allocation of `size` bytes.
    pub unsafe fn map(
        p: sys::CUdeviceptr,
        size: usize,
        h: sys::CUmemGenericAllocationHandle,
    ) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemMap(p, size, 0, h, 0).result() }
    }

    /// `cuMemUnmap`.
    ///
    /// # Safety
    /// `p..p+size` was mapped by [`map`] and no queued work uses it.
    pub unsafe fn unmap(p: sys::CUdeviceptr, size: usize) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemUnmap(p, size).result() }
    }

    /// `cuMemSetAccess`: read-write access for device `dev`.
    ///
    /// # Safety
    /// `p..p+size` is mapped.
    pub unsafe fn set_access_rw(
        p: sys::CUdeviceptr,
        size: usize,
        dev: sys::CUdevice,
    ) -> Result<(), DriverError> {
        // SAFETY: all-zero is a valid CUmemAccessDesc; the fields are set below.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = dev;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: one valid descriptor; range mapped per the contract.
        unsafe { sys::cuMemSetAccess(p, size, &desc, 1).result() }
    }

    /// `cuMemExportToShareableHandle` as a POSIX fd. The caller owns the returned fd.
    ///
    /// # Safety
    /// `h` is a live allocation created with the POSIX fd handle type.
    pub unsafe fn export_fd(h: sys::CUmemGenericAllocationHandle) -> Result<c_int, DriverError> {
        let mut fd: c_int = -1;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the shareable handle is an int written to `fd`.
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
            .result()?
        };
        Ok(fd)
    }

    /// `cuMemImportFromShareableHandle` of a POSIX fd. Does not consume the fd.
    ///
    /// # Safety
    /// `fd` is an open descriptor; a context is current.
    pub unsafe fn import_fd(fd: c_int) -> Result<sys::CUmemGenericAllocationHandle, DriverError> {
        let mut h = 0;
        // SAFETY: for POSIX_FILE_DESCRIPTOR the OS handle is passed as the fd's value cast to
        // a pointer (CUDA driver API docs, cuMemImportFromShareableHandle).
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
            .result()?
        };
        Ok(h)
    }
}

/// Plain allocations and legacy IPC handles.
/// <https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html>
pub mod mem {
    use super::*;

    /// `cuMemAlloc`.
    ///
    /// # Safety
    /// A context is current.
    pub unsafe fn alloc(bytes: usize) -> Result<sys::CUdeviceptr, DriverError> {
        let mut p = 0;
        // SAFETY: out-pointer valid.
        unsafe { sys::cuMemAlloc_v2(&mut p, bytes).result()? };
        Ok(p)
    }

    /// `cuMemFree`.
    ///
    /// # Safety
    /// `p` came from [`alloc`], no queued work uses it, freed once.
    pub unsafe fn free(p: sys::CUdeviceptr) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemFree_v2(p).result() }
    }

    /// `cuIpcGetMemHandle`: the 64-byte legacy IPC handle of a `cuMemAlloc` allocation.
    ///
    /// # Safety
    /// `p` is the base of a live `cuMemAlloc` allocation.
    pub unsafe fn ipc_get(p: sys::CUdeviceptr) -> Result<sys::CUipcMemHandle, DriverError> {
        let mut h = MaybeUninit::<sys::CUipcMemHandle>::uninit();
        // SAFETY: the driver fills the whole handle on success.
        unsafe {
            sys::cuIpcGetMemHandle(h.as_mut_ptr(), p).result()?;
            Ok(h.assume_init())
        }
    }

    /// `cuIpcOpenMemHandle` with lazy peer access. Fails (by design of the API) for a handle
    /// exported by this same process.
    ///
    /// # Safety
    /// A context is current.
    pub unsafe fn ipc_open(h: sys::CUipcMemHandle) -> Result<sys::CUdeviceptr, DriverError> {
        let mut p = 0;
        // SAFETY: out-pointer valid; the handle is passed by value.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut p,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
            .result()?
        };
        Ok(p)
    }

    /// `cuIpcCloseMemHandle`.
    ///
    /// # Safety
    /// `p` came from [`ipc_open`], no queued work uses it, closed once.
    pub unsafe fn ipc_close(p: sys::CUdeviceptr) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuIpcCloseMemHandle(p).result() }
    }

    /// `cuMemHostAlloc(DEVICEMAP | PORTABLE)` and its device address: pinned host memory the
    /// GPU can write. Returns (host pointer, device address).
    ///
    /// # Safety
    /// A context is current.
    pub unsafe fn host_alloc_mapped(
        bytes: usize,
    ) -> Result<(*mut c_void, sys::CUdeviceptr), DriverError> {
        let mut h: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer valid.
        unsafe {
            sys::cuMemHostAlloc(
                &mut h,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
            .result()?
        };
        let mut d = 0;
        // SAFETY: `h` is a live DEVICEMAP allocation.
        if let Err(e) = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, h, 0).result() } {
            // SAFETY: allocated just above, freed once.
            let _ = unsafe { sys::cuMemFreeHost(h) };
            return Err(e);
        }
        Ok((h, d))
    }

    /// `cuMemFreeHost`.
    ///
    /// # Safety
    /// `h` came from [`host_alloc_mapped`], no queued work uses it, freed once.
    pub unsafe fn host_free(h: *mut c_void) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemFreeHost(h).result() }
    }

    /// `cuMemsetD8Async`.
    ///
    /// # Safety
    /// `p..p+bytes` is device memory that stays alive until the stream passes this point.
    pub unsafe fn memset_d8_async(
        p: sys::CUdeviceptr,
        value: u8,
        bytes: usize,
        stream: sys::CUstream,
    ) -> Result<(), DriverError> {
        // SAFETY: per the contract.
        unsafe { sys::cuMemsetD8Async(p, value, bytes, stream).result() }
    }
}

/// Device queries cudarc's `result::device` lacks.
pub mod device {
    use super::*;

    /// `cuDeviceCanAccessPeer`.
    ///
    /// # Safety
    /// The driver is initialised and both are valid device handles.
    pub unsafe fn can_access_peer(
        dev: sys::CUdevice,
        peer: sys::CUdevice,
    ) -> Result<bool, DriverError> {
        let mut v: c_int = 0;
        // SAFETY: per the contract.
        unsafe { sys::cuDeviceCanAccessPeer(&mut v, dev, peer).result()? };
        Ok(v != 0)
    }

    /// `cuDeviceGetPCIBusId` ("0000:3b:00.0").
    ///
    /// # Safety
    /// The driver is initialised and `dev` is valid.
    pub unsafe fn pci_bus_id(dev: sys::CUdevice) -> Result<String, DriverError> {
        // 13 characters plus NUL is the documented minimum; 32 leaves room.
        let mut buf = [0 as std::ffi::c_char; 32];
        // SAFETY: buffer length passed with the buffer.
        unsafe { sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, dev).result()? };
        // SAFETY: the driver NUL-terminates within the given length.
        let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
        Ok(s.to_string_lossy().into_owned())
    }
}

/// Streams.
pub mod stream {
    use super::*;

    /// `cuStreamIsCapturing`: true while the stream records into a graph.
    ///
    /// # Safety
    /// `s` is a live stream.
    pub unsafe fn is_capturing(s: sys::CUstream) -> Result<bool, DriverError> {
        let mut st = MaybeUninit::<sys::CUstreamCaptureStatus>::uninit();
        // SAFETY: per the contract; the driver writes the status on success.
        unsafe {
            sys::cuStreamIsCapturing(s, st.as_mut_ptr()).result()?;
            Ok(st.assume_init() != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        }
    }
}

/// NVRTC calls cudarc's `nvrtc::result` lacks.
/// <https://docs.nvidia.com/cuda/nvrtc/index.html>
pub mod nvrtc {
    use cudarc::nvrtc::result::NvrtcError;
    use cudarc::nvrtc::sys;

    /// `nvrtcVersion` as (major, minor).
    ///
    /// # Safety
    /// The NVRTC library is present.
    pub unsafe fn version() -> Result<(i32, i32), NvrtcError> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: out-pointers valid.
        unsafe { sys::nvrtcVersion(&mut a, &mut b).result()? };
        Ok((a, b))
    }

    /// `nvrtcGetCUBINSize` + `nvrtcGetCUBIN`: the machine code of a program compiled for a
    /// real architecture (`sm_XX`).
    ///
    /// # Safety
    /// `prog` is a live program that compiled successfully.
    pub unsafe fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, NvrtcError> {
        let mut n = 0usize;
        // SAFETY: per the contract.
        unsafe { sys::nvrtcGetCUBINSize(prog, &mut n).result()? };
        let mut out = vec![0u8; n];
        // SAFETY: `out` has the size NVRTC reported.
        unsafe { sys::nvrtcGetCUBIN(prog, out.as_mut_ptr().cast()).result()? };
        Ok(out)
    }
}
