#!/usr/bin/env bash
# Small-message latency, A/B: `bench allreduce --check` for host and oneshot at 4 KiB-64 KiB,
# every dtype, repeated, once per variant (environment settings), variants interleaved so that
# they share the machine's state. `tprun selftest` first (a variant is only worth timing if
# every kernel is right).
#
#   scripts/device/latency.sh [TPRUN_BINARY] [RANKS] [REPEATS] [VARIANT ...]
#       VARIANT: NAME=ENV[,ENV...]  e.g. memcpy=TPRUN_CUDA_MEMCPY=1  (default: one, "default=")
#
# Tables go to $OUT (default /tmp/tprun-latency); a median-of-repeats summary is printed last.
# SELFTEST=0 skips the selftest (when the same binary just passed it).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:-$root/target/release/tprun}")"
ranks="${2:-4}"
repeats="${3:-3}"
shift $(( $# < 3 ? $# : 3 ))
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=("default=")
OUT="${OUT:-/tmp/tprun-latency}"
mkdir -p "$OUT"
. "$root/scripts/device/common.sh"
tprun_job "$bin" "$ranks"
status=0
if [ "${SELFTEST:-1}" != 0 ]; then
    timeout 300 $t selftest > "$OUT/selftest.txt" 2>&1 || status=1
    tail -2 "$OUT/selftest.txt"
fi
for i in $(seq "$repeats"); do
    for v in "${variants[@]}"; do
        name=${v%%=*}; envs=${v#*=}
        timeout 120 env ${envs//,/ } $t bench allreduce --algo host,oneshot --dtype all \
            --sizes 4K:64K --check > "$OUT/$name-$i.txt" 2>&1 || status=1
    done
done
echo "== median over $repeats runs: size dtype algo time(us) graph(us); wrong rows"
for v in "${variants[@]}"; do
    name=${v%%=*}
    echo "-- $name (${v#*=})"
    cat "$OUT/$name"-*.txt | awk '$1 ~ /^[0-9]+$/ && $9 != 0 {print "   WRONG:", $0}'
    cat "$OUT/$name"-*.txt | awk '$1 ~ /^[0-9]+$/ {k=$1" "$3" "$4; t[k]=t[k]" "$5; g[k]=g[k]" "$10}
        END {for (k in t) print k, t[k], "|", g[k]}' | sort -n -k1,1 -k2,2 -k3,3 |
        python3 -c '
import sys, statistics as st
for line in sys.stdin:
    a, b = line.split("|")
    f = a.split(); k, ts = f[:3], [float(x) for x in f[3:]]
    gs = [float(x) for x in b.split() if x != "-"]
    g = f"{st.median(gs):.2f}" if gs else "-"
    print("  ", *k, f"{st.median(ts):.2f}", g)'
done
echo "overall status $status"
exit $status
