//! Run-time compilation of `kernels/src/gpu/*.cu` with NVRTC (and the cache that hiprtc's
//! builds share, [`binary_in`]), cached on disk.
//!
//! Owns: the embedded sources, include expansion, the cache key and the cache directory.
//! Must not: load modules or launch anything (that is [`super::launch`]).
//!
//! Cache: `$TPRUN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tprun/kernels`, else
//! `~/.cache/tprun/kernels`; one file `NAME-HASH-ARCH-COMPILER.EXT` per (source after include
//! expansion, architecture, compiler and its version): `reduce-…-sm_90-nvrtc12.8.cubin`,
//! `reduce-…-gfx90a-hiprtc5.2.hsaco`. A file is written unnamed (`O_TMPFILE`)
//! and named only once complete ([`store`]), so that ranks compiling the same source at once
//! never read a half-written file and a process killed mid-write leaves nothing (on a file
//! system without `O_TMPFILE`, a temporary name and a rename: a kill between them leaves
//! `*.tmp`). An unusable cache directory only costs a compile per process.

use std::ffi::CString;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::result as nv;

use super::result;
use crate::{KernelError, Result};

/// Headers the sources may `#include "..."`; NVRTC gets them inlined.
const HEADERS: [(&str, &str); 2] = [
    ("portable.h", include_str!("../gpu/portable.h")),
    ("elem.h", include_str!("../gpu/elem.h")),
];

/// The kernel sources, one per op family: (module name, source), in [`Module`] order.
pub(crate) const SOURCES: [(&str, &str); 8] = [
    ("reduce", include_str!("../gpu/reduce.cu")),
    ("comm", include_str!("../gpu/comm.cu")),
    ("decode", include_str!("../gpu/decode.cu")),
    ("gemv", include_str!("../gpu/gemv.cu")),
    ("attention", include_str!("../gpu/attention.cu")),
    ("sample", include_str!("../gpu/sample.cu")),
    ("delta", include_str!("../gpu/delta.cu")),
    ("gemv_q4", include_str!("../gpu/gemv_q4.cu")),
];

/// The modules, by their index in [`SOURCES`]: the first half of a typed kernel address
/// (the second is the kernel's index in that module's name list, `launch::kernel_names`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Module {
    Reduce = 0,
    Comm = 1,
    Decode = 2,
    Gemv = 3,
    Attention = 4,
    Sample = 5,
    Delta = 6,
    GemvQ4 = 7,
}

/// Replaces each `#include "H"` of a known header with its text, once per header (the headers
/// say `#pragma once`); other lines are kept.
pub(crate) fn expand(src: &str) -> String {
    fn go(src: &str, seen: &mut Vec<&'static str>, out: &mut String) {
        for line in src.lines() {
            let inc = line
                .trim()
                .strip_prefix("#include \"")
                .and_then(|r| r.strip_suffix('"'));
            match inc.and_then(|name| HEADERS.iter().find(|(h, _)| *h == name)) {
                Some((name, text)) => {
                    if !seen.contains(name) {
                        seen.push(name);
                        go(text, seen, out);
                    }
                }
                None => {
                    out.push_str(line);
                    out.push('\n');
                }
            }
        }
    }
    let mut out = String::new();
    go(src, &mut Vec::new(), &mut out);
    out
}

/// FNV-1a, 64-bit (Fowler, Noll, Vo; offset basis and prime from the published parameters):
/// a stable hash whose value never changes with the Rust version, unlike `DefaultHasher`.
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub(crate) fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("TPRUN_KERNEL_CACHE") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("tprun/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tprun/kernels"))
}

/// NVRTC's version, or Unavailable if the library cannot be used.
pub(crate) fn nvrtc_version() -> Result<(i32, i32)> {
    if !super::probe::nvrtc_present() {
        return Err(KernelError::Unavailable {
            backend: "cuda",
            why: "NVRTC (libnvrtc.so) not found on the library path; CUDA 13 ships only \
                  libnvrtc.so.13, so add a libnvrtc.so link to it (or to the pip package \
                  nvidia-cuda-nvrtc's copy) to LD_LIBRARY_PATH"
                .into(),
        });
    }
    // SAFETY: presence checked above.
    unsafe { result::nvrtc::version() }.map_err(|e| KernelError::Backend(format!("nvrtc: {e:?}")))
}

