#!/usr/bin/env bash
# Ranks in separate containers, on one machine: `tprun serve --listen` waits at a socket in a
# folder that is the only thing the containers share, and four ranks, each in its own mount,
# PID, IPC and UTS namespace (unshare; a user namespace too when not run as root), with their
# own empty /tmp and /dev/shm, join it on the CPU backend. Everything a rank needs (the plan,
# the control block, its peers' buffers) comes over that one socket as messages and file
# descriptors.
#
#   scripts/containers.sh [path/to/tprun]     (default: target/release/tprun, else target/debug)
#
# It shows, and checks (exit 1 if any check fails):
#   1. a rank with a wrong token, and a second rank claiming a number already taken, are
#      refused, and the job goes on waiting;
#   2. the four ranks serve a completion;
#   3. killing one rank's namespace mid-stream ends the server with exit 3, and the streaming
#      client gets an error event (not a hang);
#   4. nothing is left behind (the socket file, the namespaces' processes).
# Where this machine does not allow the namespaces, it says "skipped: ..." and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

TPRUN=${1:-}
if [ -z "$TPRUN" ]; then
    for t in target/release/tprun target/debug/tprun; do
        [ -x "$t" ] && { TPRUN=$t; break; }
    done
fi
[ -n "$TPRUN" ] && [ -x "$TPRUN" ] || { echo "error: no tprun binary (cargo build first, or pass its path)" >&2; exit 2; }
TPRUN=$(realpath "$TPRUN")
RANKS=4

