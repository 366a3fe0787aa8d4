#!/usr/bin/env bash
# A/B of decode speed between tprun binaries built from variants of one change, in one call:
#
#   scripts/device/decode_ab.sh [--selftest] [--profile] BIN...
#
# Writes synth llama3-8b bf16 (16 GB) once, then runs `decode` TP=1 (graph + PDL, 256 tokens
# after a 128-token prompt, as decode.sh perf) with each binary in turn, ROUNDS rounds
# (default 2) so that drift shows; prints one line per run and checks that every binary gives
# the same tokens. --selftest runs `tprun selftest` with the first binary first; --profile adds
# one profiled run (eager + events) of each binary. Results in $OUT (or ./out).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
selftest=0; profile=0
while [ $# -gt 0 ]; do
    case "$1" in --selftest) selftest=1 ;; --profile) profile=1 ;; *) break ;; esac
    shift
done
[ $# -ge 1 ] || { echo "usage: decode_ab.sh [--selftest] [--profile] BIN..."; exit 2; }
. "$root/scripts/device/common.sh"
tprun_ab "$@"
m=/tmp/l8b
tprun_synth_l8b "${bins[0]}" $m 2> /dev/null &
synth=$!
if [ $selftest = 1 ]; then
    echo "== selftest (${bins[0]})"
    timeout 400 "${bins[0]}" selftest > "$out/selftest.txt" 2>&1 || { echo "FAILED: selftest"; status=1; }
    grep -E "FAIL|checks|case" "$out/selftest.txt" | tail -12
fi
wait $synth || { echo "FAILED: synth"; exit 1; }
tprun_prompt128 /tmp/prompt.txt
run() {  # run BIN_INDEX TAG [FLAGS...]
    local i=$1 tag=$2; shift 2
    "${bins[$i]}" --backend cuda --ranks 1 --timeout 30 decode "$@" --model $m --prompt-file /tmp/prompt.txt --temperature 0 --max-new-tokens 256 --ignore-eos --json > "$out/ab-$i-$tag.json" 2> "$out/ab-$i-$tag.err" || { echo "FAILED: bin $i $tag"; tail -3 "$out/ab-$i-$tag.err"; status=1; return; }
    python3 -c "import json;j=json.load(open('$out/ab-$i-$tag.json'));print(f\"bin $i ($tag): {j['decode_tokens_per_s']:.1f} tok/s, p50 {j['token_latency_p50_ms']:.3f} ms, {j['kernel_launches_per_token']} launches/token\")"
}
echo "== decode TP=1, graph + PDL; bins: ${bins[*]}"
for r in $(seq "${ROUNDS:-2}"); do
    for i in "${!bins[@]}"; do run "$i" "r$r"; done
done
python3 - "$out" "${#bins[@]}" <<'PY' || { echo "FAILED: tokens differ between binaries"; status=1; }
import json, sys, glob
o, n = sys.argv[1], int(sys.argv[2])
toks = {i: json.load(open(f"{o}/ab-{i}-r1.json"))["token_ids"] for i in range(n)}
same = all(t == toks[0] for t in toks.values())
print("same tokens in every binary:", same)
sys.exit(0 if same else 1)
PY
if [ $profile = 1 ]; then
    for i in "${!bins[@]}"; do
        run "$i" profile --profile
        python3 -c "
import json; p = json.load(open('$out/ab-$i-profile.json')).get('profile', [])
for e in p[:8]: print(f\"  {e['us_per_token']:8.1f} us/token  {e['calls'] / 255:5.1f} calls/token  {e['op']}\")"
    done
fi
[ $selftest = 1 ] && { echo "== selftest summary"; grep -E "FAIL|check\(s\)|case\(s\)" "$out/selftest.txt" | tail -8; }
echo "decode_ab.sh: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
