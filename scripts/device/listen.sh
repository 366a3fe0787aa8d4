#!/usr/bin/env bash
# `serve --listen` on a GPU: two CUDA ranks on GPU 0 (under MPS), each started by hand in its
# own IPC and UTS namespace (`unshare`; the mount namespace is shared so that the MPS pipe in
# /tmp stays reachable, and the PID namespace too: under MPS, cuInit in a new PID namespace
# failed with CUDA_ERROR_OPERATING_SYSTEM, H200 2026-12-04), join the server at a socket path
# with the job token and `--device 0`; their peer buffers travel as file descriptors over
# that socket.
# Checks: a completion equal to the one of a spawned two-rank server; then killing one rank
# ends the server with exit 3.
#
#   scripts/device/listen.sh [TPRUN_BINARY]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:-$root/target/release/tprun}")"
. "$root/scripts/device/common.sh"
tprun_job "$bin" 2 60
status=0
work=$(mktemp -d)
export TPRUN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
body='{"model":"tprun-default","prompt":"Once upon a time","max_tokens":24,"temperature":0}'

wait_ready() { # PORT PID
    for _ in $(seq 1000); do  # (a cold kernel cache compiles for ~70 s)
        curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

echo "== spawned: tprun --ranks 2 --devices 0,0 serve"
$t serve --port 8131 > "$work/spawned.log" 2>&1 &
sp=$!
wait_ready 8131 $sp || { cat "$work/spawned.log"; fail "spawned server"; }
want=$(curl -s http://127.0.0.1:8131/v1/completions -H 'content-type: application/json' -d "$body")
kill -INT $sp; wait $sp

echo "== listening: serve --listen, ranks in their own namespaces"
$t serve --port 8132 --listen "$work/tprun.sock" > "$work/listen.log" 2>&1 &
sp=$!
for _ in $(seq 50); do [ -S "$work/tprun.sock" ] && break; sleep 0.1; done
pids=()
ns=(unshare --uts --ipc --fork --kill-child)
if ! "${ns[@]}" true 2>/dev/null; then
    echo "(unshare is not permitted here: the ranks run as plain processes)"
    ns=()
fi
for r in 0 1; do
    "${ns[@]}" sh -c \
        'hostname "rank$1"; echo "rank $1 on host $(hostname)"; exec "$0" rank --join "$2" --rank "$1" --device 0' \
        "$bin" "$r" "$work/tprun.sock" > "$work/rank$r.log" 2>&1 &
    pids+=($!)
done
if ! wait_ready 8132 $sp; then
    cat "$work/listen.log" "$work"/rank*.log; fail "listening server"
    kill -INT $sp; sleep 1; kill -9 $sp "${pids[@]}" 2>/dev/null
    exit 1
fi
cat "$work/rank0.log"
got=$(curl -s http://127.0.0.1:8132/v1/completions -H 'content-type: application/json' -d "$body")
echo "spawned: $(echo "$want" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"][:60])')"
echo "listen:  $(echo "$got" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"][:60])')"
[ "$(echo "$want" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')" = \
  "$(echo "$got" | python3 -c 'import json,sys; print(json.load(sys.stdin)["choices"][0]["text"])')" ] \
    && echo "ok: the same text" || fail "the texts differ"
kill -9 "${pids[1]}"
wait $sp; rc=$?
echo "server exit $rc after rank 1 was killed"; [ $rc = 3 ] || fail "exit $rc, not 3"
grep -E "^error" "$work/listen.log"
wait "${pids[0]}"; echo "rank 0 exit $?"
rm -rf "$work"
echo "overall status $status"
exit $status
