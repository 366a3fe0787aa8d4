//! The HIP runtime, loaded at run time (no ROCm at build time): `libamdhip64` with the hiprtc
//! compiler inside it (Debian's ROCm 5.2 packages; ROCm 6 ships `libhiprtc` apart, found too).
//!
//! Owns: finding the libraries, once per process ([`HipRuntime::get`]; never unloaded: a
//! runtime that ran `hipInit` keeps threads and handlers that point into it), the typed
//! function tables (every symbol resolved at load, so a library that lacks one is refused
//! with its name, and no call looks a symbol up), and the run-time build of the kernel
//! sources (`kernels/src/gpu/*.cu`) through hiprtc for a gfx architecture, cached on disk
//! like NVRTC's cubins. The driver table over this runtime is [`driver::HipDriver`].
//! Must not: keep per-device state (that is the GPU backend's, `crate::cuda`).

pub mod driver;

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

use libloading::Library;

use crate::cuda::program::{binary_in, cache_dir};
pub use driver::{HipFns, RUNTIME_SYMBOLS};

/// Where the runtime is looked for, in order (the unversioned name comes with the -dev
/// package only).
const RUNTIME_NAMES: [&str; 3] = ["libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"];
/// ROCm 6 moved hiprtc out of the runtime.
const HIPRTC_NAMES: [&str; 2] = ["libhiprtc.so", "libhiprtc.so.6"];

type Prog = *mut c_void;

crate::hip_fn_table! {
    /// The hiprtc functions of the run-time kernel build.
    RtcFns, HIPRTC_SYMBOLS, c_int;
    version = ["hiprtcVersion"]: fn(*mut c_int, *mut c_int);
    error_string = ["hiprtcGetErrorString"]: fn(c_int) -> *const c_char;
    create = ["hiprtcCreateProgram"]: fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char
    );
    compile = ["hiprtcCompileProgram"]: fn(Prog, c_int, *const *const c_char);
    log_size = ["hiprtcGetProgramLogSize"]: fn(Prog, *mut usize);
    log = ["hiprtcGetProgramLog"]: fn(Prog, *mut c_char);
    code_size = ["hiprtcGetCodeSize"]: fn(Prog, *mut usize);
    code = ["hiprtcGetCode"]: fn(Prog, *mut c_char);
    destroy = ["hiprtcDestroyProgram"]: fn(*mut Prog);
}

/// The gfx architectures the kernels are built and checked for (CI compiles every kernel for
/// each, through hipcc and through this run-time path).
pub const ARCHS: [&str; 2] = ["gfx906", "gfx90a"];

/// The loaded runtime (and hiprtc, in it or beside it), with their function tables.
pub struct HipRuntime {
    /// The runtime's functions, resolved once at load.
    pub(crate) fns: HipFns,
    rtc: RtcFns,
    /// The runtime's file name, as found.
    pub name: &'static str,
}

static RUNTIME: OnceLock<Result<HipRuntime, String>> = OnceLock::new();