/// Machine code of module `name` for `arch` ("sm_90"), from the cache or freshly compiled.
pub(crate) fn cubin(name: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    let (va, vb) = nvrtc_version()?;
    binary_in(
        cache_dir(),
        name,
        src,
        arch,
        &format!("nvrtc{va}.{vb}"),
        "cubin",
        |full| compile(name, full, arch),
    )
}

/// The cache file name of module `name` (`full`: its source after include expansion).
pub(crate) fn cache_file(name: &str, full: &str, arch: &str, compiler: &str, ext: &str) -> String {
    format!(
        "{name}-{:016x}-{arch}-{compiler}.{ext}",
        fnv1a64(full.as_bytes())
    )
}

/// Machine code of module `name` (source `src`, includes not yet expanded) for `arch` by
/// `compiler` ("nvrtc12.8", "hiprtc5.2"): the file `NAME-HASH-ARCH-COMPILER.EXT` in `dir`
/// where it is there, else `compile(expanded source)`, stored there (`dir` None: no cache).
pub(crate) fn binary_in<E>(
    dir: Option<PathBuf>,
    name: &str,
    src: &str,
    arch: &str,
    compiler: &str,
    ext: &str,
    compile: impl FnOnce(&str) -> std::result::Result<Vec<u8>, E>,
) -> std::result::Result<Vec<u8>, E> {
    let full = expand(src);
    let file = cache_file(name, &full, arch, compiler, ext);
    if let Some(path) = dir.as_ref().map(|d| d.join(&file)) {
        if let Ok(bytes) = std::fs::read(&path) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
    }
    let bin = compile(&full)?;
    if let Some(dir) = dir {
        if let Err(e) = store(&dir, &file, &bin) {
            tracing::debug!("not caching {file} in {}: {e}", dir.display());
        }
    }
    Ok(bin)
}

/// Puts `bytes` in the cache as `dir/file`, whole or not at all. They go to an unnamed file in
/// `dir` (`O_TMPFILE`) that is linked under its name once complete; a name that exists already
/// is kept (another rank compiled the same module first, to the same bytes).
pub(crate) fn store(dir: &Path, file: &str, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::create_dir_all(dir)?;
    let unnamed = std::fs::OpenOptions::new()
        .write(true)
        .mode(0o644)
        .custom_flags(libc::O_TMPFILE)
        .open(dir);
    let mut f = match unnamed {
        Ok(f) => f,
        // A file system without O_TMPFILE: a temporary name, renamed.
        Err(_) => {
            let tmp = dir.join(format!("{file}.{}.tmp", std::process::id()));
            let stored =
                std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, dir.join(file)));
            if stored.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            return stored;
        }
    };
    f.write_all(bytes)?;
    // Linked through its /proc name: linkat's AT_EMPTY_PATH, the direct way, needs
    // CAP_DAC_READ_SEARCH.
    let proc_name = format!("/proc/self/fd/{}", f.as_raw_fd());
    let at = nix::fcntl::AT_FDCWD;
    match nix::unistd::linkat(
        at,
        proc_name.as_str(),
        at,
        &dir.join(file),
        nix::fcntl::AtFlags::AT_SYMLINK_FOLLOW,
    ) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Compiles `src` (includes already expanded) to a cubin for `arch`.
