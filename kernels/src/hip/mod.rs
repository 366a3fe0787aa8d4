//! The HIP runtime, loaded at run time (no ROCm at build time): `libamdhip64` with the hiprtc
//! compiler inside it (Debian's ROCm 5.2 packages; ROCm 6 ships `libhiprtc` apart, found too).
//!
//! Owns: finding the libraries, the table of every runtime symbol the HIP backend uses (all
//! resolved at load, so a library that lacks one is refused with its name), device discovery,
//! and the run-time build of the kernel sources (`kernels/src/gpu/*.cu`) through hiprtc for a
//! gfx architecture, cached on disk like NVRTC's cubins.
//! Must not: pretend to run: there is no HIP device layer yet (memory, streams, launches
//! through this table are the next step of the HIP backend), so `--backend hip` stops at
//! [`HipRuntime::devices`] with one clear line.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use libloading::Library;

use crate::cuda::program::{cache_dir, expand, fnv1a64, store};

/// Where the runtime is looked for, in order (the unversioned name comes with the -dev
/// package only).
const RUNTIME_NAMES: [&str; 3] = ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
/// ROCm 6 moved hiprtc out of the runtime.
const HIPRTC_NAMES: [&str; 2] = ["libhiprtc.so", "libhiprtc.so.6"];

/// Every HIP runtime function the backend calls: resolved at load, so that a runtime missing
/// one is refused then, by name, rather than failing in the middle of a job.
pub const RUNTIME_SYMBOLS: &[&str] = &[
    "hipInit",
    "hipGetErrorString",
    "hipRuntimeGetVersion",
    "hipDriverGetVersion",
    "hipGetDeviceCount",
    "hipDeviceGet",
    "hipDeviceGetName",
    "hipDeviceTotalMem",
    "hipDeviceGetAttribute",
    "hipDeviceGetPCIBusId",
    "hipDeviceCanAccessPeer",
    "hipSetDevice",
    "hipDeviceSynchronize",
    "hipMalloc",
    "hipFree",
    "hipHostMalloc",
    "hipHostFree",
    "hipHostGetDevicePointer",
    "hipMemcpy",
    "hipMemcpyAsync",
    "hipMemsetAsync",
    "hipStreamCreateWithFlags",
    "hipStreamSynchronize",
    "hipStreamDestroy",
    "hipStreamBeginCapture",
    "hipStreamEndCapture",
    "hipGraphInstantiate",
    "hipGraphLaunch",
    "hipGraphExecDestroy",
    "hipGraphDestroy",
    "hipEventCreateWithFlags",
    "hipEventRecord",
    "hipEventSynchronize",
    "hipEventQuery",
    "hipEventElapsedTime",
    "hipEventDestroy",
    "hipModuleLoadData",
    "hipModuleGetFunction",
    "hipModuleLaunchKernel",
    "hipModuleUnload",
    "hipIpcGetMemHandle",
    "hipIpcOpenMemHandle",
    "hipIpcCloseMemHandle",
];

/// The hiprtc functions of the run-time kernel build.
pub const HIPRTC_SYMBOLS: &[&str] = &[
    "hiprtcVersion",
    "hiprtcGetErrorString",
    "hiprtcCreateProgram",
    "hiprtcCompileProgram",
    "hiprtcGetProgramLogSize",
    "hiprtcGetProgramLog",
    "hiprtcGetCodeSize",
    "hiprtcGetCode",
    "hiprtcDestroyProgram",
];

/// The gfx architectures the kernels are built and checked for (CI compiles every kernel for
/// each, through hipcc and through this run-time path).
pub const ARCHS: [&str; 2] = ["gfx906", "gfx90a"];

/// The loaded runtime (and hiprtc, in it or beside it).
pub struct HipRuntime {
    runtime: Library,
    rtc: Option<Library>,
    /// The runtime's file name, as found.
    pub name: &'static str,
}

type HipErr = c_int;
type Prog = *mut c_void;

