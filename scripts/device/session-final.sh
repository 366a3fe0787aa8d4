#!/usr/bin/env bash
# The closing device call of a session on a one-GPU machine, in one call (~5 minutes):
#   1. multi_gpu.sh's allreduce half (info, selftest, the checked tables for every algorithm,
#      --ipc fd and legacy, NCCL beside them) with 4 ranks sharing the GPU under MPS;
#   2. `tprun bench gemv` of the Qwen3.5-27B MLP in GPTQ int4 and in bf16 (the int4 GEMV's
#      share of the copy bandwidth, issue 11);
#   3. serve.sh (continuous batching on synth llama3-8b: the batched forward's graphs).
# Every file lands in $OUT/all.tgz (the device returns few files; OUT is required, as the
# device tool sets it); the summaries are printed.
#   OUT=DIR scripts/device/session-final.sh TPRUN_BINARY
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:?tprun binary}")"
: "${OUT:?OUT: the folder for all.tgz}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
. "$root/scripts/device/common.sh"
export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
tprun_nvrtc_link
status=0
echo "== multi_gpu.sh: allreduce sections, 4 ranks"
SECTIONS="info selftest allreduce nccl" SIZES=8:64M OUT="$work/multi_gpu" \
    bash "$root/scripts/device/multi_gpu.sh" "$bin" 4 > "$work/multi_gpu.log" 2>&1 || status=1
# The result files, not the tee'd log (its last lines may still be in flight).
grep -hE "^(kernels|allreduce) .*(check|case)" "$work/multi_gpu/selftest.txt" 2>/dev/null || echo "no selftest summary"
for f in "$work"/multi_gpu/tprun-*.txt; do [ -f "$f" ] && echo "$(basename "$f"): $(grep 'Out of bounds' "$f")"; done
grep -hE "FAILED|SKIPPED" "$work/multi_gpu.log" | head -10
echo "== bench gemv, 27B MLP: int4 (group 128), then bf16"
for q in int4 bf16; do
    timeout 200 "$bin" --backend cuda --timeout 300 bench gemv --quant "$q" > "$work/gemv_$q.txt" 2>&1 || status=1
    cat "$work/gemv_$q.txt"
done
echo "== serve.sh"
OUT="$work/serve" bash "$root/scripts/device/serve.sh" "$bin" > "$work/serve.log" 2>&1 || status=1
tail -25 "$work/serve.log"
tar czf "$OUT/all.tgz" -C "$work" .
echo "session-final status $status"
exit $status
