#!/usr/bin/env python3
"""Compiles every kernels/src/gpu/*.cu with NVRTC for one architecture (default sm_90), the way
tprun does at run time (portable.h / elem.h inlined), and prints each source's log.

NVRTC compiles without a GPU, so this checks CUDA kernels on a machine that has none:
    pip install nvidia-cuda-nvrtc          # libnvrtc.so.13 under site-packages/nvidia/cu13/lib
    python3 scripts/check_cuda_kernels.py [--arch sm_90] [--lib PATH] [files...]
Exit 1 on any error. Warnings are printed.
"""
import argparse
import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = os.path.join(ROOT, "kernels", "src", "gpu")


def find_lib():
    import site
    for d in site.getsitepackages() + [site.getusersitepackages()]:
        for p in glob.glob(os.path.join(d, "nvidia", "cu1*", "lib", "libnvrtc.so.*")):
            if "builtins" not in p:
                return p
    return "libnvrtc.so"


def expand(src, seen):
    out = []
    for line in src.splitlines():
        t = line.strip()
        if t.startswith('#include "') and t.endswith('"'):
            name = t[len('#include "'):-1]
            path = os.path.join(GPU, name)
            if os.path.exists(path):
                if name not in seen:
                    seen.add(name)
                    out.append(expand(open(path).read(), seen))
                continue
        out.append(line)
    return "\n".join(out) + "\n"


def compile_one(nv, path, arch, cubin_dir=None):
    src = expand(open(path).read(), set()).encode()
    prog = ctypes.c_void_p()
    r = nv.nvrtcCreateProgram(ctypes.byref(prog), src, os.path.basename(path).encode(), 0, None, None)
    assert r == 0, r
    # tprun's options (kernels/src/cuda/program.rs), so that a written cubin is what it runs.
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"--fmad=false", b"--ftz=false",
            b"-default-device"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    r = nv.nvrtcCompileProgram(prog, len(opts), arr)
    if r == 0 and cubin_dir:
        n = ctypes.c_size_t()
        nv.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        nv.nvrtcGetCUBIN(prog, buf)
        name = os.path.splitext(os.path.basename(path))[0]
        with open(os.path.join(cubin_dir, f"{name}.{arch}.cubin"), "wb") as f:
            f.write(buf.raw)
    size = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nv.nvrtcGetProgramLog(prog, log)
    nv.nvrtcDestroyProgram(ctypes.byref(prog))
    return r, log.value.decode(errors="replace")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--cubin", metavar="DIR", default=None,
                    help="also write each NAME.ARCH.cubin there (for cuobjdump -sass, e.g. from "
                         "pip's nvidia-cuda-cuobjdump)")
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    nv = ctypes.CDLL(a.lib or find_lib())
    files = a.files or sorted(glob.glob(os.path.join(GPU, "*.cu")))
    fail = 0
    for f in files:
        r, log = compile_one(nv, f, a.arch, a.cubin)
        status = "ok  " if r == 0 else "FAIL"
        print(f"{status}  {os.path.basename(f)} {a.arch}")
        if log.strip():
            print(log)
        fail |= r != 0
    sys.exit(1 if fail else 0)


if __name__ == "__main__":
    main()