# unshare as root needs nothing more; otherwise a user namespace maps us to root in it.
NS=(--mount --pid --ipc --uts --fork --kill-child --mount-proc)
[ "$(id -u)" = 0 ] || NS=(--user --map-root-user "${NS[@]}")
if ! unshare "${NS[@]}" sh -c 'mount -t tmpfs none /mnt && hostname probe' >/dev/null 2>&1; then
    echo "skipped: this machine does not allow unshare ${NS[*]} (unprivileged user namespaces off?)"
    exit 0
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tprun-containers.XXXXXX")
SOCKDIR=$WORK/shared
mkdir -p "$SOCKDIR"
SOCK=$SOCKDIR/tprun.sock
SERVE_PID=
declare -A NS_PID=()
cleanup() {
    for p in "${NS_PID[@]}" $SERVE_PID; do kill -9 "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

FAILED=0
check() { # check DESCRIPTION COMMAND...
    local what=$1; shift
    if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; FAILED=1; fi
}

TPRUN_JOB_TOKEN=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export TPRUN_JOB_TOKEN

# A rank in its own namespaces: the shared folder is bound at /mnt/shared (the only host path
# it uses, besides the binary bound at /mnt/tprun), /tmp and /dev/shm are its own empty tmpfs.
start_rank() { # start_rank RANK LOG [TOKEN]
    local rank=$1 log=$2 token=${3:-$TPRUN_JOB_TOKEN}
    TPRUN_JOB_TOKEN=$token unshare "${NS[@]}" sh -c '
        set -e
        mount --make-rprivate /
        mount -t tmpfs none /mnt
        mkdir /mnt/shared && touch /mnt/tprun
        mount --bind "$0" /mnt/shared
        mount --bind "$1" /mnt/tprun
        mount -t tmpfs none /tmp
        mount -t tmpfs none /dev/shm
        hostname "rank$2"
        echo "rank $2: pid $$ on host $(hostname), $(ls /dev/shm | wc -l) files in /dev/shm"
        exec /mnt/tprun rank --join /mnt/shared/tprun.sock --rank "$2"
    ' "$SOCKDIR" "$TPRUN" "$rank" >"$log" 2>&1 &
    LAST_PID=$!
}

echo "== tprun serve --listen $SOCK --ranks $RANKS (CPU backend, the embedded model)"
"$TPRUN" --backend cpu --ranks $RANKS serve --listen "$SOCK" --port 0 >"$WORK/serve.log" 2>&1 &
SERVE_PID=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
[ -S "$SOCK" ] || { cat "$WORK/serve.log"; echo "error: the server did not listen at $SOCK"; exit 1; }
URL=$(grep -o 'http://[0-9.]*:[0-9]*' "$WORK/serve.log" | head -1)

echo "== ranks 0 and 1 join; a wrong token and a second rank 1 are refused"
start_rank 0 "$WORK/rank0.log"; NS_PID[0]=$LAST_PID
start_rank 1 "$WORK/rank1.log"; NS_PID[1]=$LAST_PID
sleep 1
start_rank 2 "$WORK/bad-token.log" 00000000000000000000000000000000; BAD=$LAST_PID
start_rank 1 "$WORK/dup.log"; DUP=$LAST_PID
BAD_RC=0; wait $BAD || BAD_RC=$?
DUP_RC=0; wait $DUP || DUP_RC=$?
check "a wrong token is refused (rank exit $BAD_RC)" \
    grep -q "wrong job token" "$WORK/bad-token.log"
check "a duplicate rank number is refused (rank exit $DUP_RC)" \
    grep -q "rank 1 has already joined" "$WORK/dup.log"
check "the server is still waiting" kill -0 $SERVE_PID

echo "== ranks 2 and 3 join"
start_rank 2 "$WORK/rank2.log"; NS_PID[2]=$LAST_PID
start_rank 3 "$WORK/rank3.log"; NS_PID[3]=$LAST_PID
READY=
for _ in $(seq 300); do
    if curl -sf "$URL/health" >/dev/null 2>&1; then READY=1; break; fi
    kill -0 $SERVE_PID 2>/dev/null || break
    sleep 0.1
done
check "the job is ready" test -n "$READY"
# (the acceptor removes it when it next wakes, within a few tens of milliseconds)
for _ in $(seq 50); do [ -e "$SOCK" ] || break; sleep 0.1; done
check "the socket file is gone once all ranks joined" test ! -e "$SOCK"
sed 's/^/    /' "$WORK/rank0.log"

echo "== a completion"
BODY='{"model":"tprun-default","prompt":"Once upon a time","max_tokens":16,"temperature":0}'
curl -s "$URL/v1/completions" -H 'content-type: application/json' -d "$BODY" >"$WORK/completion.json" || true
echo "    $(cat "$WORK/completion.json")"
check "16 tokens came back" grep -q '"completion_tokens":16' "$WORK/completion.json"

echo "== kill rank 2's namespace in the middle of a stream"
disown "${NS_PID[2]}" # it will be killed: no need for bash to announce it
python3 - "$URL" "${NS_PID[2]}" >"$WORK/stream.log" 2>&1 <<'EOF' || true
import http.client, json, os, signal, sys, urllib.parse
url, victim = urllib.parse.urlparse(sys.argv[1]), int(sys.argv[2])
c = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
c.request("POST", "/v1/completions", json.dumps({
    "model": "tprun-default", "prompt": "Once upon a time", "max_tokens": 100000,
    "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
r = c.getresponse()
tokens, killed = 0, False
for line in r:
    line = line.decode().strip()
    if not line.startswith("data: "):
        continue
    data = line[6:]
    if data == "[DONE]":
        print("done")
        break
    event = json.loads(data)
    if "error" in event:
        print("error event:", json.dumps(event["error"]))
        continue
    tokens += 1
    if tokens == 5 and not killed:
        os.kill(victim, signal.SIGKILL)
        killed = True
        print("killed rank 2's namespace after 5 tokens")
print("stream ended after", tokens, "tokens")
EOF
SERVE_RC=0
wait $SERVE_PID || SERVE_RC=$?
SERVE_PID=
sed 's/^/    /' "$WORK/stream.log"
check "the client got an error event" grep -q "error event" "$WORK/stream.log"
check "the server exited with 3 (it did: $SERVE_RC)" test "$SERVE_RC" = 3
grep -E '^error' "$WORK/serve.log" | sed 's/^/    server: /'
for r in 0 1 3; do
    RC=0
    for _ in $(seq 50); do kill -0 "${NS_PID[$r]}" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "${NS_PID[$r]}" 2>/dev/null; then RC=running; else wait "${NS_PID[$r]}" || RC=$?; fi
    check "rank $r ended with the job (exit $RC)" test "$RC" != running
done
check "no socket file is left" test ! -e "$SOCK"
NS_PID=()

if [ $FAILED != 0 ]; then
    echo "== server log"; cat "$WORK/serve.log"
    exit 1
fi
echo "containers: all checks passed"