impl HipRuntime {
    /// The process's HIP runtime, loaded on first use, or the line `tprun info` and
    /// `--backend hip` print: "hip: runtime not found (libamdhip64.so)", or the symbols a too
    /// old runtime lacks.
    pub fn get() -> Result<&'static HipRuntime, String> {
        RUNTIME
            .get_or_init(Self::load)
            .as_ref()
            .map_err(Clone::clone)
    }

    fn load() -> Result<HipRuntime, String> {
        let found = RUNTIME_NAMES.iter().find_map(|&n| {
            // SAFETY: loading the HIP runtime runs its initialisers, which only register the
            // library; nothing else is called until the table is resolved below.
            unsafe { Library::new(n) }.ok().map(|l| (n, l))
        });
        let Some((name, runtime)) = found else {
            return Err("hip: runtime not found (libamdhip64.so)".into());
        };
        // Never unloaded (module docs): the libraries live as long as the process.
        let runtime: &'static Library = Box::leak(Box::new(runtime));
        let rtc_lib: &'static Library = match RtcFns::resolve(runtime) {
            Ok(_) => runtime,
            Err(_) => HIPRTC_NAMES
                .iter()
                // SAFETY: as for the runtime.
                .find_map(|&n| unsafe { Library::new(n) }.ok())
                .map(|l| &*Box::leak(Box::new(l)))
                .unwrap_or(runtime),
        };
        let fns = HipFns::resolve(runtime);
        let rtc = RtcFns::resolve(rtc_lib);
        match (fns, rtc) {
            (Ok(fns), Ok(rtc)) => Ok(HipRuntime { fns, rtc, name }),
            (a, b) => {
                let missing: Vec<&str> = a.err().into_iter().chain(b.err()).flatten().collect();
                Err(format!(
                    "hip: {name} lacks {} (needs ROCm 5.2 or newer)",
                    missing.join(", ")
                ))
            }
        }
    }

    /// The name and description of a HIP status ("hipErrorNoDevice: no ROCm-capable device
    /// is detected").
    pub fn error_string(&self, e: c_int) -> String {
        // SAFETY: hipGetErrorName / hipGetErrorString(hipError_t) -> const char* (static
        // storage or null).
        let (name, what) = unsafe {
            (
                c_str((self.fns.get_error_name)(e)),
                c_str((self.fns.get_error_string)(e)),
            )
        };
        match (name, what) {
            (Some(n), Some(w)) if n != w => format!("{n}: {w}"),
            (Some(n), _) => n,
            (None, Some(w)) => w,
            (None, None) => format!("error {e}"),
        }
    }

    /// The name of a HIP status alone ("hipErrorNoDevice").
    pub fn error_name(&self, e: c_int) -> String {
        // SAFETY: hipGetErrorName(hipError_t) -> const char* (static storage or null).
        unsafe { c_str((self.fns.get_error_name)(e)) }.unwrap_or_else(|| format!("error {e}"))
    }

    /// The runtime's version, e.g. 50221153 for 5.2.
    pub fn version(&self) -> Option<i32> {
        let mut v = 0;
        // SAFETY: hipRuntimeGetVersion(int*).
        let e = unsafe { (self.fns.runtime_get_version)(&mut v) };
        (e == 0).then_some(v)
    }

    /// The number of HIP devices, or why there are none: `hipInit` fails without a GPU (or
    /// its driver, /dev/kfd). The error is the line `--backend hip` prints.
    pub fn devices(&self) -> Result<usize, String> {
        // SAFETY: hipInit(unsigned) and hipGetDeviceCount(int*).
        unsafe {
            let e = (self.fns.init)(0);
            if e != 0 {
                return Err(format!("no HIP device (hipInit: {})", self.error_name(e)));
            }
            let mut n = 0;
            let e = (self.fns.get_device_count)(&mut n);
            if e != 0 {
                return Err(format!(
                    "no HIP device (hipGetDeviceCount: {})",
                    self.error_name(e)
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
        match unsafe { (self.rtc.version)(&mut a, &mut b) } {
            0 => Ok((a, b)),
            e => Err(format!("hiprtcVersion: {}", self.rtc_error(e))),
        }
    }

    fn rtc_error(&self, e: c_int) -> String {
        // SAFETY: hiprtcGetErrorString(hiprtcResult) -> const char* (static storage or null).
        unsafe { c_str((self.rtc.error_string)(e)) }.unwrap_or_else(|| format!("error {e}"))
    }

    /// The code object of kernel module `name` (its source `src`, includes not yet expanded)
    /// for `arch`, from the kernel cache or compiled by hiprtc and stored there: one file
    /// `NAME-HASH-ARCH-hiprtcA.B.hsaco` per (expanded source, architecture, hiprtc version).
    pub fn code_object(&self, name: &str, src: &str, arch: &str) -> Result<Vec<u8>, String> {
        self.code_object_in(cache_dir(), name, src, arch)
    }

    /// [`HipRuntime::code_object`] with the cache in `dir` (`None`: no cache).
    pub(crate) fn code_object_in(
        &self,
        dir: Option<std::path::PathBuf>,
        name: &str,
        src: &str,
        arch: &str,
    ) -> Result<Vec<u8>, String> {
        let (va, vb) = self.rtc_version()?;
        binary_in(
            dir,
            name,
            src,
            arch,
            &format!("hiprtc{va}.{vb}"),
            "hsaco",
            |full| self.compile(name, full, arch),
        )
    }

    /// Compiles `src` (includes expanded) for `arch` with hiprtc: the kernels' own options
    /// (C++17, no FMA contraction: rounding must match the CPU twins, as with NVRTC).
    pub fn compile(&self, name: &str, src: &str, arch: &str) -> Result<Vec<u8>, String> {
        let r = &self.rtc;
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
            let mut prog: Prog = std::ptr::null_mut();
            let e = (r.create)(
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
            let e = (r.compile)(prog, optp.len() as c_int, optp.as_ptr());
            let out = if e != 0 {
                let mut n = 0usize;
                let mut log = String::new();
                if (r.log_size)(prog, &mut n) == 0 && n > 0 {
                    let mut buf = vec![0u8; n];
                    if (r.log)(prog, buf.as_mut_ptr().cast()) == 0 {
                        log = c_buf(&buf);
                    }
                }
                Err(format!("{}:\n{log}", fail("compile", e)))
            } else {
                let mut n = 0usize;
                match (r.code_size)(prog, &mut n) {
                    0 => {
                        let mut code = vec![0u8; n];
                        match (r.code)(prog, code.as_mut_ptr().cast()) {
                            0 => Ok(code),
                            e => Err(fail("get code", e)),
                        }
                    }
                    e => Err(fail("get code size", e)),
                }
            };
            if (r.destroy)(&mut prog) != 0 {
                tracing::warn!("hiprtcDestroyProgram failed");
            }
            out
        }
    }
}

/// The text of a C string the runtime returned, or `None` for a null pointer.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that outlives the call.
pub(crate) unsafe fn c_str(p: *const c_char) -> Option<String> {
    // SAFETY: per the contract.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The text of a buffer a C call filled: up to its first NUL (all of it without one).
pub(crate) fn c_buf(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Declares a table of C functions resolved once from a library: a struct with one typed fn
/// pointer per entry, the list of symbol names it resolves (`$names`: one list of candidate
/// names per entry, the first the one reported missing), and `resolve`, which takes the first
/// candidate the library has for every entry or returns the entries it has none for. The
/// symbol list is made from the table, so the two cannot disagree. Entries without `-> T`
/// return `$ret` (the library's status type).
#[macro_export]
#[doc(hidden)]
macro_rules! hip_fn_table {
    (
        $(#[$doc:meta])*
        $table:ident, $names:ident, $ret:ty;
        $( $field:ident = [$($sym:literal),+]: fn($($arg:ty),* $(,)?) $(-> $fret:ty)?; )*
    ) => {
        $(#[$doc])*
        #[derive(Clone, Copy)]
        pub struct $table {
            $( pub(crate) $field: unsafe extern "C" fn($($arg),*) -> $crate::hip_fn_table!(@ret $ret $(, $fret)?), )*
        }

        $(#[$doc])*
        /// (One list of candidate names per function, in the table's order.)
        pub const $names: &[&[&str]] = &[ $( &[$($sym),+], )* ];

        impl $table {
            /// Resolves every entry from `lib`, or names the entries it lacks.
            pub(crate) fn resolve(lib: &libloading::Library) -> Result<$table, Vec<&'static str>> {
                let mut missing: Vec<&'static str> = Vec::new();
                $(
                    let $field = {
                        let names: &[&'static str] = &[$($sym),+];
                        let found = names.iter().find_map(|s| {
                            // SAFETY: the entry's type is the C signature of the symbol
                            // (hip_runtime_api.h / hiprtc.h, ROCm 5.2 and 6); looked up only.
                            unsafe {
                                lib.get::<unsafe extern "C" fn($($arg),*) -> $crate::hip_fn_table!(@ret $ret $(, $fret)?)>(s.as_bytes())
                            }
                            .ok()
                            .map(|f| *f)
                        });
                        if found.is_none() {
                            missing.push(names[0]);
                        }
                        found
                    };
                )*
                if !missing.is_empty() {
                    return Err(missing);
                }
                Ok($table {
                    $( $field: $field.expect("checked above"), )*
                })
            }
        }
    };
    (@ret $ret:ty) => { $ret };
    (@ret $ret:ty, $fret:ty) => { $fret };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::program::SOURCES;

    /// Where a HIP runtime is installed (CI installs Debian's ROCm 5.2, `hipcc` pulls in
    /// libamdhip64): every symbol of the tables resolves, `hipInit` reports no device cleanly
    /// (no GPU here), and every kernel source compiles through hiprtc for gfx906 and gfx90a
    /// into a code object (an ELF file) in the kernel cache, where a second build finds it.
    #[test]
    fn the_runtime_resolves_and_hiprtc_builds_every_kernel() {
        let rt = match HipRuntime::get() {
            Ok(rt) => rt,
            // No runtime: nothing to check. A runtime that lacks a symbol fails here.
            Err(e) if e.contains("not found") => {
                println!("skipped: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
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
                    let cache = &cache;
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

    /// The symbol lists are the tables' own, and every name in them is a HIP or hiprtc
    /// function name (a typo would only show on a machine with the runtime).
    #[test]
    fn the_symbol_lists_name_hip_functions() {
        assert!(RUNTIME_SYMBOLS.len() > 40);
        for names in RUNTIME_SYMBOLS.iter().chain(HIPRTC_SYMBOLS) {
            for n in *names {
                assert!(n.starts_with("hip"), "{n}");
            }
        }
        assert!(HIPRTC_SYMBOLS.iter().all(|n| n[0].starts_with("hiprtc")));
    }
}
