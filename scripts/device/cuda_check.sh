#!/usr/bin/env bash
# The whole CUDA check on a lent GPU machine, in one call (see .library/device/README.md):
# the kernels crate's unit tests with TPRUN_REQUIRE_GPU=1 (every op against its CPU twin,
# multi-rank allreduce as threads, timeouts, epoch checks), the cross-process IPC tests, then
# the timings. No Rust there: the test binaries are built here and carried, with this script,
# in .devbin-cuda/ (an ignored folder of the checkout the device tool sends):
#
#   cargo test --release -p tprun-kernels --no-run   # then copy the two binaries:
#   .devbin-cuda/kernels-lib   (target/release/deps/tprun_kernels-*)
#   .devbin-cuda/kernels-ipc   (target/release/deps/cuda_ipc-*)
#
# Logs go to $OUT; the last lines printed are the summary.
set -uo pipefail
bin="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
log="$OUT/cuda_check.log"
exec > >(tee "$log") 2>&1

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
command -v nvcc >/dev/null && nvcc --version | tail -2

# NVRTC: cudarc looks for libnvrtc.so (or .so.12/.so.11...); CUDA 13 installs libnvrtc.so.13
# (and libnvrtc.so only with the -dev package), so link whichever exists.
lib=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib $(ls -d /usr/local/cuda-*/lib64 2>/dev/null); do
    if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then lib="$d"; break; fi
done
if [ -z "$lib" ]; then
    lib="$(dirname "$(find / -name 'libnvrtc.so.1*' -not -path '/proc/*' 2>/dev/null | head -1)")"
fi
echo "nvrtc from: $lib"; ls "$lib"/libnvrtc* 2>/dev/null
mkdir -p /tmp/nvrtc-link
target="$(ls "$lib"/libnvrtc.so.1[0-9]* 2>/dev/null | grep -v builtins | head -1)"
ln -sf "$target" /tmp/nvrtc-link/libnvrtc.so
export LD_LIBRARY_PATH="/tmp/nvrtc-link:$lib:${LD_LIBRARY_PATH:-}"
export TPRUN_KERNEL_CACHE=/tmp/tprun-kernel-cache
export TPRUN_REQUIRE_GPU=1
export RUST_BACKTRACE=1

status=0
step() {
    local name="$1"; shift
    local t0 t1 rc
    t0=$(date +%s%N)
    "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    t1=$(date +%s%N)
    printf '== %-14s rc=%d  %d ms\n' "$name" "$rc" $(( (t1 - t0) / 1000000 ))
    [ $rc -ne 0 ] && { status=1; tail -40 "$OUT/$name.log"; }
    return 0
}

# First: one quick test to see compile (cold cache) cost, then the same warm.
# QUICK=1 (a short lease) skips these and trims the timings.
if [ "${QUICK:-0}" != 1 ]; then
step compile-cold timeout 120 "$bin"/kernels-lib --exact cuda::selftest::tests::vmm_fd_import_in_process_sees_the_same_memory --nocapture
step compile-warm timeout 60 "$bin"/kernels-lib --exact cuda::selftest::tests::vmm_fd_import_in_process_sees_the_same_memory --nocapture
else
export TPRUN_TIMING_QUICK=1
fi
step unit timeout 200 "$bin"/kernels-lib --test-threads=1 --nocapture
grep -E "^(selftest|FAIL)" "$OUT/unit.log" | head -30
step ipc timeout 60 "$bin"/kernels-ipc --test-threads=1 --nocapture
grep -h "cross-process calls" "$OUT/ipc.log"
step timings timeout 120 "$bin"/kernels-lib --exact cuda::selftest::tests::allreduce_timings --ignored --nocapture
grep TIMING "$OUT/timings.log"
step delta timeout 60 "$bin"/kernels-lib --exact cuda::ops_delta::tests::delta_timings --ignored --nocapture
grep TIMING "$OUT/delta.log"
grep -E "^test .*(ok|FAILED|ignored)$" "$OUT/unit.log" "$OUT/ipc.log" | sed 's/^.*\/\(.*\)\.log:/\1: /'
echo "overall status $status"
exit $status
