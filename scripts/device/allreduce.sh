#!/usr/bin/env bash
# The whole GPU allreduce check and benchmark, one command on a GPU machine:
#   tprun info; tprun selftest; tprun bench allreduce --check for every algorithm and dtype,
#   1 element to 64 MiB, with --ipc fd and --ipc legacy; oneshot with and without the
#   low-latency kernel (TPRUN_CUDA_LL=0) side by side; the device-copy ceiling for ratios.
# With fewer GPUs than ranks, ranks share GPU 0 and the CUDA MPS daemon is started (without it
# the ranks' contexts time-slice and every cross-rank wait costs milliseconds) and stopped after.
#
#   scripts/device/allreduce.sh [TPRUN_BINARY] [RANKS]      (default target/release/tprun, 4)
#
# Tables and logs go to $OUT (default /tmp/tprun-allreduce); the summary is printed last.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:-$root/target/release/tprun}")"
ranks="${2:-4}"
OUT="${OUT:-/tmp/tprun-allreduce}"
mkdir -p "$OUT"
. "$root/scripts/device/common.sh"
tprun_job "$bin" "$ranks"
status=0
run() { # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "== $name: $*"
    timeout "$secs" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    [ $rc -eq 0 ] || { status=1; echo "   rc=$rc"; grep -v '^\[rank' "$OUT/$name.txt" | grep -E 'error|warning' | tail -5; }
    return 0
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
run info 30 "$bin" info
cat "$OUT/info.txt"
run selftest 240 $t selftest
tail -3 "$OUT/selftest.txt"
for ipc in fd legacy; do
    run "odd-$ipc" 120 $t --ipc "$ipc" bench allreduce --algo all --dtype all --counts 1,7,1001,65537 --check
    run "bench-$ipc" 300 $t --ipc "$ipc" bench allreduce --algo all --dtype all --sizes 8:64M --check
done
# The low-latency oneshot against the flag-and-slot one, in the same minute.
for ll in 1 0; do
    run "oneshot-ll$ll" 120 env TPRUN_CUDA_LL=$ll $t bench allreduce --algo oneshot --dtype f32,bf16 --sizes 8:1M --check
done
python3 - > "$OUT/copy.txt" <<'PY'
import torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10): y.copy_(x)
e.record(); torch.cuda.synchronize()
t = s.elapsed_time(e) / 10 / 1e3
print(f"device copy 1 GiB: {t*1e6:.1f} us = {2 * (1 << 30) / t / 1e12:.2f} TB/s (read + write)")
PY
cat "$OUT/copy.txt"

echo "== summary"
for f in "$OUT"/odd-*.txt "$OUT"/bench-*.txt "$OUT"/oneshot-*.txt; do
    [ -s "$f" ] && echo "$(basename "$f"): $(grep -c '^ *[0-9]' "$f") rows, $(grep 'Out of bounds' "$f")"
done
for ipc in fd legacy; do
    f="$OUT/bench-$ipc.txt"; [ -s "$f" ] || continue
    echo "-- $ipc: 16 KiB rows (time us, graph us) and 64 MiB rows"
    awk '$1==16384 || $1==67108864 {print "  ", $1, $3, $4, "time", $5, "graph", $10, "busbw", $8}' "$f"
done
for ll in 1 0; do
    f="$OUT/oneshot-ll$ll.txt"; [ -s "$f" ] || continue
    echo "-- oneshot, TPRUN_CUDA_LL=$ll: 8 B .. 1 MiB (size dtype time graph)"
    awk '$1 ~ /^[0-9]+$/ {print "  ", $1, $3, $5, $10}' "$f"
done
echo "overall status $status"
exit $status
