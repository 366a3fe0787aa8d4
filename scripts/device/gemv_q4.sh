#!/usr/bin/env bash
# The GPTQ int4 GEMV on a GPU machine, in one call (well under 10 minutes):
#
#   scripts/device/gemv_q4.sh BIN      BIN: a release tprun built here and carried
#
# 1. `tprun selftest`: every kernel against its CPU twin, the matmul_int4 cases (group sizes
#    32/64/128/k, desc_act, both prologues, decode and prefill, the word path) among them;
#    the kernel summary and any failure are printed.
# 2. `tprun bench gemv` (one rank): the 27B Qwen3.5 MLP at TP=1 in int4, group 128 (target:
#    ≥ 75 % of the copy bandwidth measured in the same run); the same with desc_act; and the
#    bf16 products of the same shapes beside them (gemv.cu, the dense reference).
# Results land in $OUT (or ./out): selftest.log, gemv_int4.json, gemv_int4_act.json,
# gemv_bf16.json.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:?tprun binary}")"
out="${OUT:-$root/out}"
mkdir -p "$out"
. "$root/scripts/device/common.sh"
export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
tprun_nvrtc_link
status=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

"$bin" --backend cuda --ranks 1 --timeout 300 selftest > "$out/selftest.log" 2>&1 || status=1
grep -E "^kernels|FAILED" "$out/selftest.log"
tail -3 "$out/selftest.log"

for q in "int4" "int4 --desc-act" "bf16"; do
    name="gemv_$(echo "$q" | sed 's/ --desc-act/_act/')"
    # shellcheck disable=SC2086
    "$bin" --backend cuda --timeout 300 bench gemv --quant $q || status=1
    # shellcheck disable=SC2086
    "$bin" --backend cuda --timeout 300 bench gemv --quant $q --json > "$out/$name.json" || status=1
done
exit "$status"
