#!/usr/bin/env bash
# The tensor-core products of a batch (gemv.cu gemm_tc) against the binary before them, in
# one call on one GPU:
#   1. NEW's selftest: every kernel against its CPU twin (the tensor-core cases included);
#   2. bench gemv, bf16, at m = 1, 16 and 64, BASE then NEW (the same shapes, alternated);
#   3. scripts/device/serve.sh with NEW: 8 batched = alone, then 1/4/16/64 clients.
#
#   scripts/device/batch_tc.sh NEW BASE
#
# Env: SELFTEST_S (default 300), SKIP_SERVE=1. Results in $OUT (default /tmp/tprun-tc).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
new="$(realpath "$1")"
base="$(realpath "$2")"
OUT="${OUT:-/tmp/tprun-tc}"
mkdir -p "$OUT"
. "$root/scripts/device/common.sh"
tprun_nvrtc_link
export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
status=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

echo "== selftest (NEW)"
timeout "${SELFTEST_S:-300}" "$new" selftest > "$OUT/selftest.txt" 2>&1 || fail selftest
grep -E "FAIL|failed|passed|checks" "$OUT/selftest.txt" | tail -25

echo "== bench gemv bf16: µs per call (BASE, NEW)"
shapes=4096x4096,6144x4096,28672x4096,4096x14336,128256x4096
for m in 1 16 64; do
    for b in base new; do
        bin=$base; [ $b = new ] && bin=$new
        timeout 240 "$bin" bench gemv --quant bf16 --m $m --shapes $shapes --json \
            > "$OUT/gemv-$b-m$m.json" 2> "$OUT/gemv-$b-m$m.err" || fail "bench gemv $b m $m"
    done
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def rows(b, m):
    try:
        d = json.load(open(f"{out}/gemv-{b}-m{m}.json"))
    except Exception as e:
        return {}
    return {f"{r['n']}x{r['k']}": r for r in d["rows"]}
print(f"{'m':>3} {'shape':>12} {'base us':>9} {'new us':>9} {'new/base':>9} {'new TB/s':>9}")
for m in (1, 16, 64):
    a, b = rows("base", m), rows("new", m)
    for s in b:
        if s in a:
            print(f"{m:>3} {s:>12} {a[s]['time_us']:>9.1f} {b[s]['time_us']:>9.1f} "
                  f"{b[s]['time_us'] / a[s]['time_us']:>9.2f} {b[s].get('tbps', 0):>9.2f}")
PY

if [ "${SKIP_SERVE:-0}" != 1 ]; then
    echo "== serve (NEW)"
    OUT="$OUT/serve" bash "$root/scripts/device/serve.sh" "$new" || fail serve
fi
echo "overall status $status"
exit $status
