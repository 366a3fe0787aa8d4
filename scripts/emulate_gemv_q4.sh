#!/usr/bin/env bash
# Checks gemv_q4.cu's arithmetic and indexing on a CPU (no GPU, no CUDA): builds its kernels
# with g++ against a host stand-in for portable.h (scripts/emu/), runs them one block at a
# time (a thread per GPU thread) over random int4 layers and compares with an f64 reference.
# Needs g++ 12+ (_Float16, std::barrier). ~30 s; a hang (a barrier not every thread reaches)
# fails after 300 s.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
cp "$root/scripts/emu/portable.h" "$root/scripts/emu/elem.h" "$root/scripts/emu/emulate_gemv_q4.cpp" "$tmp/"
cp "$root/kernels/src/gpu/gemv_q4.cu" "$tmp/"
for variant in subnormal magic; do
    # CUDA: subnormal nibbles, odd nibbles in place for dp4a.u32.s32; HIP: 2^23 + q − 2^23,
    # odd nibbles shifted down for the signed dot4.
    flags="-DTP_Q4K_ODD_SHIFT=4"
    [ "$variant" = magic ] && flags="-DEMU_MAGIC -DTP_Q4K_ODD_SHIFT=0"
    echo "== nibbles read as on $([ "$variant" = magic ] && echo HIP || echo CUDA) ($variant)"
    g++ -std=c++20 -O1 -pthread -Wall -Wno-unused-function -Wno-unknown-pragmas $flags \
        -o "$tmp/emu" "$tmp/emulate_gemv_q4.cpp"
    timeout 300 "$tmp/emu" | grep -v '^ok'
done
