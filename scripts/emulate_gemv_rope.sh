#!/usr/bin/env bash
# Checks gemv.cu's q|k|v epilogue (gemv_rope_*, gemv_norm_rope_*: ops::QkvMatmul) on a CPU (no
# GPU, no CUDA): builds the kernels with g++ against the host stand-in for portable.h
# (scripts/emu/) and kernels/src/gpu/elem.h, runs them one block at a time (a thread per GPU
# thread) and compares q and the KV cache rows with an f64 reference. Needs g++ 12+ (_Float16,
# std::barrier). ~20 s; a hang fails after 300 s.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp "$root/scripts/emu/portable.h" "$root/scripts/emu/emulate_gemv_rope.cpp" "$tmp/"
cp "$root/kernels/src/gpu/elem.h" "$root/kernels/src/gpu/gemv.cu" "$tmp/"
g++ -std=c++20 -O1 -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas \
    -o "$tmp/emu" "$tmp/emulate_gemv_rope.cpp"
timeout 300 "$tmp/emu"