impl HipRuntime {
    /// Loads the runtime and checks that every symbol the backend uses is there. The error is
    /// the line `tprun info` and `--backend hip` print.
    pub fn load() -> Result<HipRuntime, String> {
        let found = RUNTIME_NAMES.iter().find_map(|&n| {
            // SAFETY: loading the HIP runtime runs its initialisers, which only register the
            // library; nothing else is called until a symbol is resolved below.
            unsafe { Library::new(n) }.ok().map(|l| (n, l))
        });
        let Some((name, runtime)) = found else {
            return Err("hip: runtime not found (libamdhip64.so)".into());
        };
        let has = |lib: &Library, s: &str| {
            // SAFETY: only looked up, not called.
            unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_ok()
        };
        let rtc = if HIPRTC_SYMBOLS.iter().all(|s| has(&runtime, s)) {
            None
        } else {
            // SAFETY: as for the runtime.
            HIPRTC_NAMES
                .iter()
                .find_map(|&n| unsafe { Library::new(n) }.ok())
        };
        let rt = HipRuntime { runtime, rtc, name };
        let missing = rt.missing_symbols();
        if !missing.is_empty() {
            return Err(format!(
                "hip: {name} lacks {} (needs ROCm 5.2 or newer)",
                missing.join(", ")
            ));
        }
        Ok(rt)
    }

