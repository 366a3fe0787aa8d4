#!/usr/bin/env bash
# The driver-table backend (issue 13) against the binary before it, in one device call:
#   decode.sh check through NEW (selftest: every kernel against its CPU twin and every
#   allreduce; stories260k at 1 and 4 ranks, eager and as one graph; qwen3 TP=4 = TP=1; bad
#   input; SIGKILL of a rank), then small-message allreduce latency at 4 ranks on one GPU,
#   NEW and BASE alternated three times (host and oneshot, f32, 4-64 KiB; median), then, in
#   what time is left, serve.sh through NEW (batched steps as graphs, tensor-core products).
#
#   scripts/device/driver_table.sh NEW BASE [STORIES_DIR] [SECONDS]   (default 540 s in all)
#
# RESERVE=S seconds kept after the decode checks (default 200); REPEATS=N alternations of the latency runs (default 3); SERVE_MODEL=DIR CHECK_ONLY=1 makes the
# serve part serve.sh's batched = alone check on DIR only (seconds instead of minutes).
#
# Results in $OUT (default /tmp/tprun-driver): check/, lat-*.txt, serve/.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
new="$(realpath "${1:?new tprun binary}")"
base="$(realpath "${2:?base tprun binary}")"
stories="${3:-$root/.devdata/stories260k}"
end=$(( $(date +%s) + ${4:-540} ))
OUT="${OUT:-/tmp/tprun-driver}"
mkdir -p "$OUT"
status=0
OUT="$OUT/check" DEADLINE=$(( end - ${RESERVE:-200} )) SELFTEST_S=${SELFTEST_S:-200} \
    bash "$root/scripts/device/decode.sh" check "$new" "$stories" 2>&1 | grep -v "^\[rank" || status=1
. "$root/scripts/device/common.sh"
tprun_job "$new" 4
echo "== allreduce latency, 4 ranks on $devices: new and base alternated"
for i in $(seq "${REPEATS:-3}"); do
    for b in new base; do
        bin=$new; [ $b = base ] && bin=$base
        timeout 60 $bin --ranks 4 --devices "$devices" --backend cuda --timeout 30 bench allreduce \
            --algo host,oneshot --dtype f32 --sizes 4K:64K --check > "$OUT/lat-$b-$i.txt" 2>&1 || { echo "bench $b $i failed"; status=1; }
    done
done
for b in new base; do
    echo "-- $b: size algo median time(us) graph(us); wrong rows:"
    cat "$OUT"/lat-$b-*.txt | awk '$1 ~ /^[0-9]+$/ && $9 != 0 {print "   WRONG:", $0}'
    cat "$OUT"/lat-$b-*.txt | awk '$1 ~ /^[0-9]+$/ {k=$1" "$4; t[k]=t[k]" "$5; g[k]=g[k]" "$10}
        END {for (k in t) print k, t[k], "|", g[k]}' | sort -n -k1,1 |
        python3 -c '
import sys, statistics as st
for line in sys.stdin:
    a, b = line.split("|")
    f = a.split(); ts = [float(x) for x in f[2:]]
    gs = [float(x) for x in b.split() if x != "-"]
    print("  ", f[0], f[1], f"{st.median(ts):.2f}", f"{st.median(gs):.2f}" if gs else "-")'
done
echo quit | nvidia-cuda-mps-control 2>/dev/null; trap - EXIT
left=$(( end - $(date +%s) ))
if [ -n "${SERVE_MODEL:-}" ] && [ $left -gt 20 ]; then
    OUT="$OUT/serve" timeout $left bash "$root/scripts/device/serve.sh" "$new" 2>&1 | tail -8 || status=1
elif [ $left -gt 150 ]; then
    OUT="$OUT/serve" timeout $left bash "$root/scripts/device/serve.sh" "$new" 64 2 2>&1 | tail -22 || status=1
else
    echo "SKIPPED (time): serve.sh ($left s left)"
fi
echo "driver_table.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
