#!/usr/bin/env bash
# Everything one device session checks, in one call: scripts/device/allreduce.sh (selftest,
# checked tables for fd and legacy IPC, low-latency A/B, copy ceiling), gpu_fault.sh, then
# latency.sh with the given variants (none given: skipped) and SELFTEST=0. Results land in
# $OUT/all.tgz; the summaries are printed.
#   scripts/device/session-check.sh [TPRUN_BINARY] [RANKS] [REPEATS] [VARIANT ...]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${1:-$root/target/release/tprun}"; ranks="${2:-4}"; repeats="${3:-2}"
shift $(( $# < 3 ? $# : 3 ))
work=$(mktemp -d)
status=0
OUT="$work/allreduce" bash "$root/scripts/device/allreduce.sh" "$bin" "$ranks" > "$work/allreduce.log" 2>&1 || status=1
tail -60 "$work/allreduce.log"
bash "$root/scripts/device/gpu_fault.sh" "$bin" "$ranks" > "$work/fault.log" 2>&1 || status=1
tail -12 "$work/fault.log"
if [ $# -gt 0 ]; then
    SELFTEST=0 OUT="$work/latency" bash "$root/scripts/device/latency.sh" "$bin" "$ranks" "$repeats" "$@" > "$work/latency.log" 2>&1 || status=1
    tail -50 "$work/latency.log"
fi
[ -n "${OUT:-}" ] && tar czf "$OUT/all.tgz" -C "$work" .
echo "session check status $status"
exit $status
