#!/usr/bin/env bash
# Nothing left behind on a GPU machine (issue 10's "any death of any process", the GPU half):
# CUDA jobs with each IPC mode, ending normally, by SIGKILL of a rank and by SIGKILL of the
# coordinator, must leave no new entry in /dev/shm, $TMPDIR (or /tmp) or $XDG_RUNTIME_DIR, no
# process and nothing on the GPU.
#   scripts/device/leftovers.sh TPRUN_BINARY [STORIES_DIR]
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:?tprun binary}")"
stories="$(realpath "${2:-$root/.devdata/stories260k}")"
. "$root/scripts/device/common.sh"
tprun_job "$bin" 4
status=0
dirs=(/dev/shm "${TMPDIR:-/tmp}" "${XDG_RUNTIME_DIR:-/run/user/$(id -u)}")
# Entries of the watched folders, minus what MPS and the kernel cache keep there on purpose.
snapshot() { for d in "${dirs[@]}"; do ls -A "$d" 2>/dev/null | sed "s|^|$d/|"; done | grep -vE 'tprun-(mps|nvrtc|kernel-cache)|cuda_mps' | sort; }
before=$(snapshot)
check() {
    sleep 1
    local new procs apps
    new=$(comm -13 <(echo "$before") <(snapshot) | tr '\n' ' ')
    procs=$(pgrep -f "$bin" | tr '\n' ' ')
    apps=$(tprun_gpu_apps)
    echo "$1: exit $2; new entries: [${new}]; tprun processes: [${procs}]; on the GPU: $apps"
    { [ -z "$new" ] && [ -z "$procs" ] && [ "$apps" -eq 0 ]; } || { echo "FAILED: $1"; status=1; }
}
for ipc in fd legacy; do
    $t --ipc $ipc bench allreduce --sizes 4K:1M --iters 50 > /dev/null 2>&1
    check "bench allreduce, --ipc $ipc" $?
    $t --ipc $ipc decode --model "$stories" --max-new-tokens 32 > /dev/null 2>&1
    check "decode stories260k TP=4, --ipc $ipc" $?
    # SIGKILL of a rank, then of the coordinator, mid-allreduce-loop.
    for victim in rank coordinator; do
        $t --ipc $ipc bench allreduce --sizes 64K --algo oneshot --iters 100000000 --warmup 0 > /dev/null 2>&1 &
        coord=$!
        sleep 5
        if [ $victim = rank ]; then kill -9 "$(pgrep -P "$coord" -f -- '--rank 1( |$)' | head -1)"; else kill -9 "$coord"; fi
        wait "$coord"; rc=$?
        # The coordinator's death takes its ranks with it (PDEATHSIG); give them a moment.
        sleep 1
        check "SIGKILL of the $victim mid-allreduce, --ipc $ipc" $rc
        tprun_mps_restart > /dev/null
    done
done
echo "leftovers.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
