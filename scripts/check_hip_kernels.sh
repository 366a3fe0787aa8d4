#!/usr/bin/env bash
# Compiles every kernels/src/gpu/*.cu with hipcc for gfx906 and gfx90a (device code only,
# --genco), failing on any error or warning: the portability header (portable.h) must let the
# same source build for HIP as for NVRTC.
#
# Needs Debian 12's `hipcc` (HIP 5.2.3, clang 15; no hip/hip_bf16.h, no gfx942):
#     apt-get update && apt-get install -y hipcc
# Measured on the dev machine 2026-12-02: 15 s wall for update + install (34 packages, 107 MB
# download, 673 MB installed), well inside CI's 30-minute budget. The compile itself takes
# ~2 s per source and target.
#
# Usage: scripts/check_hip_kernels.sh [out-dir]   (code objects land in out-dir, default a
# temporary directory that is removed afterwards)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
src="$root/kernels/src/gpu"
if ! command -v hipcc >/dev/null; then
    echo "error: hipcc not found (apt-get install -y hipcc)" >&2
    exit 1
fi
out="${1:-}"
# hipcc (ROCm 5.2) leaves an empty <source>-XXXXXX folder in $TMPDIR per compile: give it one
# of ours, removed on exit with the code objects unless out-dir was given.
scratch="$(mktemp -d)"
if [ -z "$out" ]; then
    out="$scratch/out"
fi
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$out" "$scratch/tmp"
export TMPDIR="$scratch/tmp"

# hipcc runs rocm_agent_enumerator to find a local GPU when no target is given; targets are
# always given here, and ROCM_TARGET_LST silences the enumerator on machines without /dev/kfd.
export ROCM_TARGET_LST="${ROCM_TARGET_LST:-/dev/null}"

fail=0
for arch in gfx906 gfx90a; do
    for cu in "$src"/*.cu; do
        name="$(basename "$cu" .cu)"
        if hipcc --genco --offload-arch="$arch" -O3 -std=c++17 -Werror -I"$src" \
            "$cu" -o "$out/$name-$arch.hsaco"; then
            echo "ok    $name.cu $arch ($(stat -c %s "$out/$name-$arch.hsaco") bytes)"
        else
            echo "FAIL  $name.cu $arch" >&2
            fail=1
        fi
    done
done
exit "$fail"
