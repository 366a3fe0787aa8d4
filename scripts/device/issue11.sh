#!/usr/bin/env bash
# Issue 11's figures in one call on the GPU machine (~6 minutes on an H200):
#   1. the 27b synth (GPTQ int4 MLP, group 128) starts in the background;
#   2. with LAB=1, the int4 GEMV lab (`LAB_QUICK=1 q4lab.sh`: production beside the candidates);
#   3. `tprun bench gemv --quant int4`: the int4 GEMV's share of the copy bandwidth;
#   4. `qwen35.sh perf` on the synth: TP=1 tok/s against the copy rate of the same call, then
#      TP=4 on one GPU (MPS) with and without its allreduces.
#   [LAB=1] OUT=DIR scripts/device/issue11.sh TPRUN_BINARY
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
. "$root/scripts/device/common.sh"
tprun_ab "${1:?tprun binary}"  # $out, the kernel cache, libnvrtc, status=0
bin="${bins[0]}"
export Q35_27B=/tmp/tprun-q35-27b  # written here while the lab and bench run, used by qwen35.sh perf
m=$Q35_27B
trap 'rm -rf "$m"' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
tprun_synth_27b "$bin" "$m" 2> "$out/synth.err" &
synth=$!
if [ "${LAB:-0}" = 1 ]; then
    echo "== q4lab (quick)"
    OUT="$out" LAB_QUICK=1 timeout 240 "$root/scripts/device/q4lab.sh" > "$out/lab.log" 2>&1 || status=1
    grep -vE "^ *$" "$out/lab.log" | tail -40
fi
echo "== bench gemv --quant int4"
timeout 200 "$bin" --backend cuda --timeout 300 bench gemv --quant int4 > "$out/gemv.txt" 2>&1 || status=1
cat "$out/gemv.txt"
wait $synth || { echo "FAILED: synth"; tail -3 "$out/synth.err"; exit 1; }
echo "synth done after $(( $(date +%s) - t0 )) s"
echo "== qwen35.sh perf"
"$root/scripts/device/qwen35.sh" perf "$bin" || status=1
echo "issue11.sh status $status"
exit $status