    /// The symbols of [`RUNTIME_SYMBOLS`] and [`HIPRTC_SYMBOLS`] that neither library has.
    pub fn missing_symbols(&self) -> Vec<&'static str> {
        let has = |lib: &Library, s: &str| {
            // SAFETY: only looked up, not called.
            unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_ok()
        };
        let rtc = self.rtc.as_ref().unwrap_or(&self.runtime);
        RUNTIME_SYMBOLS
            .iter()
            .filter(|s| !has(&self.runtime, s))
            .chain(HIPRTC_SYMBOLS.iter().filter(|s| !has(rtc, s)))
            .copied()
            .collect()
    }

    fn rtc(&self) -> &Library {
        self.rtc.as_ref().unwrap_or(&self.runtime)
    }

    /// A runtime function of type `F` (checked present at load).
    ///
    /// # Safety
    /// `F` must be the function's C signature.
    unsafe fn f<F: Copy>(&self, lib: &Library, name: &str) -> F {
        *lib.get::<F>(name.as_bytes())
            .expect("every symbol was resolved at load")
    }

    fn error_string(&self, e: HipErr) -> String {
        // SAFETY: hipGetErrorString(hipError_t) -> const char* (static storage).
        unsafe {
            let f: unsafe extern "C" fn(HipErr) -> *const c_char =
                self.f(&self.runtime, "hipGetErrorString");
            let p = f(e);
            if p.is_null() {
                format!("error {e}")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    /// The runtime's version, e.g. 50221153 for 5.2.
    pub fn version(&self) -> Option<i32> {
        let mut v = 0;
        // SAFETY: hipRuntimeGetVersion(int*).
        let e = unsafe {
            let f: unsafe extern "C" fn(*mut c_int) -> HipErr =
                self.f(&self.runtime, "hipRuntimeGetVersion");
            f(&mut v)
        };
        (e == 0).then_some(v)
    }

    /// The number of HIP devices, or why there are none: `hipInit` fails without a GPU (or
    /// its driver, /dev/kfd). The error is the line `--backend hip` prints.
    pub fn devices(&self) -> Result<usize, String> {
        // SAFETY: hipInit(unsigned) and hipGetDeviceCount(int*).
        unsafe {
            let init: unsafe extern "C" fn(u32) -> HipErr = self.f(&self.runtime, "hipInit");
            let e = init(0);
            if e != 0 {
                return Err(format!("no HIP device (hipInit: {})", self.error_string(e)));
            }
            let count: unsafe extern "C" fn(*mut c_int) -> HipErr =
                self.f(&self.runtime, "hipGetDeviceCount");
            let mut n = 0;
            let e = count(&mut n);
            if e != 0 {
                return Err(format!(
                    "no HIP device (hipGetDeviceCount: {})",
                    self.error_string(e)
                ));
            }
            if n <= 0 {
                return Err("no HIP device".into());
            }
            Ok(n as usize)
        }
    }

    /// hiprtc's version (major, minor).
    pub fn rtc_version(&self) -> Result<(i32, i32), String> {
        let (mut a, mut b) = (0, 0);
        // SAFETY: hiprtcVersion(int*, int*).
        let e = unsafe {
            let f: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int =
                self.f(self.rtc(), "hiprtcVersion");
            f(&mut a, &mut b)
        };
        match e {
            0 => Ok((a, b)),
            e => Err(format!("hiprtcVersion: {}", self.rtc_error(e))),
        }
    }

    fn rtc_error(&self, e: c_int) -> String {
        // SAFETY: hiprtcGetErrorString(hiprtcResult) -> const char* (static storage).
        unsafe {
            let f: unsafe extern "C" fn(c_int) -> *const c_char =
                self.f(self.rtc(), "hiprtcGetErrorString");
            let p = f(e);
            if p.is_null() {
                format!("error {e}")
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        }
    }

    /// The code object of kernel module `name` (its source `src`, includes not yet expanded)
    /// for `arch`, from the kernel cache or compiled by hiprtc and stored there: one file
    /// `NAME-HASH-ARCH-hiprtcA.B.hsaco` per (expanded source, architecture, hiprtc version).
    pub fn code_object(&self, name: &str, src: &str, arch: &str) -> Result<Vec<u8>, String> {
        self.code_object_in(cache_dir(), name, src, arch)
    }

    /// [`HipRuntime::code_object`] with the cache in `dir` (`None`: no cache).
    fn code_object_in(
        &self,
        dir: Option<std::path::PathBuf>,
        name: &str,
        src: &str,
        arch: &str,
    ) -> Result<Vec<u8>, String> {
        let (va, vb) = self.rtc_version()?;
        let full = expand(src);
        let file = format!(
            "{name}-{:016x}-{arch}-hiprtc{va}.{vb}.hsaco",
            fnv1a64(full.as_bytes())
        );
        if let Some(path) = dir.as_ref().map(|d| d.join(&file)) {
            if let Ok(bytes) = std::fs::read(&path) {
                if !bytes.is_empty() {
                    return Ok(bytes);
                }
            }
        }
        let code = self.compile(name, &full, arch)?;
        if let Some(dir) = dir {
            if let Err(e) = store(&dir, &file, &code) {
                tracing::debug!("not caching {file} in {}: {e}", dir.display());
            }
        }
        Ok(code)
    }

    /// Compiles `src` (includes expanded) for `arch` with hiprtc: the kernels' own options
    /// (C++17, no FMA contraction: rounding must match the CPU twins, as with NVRTC).
    pub fn compile(&self, name: &str, src: &str, arch: &str) -> Result<Vec<u8>, String> {
        let lib = self.rtc();
        let fail = |what: &str, e: c_int| {
            format!(
                "hiprtc {what} of {name}.cu for {arch}: {}",
                self.rtc_error(e)
            )
        };
        let csrc = CString::new(src).map_err(|_| format!("{name}.cu: a NUL in the source"))?;
        let cname = CString::new(format!("{name}.cu")).expect("no NUL in a module name");
        let opts: Vec<CString> = [
            format!("--gpu-architecture={arch}"),
            "-std=c++17".to_string(),
            "-O3".to_string(),
            "-ffp-contract=off".to_string(),
        ]
        .into_iter()
        .map(|o| CString::new(o).expect("no NUL in an option"))
        .collect();
        let optp: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        // SAFETY: the hiprtc C API with the signatures of hiprtc.h (ROCm 5.2 and 6): the
        // program handle is created, used and destroyed here only; every buffer passed is
        // sized by the matching *Size call.
        unsafe {
            let create: unsafe extern "C" fn(
                *mut Prog,
                *const c_char,
                *const c_char,
                c_int,
                *const *const c_char,
                *const *const c_char,
            ) -> c_int = self.f(lib, "hiprtcCreateProgram");
            let compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int =
                self.f(lib, "hiprtcCompileProgram");
            let log_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int =
                self.f(lib, "hiprtcGetProgramLogSize");
            let get_log: unsafe extern "C" fn(Prog, *mut c_char) -> c_int =
                self.f(lib, "hiprtcGetProgramLog");
            let code_size: unsafe extern "C" fn(Prog, *mut usize) -> c_int =
                self.f(lib, "hiprtcGetCodeSize");
            let get_code: unsafe extern "C" fn(Prog, *mut c_char) -> c_int =
                self.f(lib, "hiprtcGetCode");
            let destroy: unsafe extern "C" fn(*mut Prog) -> c_int =
                self.f(lib, "hiprtcDestroyProgram");
            let mut prog: Prog = std::ptr::null_mut();
            let e = create(
                &mut prog,
                csrc.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if e != 0 {
                return Err(fail("create", e));
            }
            let e = compile(prog, optp.len() as c_int, optp.as_ptr());
            let out = if e != 0 {
                let mut n = 0usize;
                let mut log = String::new();
                if log_size(prog, &mut n) == 0 && n > 0 {
                    let mut buf = vec![0u8; n];
                    if get_log(prog, buf.as_mut_ptr().cast()) == 0 {
                        let end = buf.iter().position(|&b| b == 0).unwrap_or(n);
                        log = String::from_utf8_lossy(&buf[..end]).into_owned();
                    }
                }
                Err(format!("{}:\n{log}", fail("compile", e)))
            } else {
                let mut n = 0usize;
                match code_size(prog, &mut n) {
                    0 => {
                        let mut code = vec![0u8; n];
                        match get_code(prog, code.as_mut_ptr().cast()) {
                            0 => Ok(code),
                            e => Err(fail("get code", e)),
                        }
                    }
                    e => Err(fail("get code size", e)),
                }
            };
            if destroy(&mut prog) != 0 {
                tracing::warn!("hiprtcDestroyProgram failed");
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::program::SOURCES;

    /// Where a HIP runtime is installed (CI installs Debian's ROCm 5.2, `hipcc` pulls in
    /// libamdhip64): every symbol the backend uses resolves, `hipInit` reports no device
    /// cleanly (no GPU here), and every kernel source compiles through hiprtc for gfx906 and
    /// gfx90a into a code object (an ELF file) in the kernel cache, where a second build finds
    /// it.
    #[test]
    fn the_runtime_resolves_and_hiprtc_builds_every_kernel() {
        let rt = match HipRuntime::load() {
            Ok(rt) => rt,
            Err(e) => {
                println!("skipped: {e}");
                return;
            }
        };
        assert_eq!(rt.missing_symbols(), Vec::<&str>::new());
        match rt.devices() {
            Ok(n) => println!("{n} HIP device(s)"),
            Err(e) => assert!(e.starts_with("no HIP device"), "{e}"),
        }
        let (a, b) = rt.rtc_version().unwrap();
        println!("{}: hiprtc {a}.{b}, runtime {:?}", rt.name, rt.version());
        let cache = std::env::temp_dir().join(format!("tprun-hip-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&cache);
        // One thread per architecture (a build takes seconds to minutes per module).
        let built: Vec<Vec<Vec<u8>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = ARCHS
                .iter()
                .map(|&arch| {
                    let (rt, cache) = (&rt, &cache);
                    sc.spawn(move || {
                        SOURCES
                            .iter()
                            .map(|(name, src)| {
                                let code = rt
                                    .code_object_in(Some(cache.clone()), name, src, arch)
                                    .unwrap_or_else(|e| panic!("{e}"));
                                assert_eq!(&code[..4], b"\x7fELF", "{name} for {arch}");
                                code
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let first = built[0].first().cloned();
        let files = std::fs::read_dir(&cache).unwrap().count();
        assert_eq!(files, SOURCES.len() * ARCHS.len());
        // A second build of the first module comes from the cache, byte for byte.
        let again = rt
            .code_object_in(Some(cache.clone()), SOURCES[0].0, SOURCES[0].1, ARCHS[0])
            .unwrap();
        assert_eq!(Some(again), first);
        std::fs::remove_dir_all(&cache).unwrap();
    }
}
