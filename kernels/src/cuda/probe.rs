//! What the machine has: are the CUDA libraries there, which devices (of either runtime,
//! through the driver table), who can reach whom.
//!
//! Owns: the presence checks that must run before any cudarc call (cudarc's run-time loader
//! panics when a library is missing), [`probe_with`] and [`peer_matrix_with`] for `tprun
//! info` (and their CUDA shorthands [`probe`], [`peer_matrix`]).
//! Must not: create contexts that outlive a call.

use cudarc::driver::{result as dr, sys};

use super::{driver_err, Gpu};
use crate::device::DeviceInfo;
use crate::driver::Driver;
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
    Gpu::Cuda
        .driver()
        .and_then(|d| d.device_count().map_err(Into::into))
        .unwrap_or(0)
}

/// What `tprun info` shows of device `ordinal`. The UUID is read with a fallback (all zeros:
/// some HIP runtimes have no `hipDeviceGetUuid` answer for some boards); the PCI bus id beside
/// it still tells devices apart.
pub(crate) fn info_of(driver: &dyn Driver, ordinal: usize) -> Result<DeviceInfo> {
    let arch = driver
        .device_arch(ordinal)
        .map_err(driver_err("reading the architecture"))?;
    let name = driver
        .device_name(ordinal)
        .map_err(driver_err("reading the name"))?;
    let memory = driver
        .total_mem(ordinal)
        .map_err(driver_err("reading the memory size"))?;
    let u = driver.uuid(ordinal).unwrap_or_default();
    let pci = driver.pci_bus_id(ordinal).unwrap_or_default();
    Ok(DeviceInfo {
        backend: driver.caps().backend.into(),
        ordinal,
        name,
        memory,
        arch,
        // nvidia-smi's spelling, plus the PCI bus id: "GPU-xxxxxxxx-xxxx-... (0000:3b:00.0)".
        uuid: format_uuid(&u, &pci),
    })
}

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (PCI bus id)".
fn format_uuid(u: &[u8; 16], pci: &str) -> String {
    format!(
        "GPU-{}-{}-{}-{}-{} ({pci})",
        hex(&u[0..4]),
        hex(&u[4..6]),
        hex(&u[6..8]),
        hex(&u[8..10]),
        hex(&u[10..16])
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Every visible device of `driver`'s runtime (name, memory, arch, UUID and PCI bus id).
pub fn probe_with(driver: &dyn Driver) -> Result<Vec<DeviceInfo>> {
    let n = driver
        .device_count()
        .map_err(driver_err("counting devices"))?;
    (0..n).map(|i| info_of(driver, i)).collect()
}

/// Every visible CUDA device. `Unavailable` when there is no driver; an empty list when there
/// is a driver but no device.
pub fn probe() -> Result<Vec<DeviceInfo>> {
    probe_with(&*Gpu::Cuda.driver()?)
}

/// `m[i][j]`: device i can map device j's memory directly (`cuDeviceCanAccessPeer`,
/// `hipDeviceCanAccessPeer`; the diagonal is true). Ranks on devices without peer access
/// cannot use oneshot/twoshot.
pub fn peer_matrix_with(driver: &dyn Driver) -> Result<Vec<Vec<bool>>> {
    let n = driver
        .device_count()
        .map_err(driver_err("counting devices"))?;
    let mut m = vec![vec![false; n]; n];
    for (i, row) in m.iter_mut().enumerate() {
        for (j, cell) in row.iter_mut().enumerate() {
            *cell = i == j
                || driver
                    .can_access_peer(i, j)
                    .map_err(driver_err("asking for peer access"))?;
        }
    }
    Ok(m)
}

/// [`peer_matrix_with`] for CUDA.
pub fn peer_matrix() -> Result<Vec<Vec<bool>>> {
    peer_matrix_with(&*Gpu::Cuda.driver()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_read_as_nvidia_smi_spells_them() {
        let u: [u8; 16] = std::array::from_fn(|i| i as u8);
        assert_eq!(
            format_uuid(&u, "0000:3b:00.0"),
            "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f (0000:3b:00.0)"
        );
    }
}
