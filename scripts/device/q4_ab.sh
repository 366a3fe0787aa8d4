#!/usr/bin/env bash
# A/B of the Qwen3.5-27B GPTQ int4 decode between tprun binaries, in one call (issue 11):
#
#   scripts/device/q4_ab.sh [--check|--selftest] BIN...
#
# Writes synth qwen3_5 `27b` with its MLP in GPTQ int4 (group 128, the official layout) once,
# in the background; meanwhile `tprun bench gemv --quant int4` (each binary's default rows: the
# 27B MLP as that binary's decode runs it) for every binary in turn. Then the device copy
# bandwidth, and `decode` TP=1 (graph + PDL, 128 new tokens) with each binary, ROUNDS rounds
# (default 2), one line per run, and a check that every binary gives the same tokens.
# --check first runs `tprun selftest` and `qwen35.sh check` (the transformers-built tiny
# fixtures, dense and GPTQ, 1 and 4 ranks, graph and eager) with the first binary (--selftest:
# the selftest alone). Last, one profiled run of the first binary (eager, each op between
# events): µs per token by op.
# GEMV_ONLY=1: the checks and the bench only (no synth, no decode); NO_PROFILE=1: no profile.
# BF16_SHAPES=NxK,...: also `bench gemv --quant bf16 --shapes` those, each binary, two rounds.
# Results in $OUT (or ./out).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
check=0
case "${1:-}" in --check) check=2; shift ;; --selftest) check=1; shift ;; esac
[ $# -ge 1 ] || { echo "usage: q4_ab.sh [--check|--selftest] BIN..."; exit 2; }
. "$root/scripts/device/common.sh"
tprun_ab "$@"
m=/tmp/tprun-q35-27b-ab
trap 'rm -rf "$m"' EXIT
t0=$(date +%s)
gemv_only="${GEMV_ONLY:-0}"
if [ "$gemv_only" != 1 ]; then
    tprun_synth_27b "${bins[0]}" $m 2> "$out/synth.err" &
    synth=$!
fi
if [ $check -ge 1 ]; then
    echo "== selftest (${bins[0]})"
    timeout 400 "${bins[0]}" selftest > "$out/selftest.txt" 2>&1 || fail selftest
    grep -E "FAIL|check\(s\)|case\(s\)" "$out/selftest.txt" | tail -12
fi
if [ $check = 2 ]; then
    echo "== qwen35.sh check (${bins[0]})"
    OUT="$out/check" timeout 400 "$root/scripts/device/qwen35.sh" check "${bins[0]}" 2>&1 | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || fail "qwen35.sh check"
fi
echo "== bench gemv --quant int4 (each binary's default rows)"
for r in 1 2; do
    for i in "${!bins[@]}"; do
        echo "-- bin $i round $r"
        timeout 200 "${bins[$i]}" --backend cuda --timeout 300 bench gemv --quant int4 \
            > "$out/gemv-$i-r$r.txt" 2>&1 || fail "bench gemv bin $i"
        grep -vE '^#' "$out/gemv-$i-r$r.txt" | tail -3
    done
done
if [ -n "${BF16_SHAPES:-}" ]; then
    echo "== bench gemv --quant bf16 --shapes $BF16_SHAPES"
    for r in 1 2; do
        for i in "${!bins[@]}"; do
            echo "-- bin $i round $r"
            timeout 200 "${bins[$i]}" --backend cuda --timeout 300 bench gemv --quant bf16 --shapes "$BF16_SHAPES" \
                > "$out/gemv-bf16-$i-r$r.txt" 2>&1 || fail "bench gemv bf16 bin $i"
            grep -vE '^#' "$out/gemv-bf16-$i-r$r.txt" | tail -8
        done
    done
fi
if [ "$gemv_only" = 1 ]; then
    [ $status -eq 0 ] && echo "q4_ab.sh: PASS" || echo "q4_ab.sh: FAILED"
    exit $status
fi
wait $synth || { fail synth; tail -3 "$out/synth.err"; exit 1; }
echo "synth done after $(( $(date +%s) - t0 )) s"
python3 "$root/scripts/device/copy_bw.py" | tee "$out/copy.txt" || fail "copy bandwidth"
run() {  # run BIN_INDEX TAG
    local i=$1 tag=$2
    "${bins[$i]}" --backend cuda --ranks 1 --devices 0 --timeout 120 decode --model $m \
        --prompt "Once upon a time, in a land far away" --temperature 0 --max-new-tokens 128 --ignore-eos --json \
        > "$out/ab-$i-$tag.json" 2> "$out/ab-$i-$tag.err" || { fail "bin $i $tag"; tail -3 "$out/ab-$i-$tag.err"; return; }
    tprun_decode_line "$out/ab-$i-$tag.json" "$out/copy.txt" "bin $i ($tag)"
}
echo "== decode 27b GPTQ, TP=1, graph + PDL, 128 tokens; bins: ${bins[*]}"
for r in $(seq "${ROUNDS:-2}"); do
    for i in "${!bins[@]}"; do run "$i" "r$r"; done
done
[ "${NO_PROFILE:-0}" = 1 ] || { echo "== profile (eager + events) of bin 0: us per token by op"
"${bins[0]}" --backend cuda --ranks 1 --devices 0 --timeout 120 decode --model $m --profile \
    --prompt "Once upon a time, in a land far away" --temperature 0 --max-new-tokens 64 --ignore-eos --json \
    > "$out/profile.json" 2> "$out/profile.err" || fail profile
python3 - "$out/profile.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
p = j.get("profile", [])
tot = sum(e["us_per_token"] for e in p)
steps = max(j["decode_tokens"] - 1, 1)  # the steps the profile counts (decode.rs steps_profiled)
print(f"  total {tot:.1f} us/token profiled; {j['decode_tokens_per_s']:.1f} tok/s under the profiler")
for e in p[:14]:
    print(f"  {e['us_per_token']:8.1f} us/token {e['us_per_token'] / tot * 100:5.1f} %  {e['calls'] / steps:6.1f} calls/token  {e['op']}")
PY
}
python3 - "$out" "${#bins[@]}" <<'PY' || fail "tokens differ between binaries"
import json, os, sys
o, n = sys.argv[1], int(sys.argv[2])
runs = {i: f"{o}/ab-{i}-r1.json" for i in range(n)}
toks = {i: json.load(open(f))["token_ids"] for i, f in runs.items() if os.path.exists(f)}
same = len(toks) == n and all(t == toks[0] for t in toks.values())
print("same tokens in every binary:", same, "" if len(toks) == n else f"({n - len(toks)} run(s) missing)")
sys.exit(0 if same else 1)
PY
[ $status -eq 0 ] && echo "q4_ab.sh: PASS" || echo "q4_ab.sh: FAILED"
exit $status
