#!/usr/bin/env bash
# Kill-anywhere: ROUNDS rounds (default 50) of SIGKILL to a random process of a tprun job (the
# coordinator or one rank) at a random moment of a random job kind (bench allreduce, decode
# of the shared TinyStories model or a synthetic one, the embedded default decode). Each round
# must end with the right exit code, no process of the round left and no file left in its
# TMPDIR / XDG_RUNTIME_DIR or /dev/shm. Prints a line per round, then "N rounds (seed S): K
# clean", and exits non-zero on any unclean round. The rounds are the kill_anywhere test's,
# which CI runs with 6; SEED (default: the time) makes a run repeatable.
#   scripts/kill_anywhere.sh [ROUNDS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-50}
seed=${2:-$(date +%s)}
TPRUN_KILL_ROUNDS=$rounds TPRUN_KILL_SEED=$seed \
    cargo test -q -p tprun --test kill_anywhere -- --nocapture --test-threads 1 2>&1 |
    grep -E '^(round |[0-9]+ rounds|thread|error)' 
exit "${PIPESTATUS[0]}"
