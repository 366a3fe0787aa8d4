//! What the machine has: are the CUDA libraries there, which devices, who can reach whom.
//!
//! Owns: the presence checks that must run before any cudarc call (cudarc's run-time loader
//! panics when a library is missing), [`probe`] and [`peer_matrix`] for `tprun info`.
//! Must not: create contexts that outlive a call.

use cudarc::driver::{result as dr, sys};

use super::{driver_err, result};
use crate::device::DeviceInfo;
use crate::{KernelError, Result};

/// True when libcuda can be loaded (cudarc's own candidate names).
pub fn driver_present() -> bool {
    // SAFETY: only tries dlopen on cudarc's candidate names; calls nothing in the library.
    unsafe { sys::is_culib_present() }
}

/// True when libnvrtc can be loaded (cudarc's candidate names: `libnvrtc.so`, `.so.12`, ...).
pub fn nvrtc_present() -> bool {
    // SAFETY: as in `driver_present`.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Loads and initialises the driver, or says why the backend is unusable.
pub(crate) fn init() -> Result<()> {
    if !driver_present() {
        return Err(KernelError::Unavailable {
            backend: "cuda",
            why: "no CUDA driver (libcuda.so.1) found".into(),
        });
    }
    dr::init().map_err(|e| KernelError::Unavailable {
        backend: "cuda",
        why: format!("cuInit failed: {e:?}"),
    })
}

/// Number of visible CUDA devices (0 when there is no driver or no device).
pub fn device_count() -> usize {
    if init().is_err() {
        return 0;
    }
    dr::device::get_count().map_or(0, |n| n.max(0) as usize)
}

fn info_of(ordinal: usize) -> Result<DeviceInfo> {
    let dev = dr::device::get(ordinal as i32).map_err(driver_err("cuDeviceGet"))?;
    let attr = |a| {
        // SAFETY: `dev` is a valid handle of an initialised driver.
        unsafe { dr::device::get_attribute(dev, a) }.map_err(driver_err("cuDeviceGetAttribute"))
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let name = dr::device::get_name(dev).map_err(driver_err("cuDeviceGetName"))?;
    // SAFETY: as above.
    let memory = unsafe { dr::device::total_mem(dev) }.map_err(driver_err("cuDeviceTotalMem"))?;
    let uuid = dr::device::get_uuid(dev).map_err(driver_err("cuDeviceGetUuid"))?;
    let u: Vec<u8> = uuid.bytes.iter().map(|&b| b as u8).collect();
    // SAFETY: as above.
    let pci = unsafe { result::device::pci_bus_id(dev) }.unwrap_or_default();
    Ok(DeviceInfo {
        backend: "cuda".into(),
        ordinal,
        name,
        memory: memory as u64,
        arch: format!("sm_{major}{minor}"),
        // nvidia-smi's spelling, plus the PCI bus id: "GPU-xxxxxxxx-xxxx-... (0000:3b:00.0)".
        uuid: format!(
            "GPU-{}-{}-{}-{}-{} ({pci})",
            hex(&u[0..4]),
            hex(&u[4..6]),
            hex(&u[6..8]),
            hex(&u[8..10]),
            hex(&u[10..16])
        ),
    })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Every visible CUDA device (name, memory, `sm_XY`, UUID and PCI bus id).
/// `Unavailable` when there is no driver; an empty list when there is a driver but no device.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    init()?;
    let n = dr::device::get_count().map_err(driver_err("cuDeviceGetCount"))?;
    (0..n.max(0) as usize).map(info_of).collect()
}

/// `m[i][j]`: device i can map device j's memory directly (`cuDeviceCanAccessPeer`; the
/// diagonal is true). Ranks on devices without peer access cannot use oneshot/twoshot.
pub fn peer_matrix() -> Result<Vec<Vec<bool>>> {
    init()?;
    let n = dr::device::get_count()
        .map_err(driver_err("cuDeviceGetCount"))?
        .max(0);
    let devs = (0..n)
        .map(|i| dr::device::get(i).map_err(driver_err("cuDeviceGet")))
        .collect::<Result<Vec<_>>>()?;
    let mut m = vec![vec![false; devs.len()]; devs.len()];
    for (i, &a) in devs.iter().enumerate() {
        for (j, &b) in devs.iter().enumerate() {
            m[i][j] = i == j
                // SAFETY: valid handles of an initialised driver.
                || unsafe { result::device::can_access_peer(a, b) }
                    .map_err(driver_err("cuDeviceCanAccessPeer"))?;
        }
    }
    Ok(m)
}