pub(crate) fn compile(name: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    let err = |what: &str, e: nv::NvrtcError| {
        KernelError::Backend(format!("nvrtc {what} of {name}.cu for {arch}: {e:?}"))
    };
    let csrc = CString::new(src).map_err(|_| KernelError::Invalid("NUL in a source".into()))?;
    let cname = CString::new(format!("{name}.cu")).expect("no NUL in a module name");
    let prog = nv::create_program(&csrc, Some(&cname)).map_err(|e| err("create", e))?;
    let opts = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        // No contraction of a*b+c into FMA. The kernels only add, but rounding must match the
        // CPU twins bit for bit, so say it rather than rely on it.
        "--fmad=false".to_string(),
        // The default, said explicitly for the same reason: subnormals are kept, as on the CPU.
        "--ftz=false".to_string(),
    ];
    // SAFETY: `prog` is live; the options are plain strings.
    let compiled = unsafe { nv::compile_program(prog, &opts) };
    let out = match compiled {
        // SAFETY: compiled successfully for a real architecture.
        Ok(()) => unsafe { result::nvrtc::cubin(prog) }.map_err(|e| err("get cubin", e)),
        Err(e) => {
            // SAFETY: `prog` is live.
            let log = unsafe { nv::get_program_log(prog) }
                .map(|l| {
                    let bytes: Vec<u8> =
                        l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            Err(KernelError::Backend(format!(
                "nvrtc failed to compile {name}.cu for {arch} ({e:?}):\n{log}"
            )))
        }
    };
    // SAFETY: `prog` is live and destroyed once.
    if let Err(e) = unsafe { nv::destroy_program(prog) } {
        tracing::warn!("nvrtcDestroyProgram: {e:?}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_stores_whole_files_under_their_name_only() {
        let dir = std::env::temp_dir().join(format!("tprun-kcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        store(&dir, "m.cubin", b"first").unwrap();
        // A second store of the same name keeps the first file.
        store(&dir, "m.cubin", b"second").unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        let bytes = std::fs::read(dir.join("m.cubin")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, ["m.cubin"]);
        assert_eq!(bytes, b"first");
    }

    #[test]
    fn expand_inlines_each_header_once() {
        let full = expand(SOURCES[1].1);
        assert!(!full
            .lines()
            .any(|l| l.trim_start().starts_with("#include \"")));
        assert_eq!(full.matches("TP_DEV float tp_f16_to_f32").count(), 1);
        assert!(full.contains("TP_ALLREDUCE(oneshot, f32, F32)"));
    }

    #[test]
    fn cache_names_say_source_arch_and_compiler() {
        let f = cache_file("comm", "x", "gfx90a", "hiprtc5.2", "hsaco");
        assert_eq!(
            f,
            format!("comm-{:016x}-gfx90a-hiprtc5.2.hsaco", fnv1a64(b"x"))
        );
        let dir = std::env::temp_dir().join(format!("tprun-binary-in-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let built = |_: &str| Ok::<_, ()>(b"code".to_vec());
        let a = binary_in(
            Some(dir.clone()),
            "m",
            "src",
            "sm_90",
            "nvrtc12.8",
            "cubin",
            built,
        );
        // The second build is the cache's: its compile is never called.
        let b = binary_in(
            Some(dir.clone()),
            "m",
            "src",
            "sm_90",
            "nvrtc12.8",
            "cubin",
            |_| Err(()),
        );
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(a, Ok(b"code".to_vec()));
        assert_eq!(b, a);
        assert_eq!(
            names,
            [cache_file(
                "m",
                &expand("src"),
                "sm_90",
                "nvrtc12.8",
                "cubin"
            )]
        );
    }

    #[test]
    fn fnv_is_the_published_function() {
        // Test vectors from the FNV reference (draft-eastlake-fnv): "" and "a".
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    /// Compiles every source where NVRTC is present (no GPU needed): catches CUDA-only
    /// syntax errors on a build machine with the pip `nvidia-cuda-nvrtc` package.
    #[test]
    fn sources_compile_with_nvrtc_when_present() {
        if !crate::cuda::probe::nvrtc_present() {
            println!("skipped: no NVRTC");
            return;
        }
        for (name, src) in SOURCES {
            let bin = compile(name, &expand(src), "sm_90").unwrap();
            assert!(!bin.is_empty());
        }
    }
}
