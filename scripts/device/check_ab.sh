#!/usr/bin/env bash
# A change to the decode step checked and timed in one call (~7 minutes):
#
#   scripts/device/check_ab.sh NEW BASE STORIES_DIR [MORE...]
#
# While synth qwen3_5 27b (GPTQ int4 MLP, group 128) and synth llama3-8b bf16 are written in the
# background: NEW's `tprun selftest` (every kernel against its CPU twin), `qwen35.sh check` (the
# transformers-built tiny Qwen3.5 and its GPTQ twin at 1, 2 and 4 ranks, graph and eager) and
# `decode.sh stories` (stories260k = reference.json at 1 and 4 ranks, logits against the CPU
# backend). Then the two decode benchmarks, NEW and BASE alternated, ROUNDS rounds (default 1):
# the 27B TP=1 (128 tokens) and Llama-3-8B TP=1 (256 after a 128-token prompt), graph + PDL,
# each with a check that both binaries give the same tokens; and the device copy bandwidth.
# MORE binaries (bin 2, 3, ...) join the Llama rounds (e.g. each of two changes alone beside NEW,
# which has both), with the same tokens check against NEW; with Q35_ALL=1 the 27B rounds too, and
# with L8B_MORE=0 not the Llama rounds (for a MORE binary that differs on the 27B's path only);
# L8B_BINS="0" (bin indices) times only those on Llama (a change that Llama-3-8B's bf16 path
# does not run: the call keeps room for the peer).
# PEER=1 adds, at the end, the torch.compile'd transformers loop on the same
# checkpoint (scripts/peer_hf_decode.py: issue 9's peer, ~2.5 minutes). BENCH=1 adds NEW's
# `bench gemv --quant int4` (issue 11's int4 GEMV against the copy rate) while the 27B synth
# finishes; BENCH=2 BASE's too, after it. PEER=1 BENCH=1 ROUNDS=1 covers both issues' speed
# targets in one call.
# STORIES_DIR travels in an ignored folder of the checkout (carry it). Results in $OUT.
# Time (H100, 2026-12-07): the checks ~3.5 minutes, the synths (in the background) 175 s for
# Llama and 297 s for the 27B, a decode run 30–45 s; two Llama runs and three 27B runs took 543
# s in all and left no room for the peer (~200 s): with PEER=1, time two binaries.
# BASE "-" times NEW alone, no MORE binaries then: a session's figures (PEER=1 BENCH=1 ROUNDS=1
# took 244 s on an H100 on 2026-12-07, the synths ~145 s each that time).
# LAB=1 runs the int4 GEMV lab (`LAB_QUICK=1 q4lab.sh`: the production kernels beside the lab's
# candidates, each checked and timed on this card) while the synths write, before the rounds.
# CHECKS=0 skips NEW's checks (selftest, qwen35.sh check, decode.sh stories): the figures of a
# tree already checked on a GPU, when the call is short.
# DEADLINE (epoch seconds): sections that no longer fit are skipped and say so. NO_LLAMA=1 skips
# the Llama-3-8B synth and rounds (and the peer), for a change that only the 27B can show;
# NO_Q35=1 the 27B synth and rounds (issue 9's figures and peer alone: ~6 minutes with CHECKS).
# TP4=1 adds, last, NEW at 4 ranks on the one GPU (MPS) on each model, with and without its
# allreduces: both issues' TP=4 tok/s and allreduce share (~3.5 minutes predicted).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
[ $# -ge 3 ] || { echo "usage: check_ab.sh NEW BASE STORIES_DIR [MORE...]"; exit 2; }
. "$root/scripts/device/common.sh"
if [ "$2" = - ]; then
    [ $# -eq 3 ] || { echo "check_ab.sh: BASE - takes no MORE binaries"; exit 2; }
    tprun_ab "$1"  # $bins, $out, the kernel cache, libnvrtc, status=0
else
    tprun_ab "$1" "$2" "${@:4}"
fi
stories="$(realpath "$3")"
q=/tmp/tprun-ab-q35-27b l=/tmp/tprun-ab-l8b
trap 'rm -rf "$q" "$l"' EXIT
t0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
q35=$([ "${NO_Q35:-0}" = 1 ] && echo 0 || echo 1)
if [ $q35 = 1 ]; then
    tprun_synth_27b "${bins[0]}" $q 2> "$out/synth-q.err" &
    sq=$!
fi
llama=$([ "${NO_LLAMA:-0}" = 1 ] && echo 0 || echo 1)
if [ $llama = 1 ]; then
    tprun_synth_l8b "${bins[0]}" $l 2> "$out/synth-l.err" &
    sl=$!
fi
if [ "${CHECKS:-1}" = 1 ]; then
    echo "== selftest (NEW)"
    timeout 300 "${bins[0]}" selftest > "$out/selftest.txt" 2>&1 || fail selftest
    grep -E "FAIL|check\(s\)|case\(s\)" "$out/selftest.txt" | tail -12
    if room 60 "qwen35.sh check"; then
        echo "== qwen35.sh check (NEW)"
        OUT="$out/q35" timeout 240 "$root/scripts/device/qwen35.sh" check "${bins[0]}" 2>&1 | tail -10
        [ "${PIPESTATUS[0]}" -eq 0 ] || fail "qwen35.sh check"
    fi
    if room 50 "decode.sh stories"; then
        echo "== decode.sh stories (NEW)"
        OUT="$out/stories" timeout 240 "$root/scripts/device/decode.sh" stories "${bins[0]}" "$stories" 2>&1 | grep -v "^ *$" | tail -14
        [ "${PIPESTATUS[0]}" -eq 0 ] || fail "decode.sh stories"
    fi
fi
# The int4 lab while the synths still write (the GPU is idle then when CHECKS=0).
if [ "${LAB:-0}" = 1 ] && room 300 "q4lab"; then
    echo "== q4lab (LAB_QUICK=1: production _k beside the lab's candidates, on this card)"
    OUT="$out/lab" LAB_QUICK=1 timeout 200 "$root/scripts/device/q4lab.sh" > "$out/lab.log" 2>&1 || fail q4lab
    grep -vE "^ *$" "$out/lab.log" | tail -45
fi
python3 "$root/scripts/device/copy_bw.py" | tee "$out/copy.txt" || fail "copy bandwidth"
tprun_prompt128 /tmp/prompt.txt
run() {  # run BIN_INDEX TAG MODEL DECODE_FLAGS...
    local i=$1 tag=$2 model=$3; shift 3
    "${bins[$i]}" --backend cuda --ranks 1 --devices 0 --timeout 120 decode --model "$model" "$@" \
        --temperature 0 --ignore-eos --json > "$out/$tag-$i.json" 2> "$out/$tag-$i.err" \
        || { fail "bin $i $tag"; tail -3 "$out/$tag-$i.err"; return; }
    tprun_decode_line "$out/$tag-$i.json" "$out/copy.txt" "$tag bin $i"
}
same() {  # same TAG BINS...: every binary's tokens are NEW's (runs that failed: said above)
    local tag=$1 i; shift
    [ -s "$out/$tag-0.json" ] || return 0
    for i in "$@"; do
        [ "$i" = 0 ] || [ ! -s "$out/$tag-$i.json" ] && continue
        python3 -c "import json,sys;a,b=(json.load(open(f'$out/$tag-{i}.json'))['token_ids'] for i in (0,$i));print('$tag: bin $i gives the same tokens as bin 0:',a==b);sys.exit(0 if a==b else 1)" \
            || fail "$tag tokens differ (bin $i)"
    done
}
echo "== decode TP=1, graph + PDL: Llama-3-8B (256 after 128), 27B GPTQ (128 tokens); bin 0 NEW, bin 1 BASE, bins 2.. MORE"
all=$(seq 0 $(( ${#bins[@]} - 1 )))
pair=$(seq 0 $(( ${#bins[@]} > 1 ? 1 : 0 )))  # NEW and BASE, or NEW alone
l8b_bins=${L8B_BINS:-$([ "${L8B_MORE:-1}" = 1 ] && echo $all || echo $pair)}
for i in $l8b_bins; do
    [ "$i" -lt ${#bins[@]} ] 2>/dev/null || { echo "check_ab.sh: L8B_BINS names bin $i of ${#bins[@]}"; exit 2; }
done
if [ $llama = 1 ]; then
    wait $sl || { fail "synth llama"; tail -3 "$out/synth-l.err"; }
    echo "llama synth done after $(( $(date +%s) - t0 )) s"
    for r in $(seq "${ROUNDS:-1}"); do
        room 40 "llama round $r" || break
        for i in $l8b_bins; do run $i "l8b-r$r" $l --prompt-file /tmp/prompt.txt --max-new-tokens 256; done
    done
    same l8b-r1 $l8b_bins
fi
bench_bins=$([ "${BENCH:-0}" = 2 ] && echo $pair || { [ "${BENCH:-0}" != 0 ] && echo 0; })
for i in $bench_bins; do  # NEW, then BASE's with BENCH=2 (leaving the 27B round its time)
    room $(( i == 0 ? 120 : 150 )) "bench gemv (bin $i)" || break
    echo "== bench gemv --quant int4 (bin $i)"
    timeout 150 "${bins[$i]}" --backend cuda --timeout 180 bench gemv --quant int4 > "$out/gemv-$i.txt" 2>&1 || fail "bench gemv (bin $i)"
    cat "$out/gemv-$i.txt"
done
if [ $q35 = 1 ]; then
    wait $sq || { fail "synth 27b"; tail -3 "$out/synth-q.err"; }
    echo "27b synth done after $(( $(date +%s) - t0 )) s"
    q35_bins=$([ "${Q35_ALL:-0}" = 1 ] && echo $all || echo $pair)
    for r in $(seq "${ROUNDS:-1}"); do
        room $(( 55 * $(echo $q35_bins | wc -w) )) "27b round $r" || break
        for i in $q35_bins; do run $i "q35-r$r" $q --prompt "Once upon a time, in a land far away" --max-new-tokens 128; done
    done
    same q35-r1 $q35_bins
fi
# The peer last, so that a short call keeps both of tprun's benchmarks.
if [ $llama = 1 ] && [ "${PEER:-0}" = 1 ] && room 200 peer; then
    echo "== peer: transformers static cache + torch.compile (same checkpoint as the Llama rounds, 256 after 128)"
    tprun_peer $l 240
fi
# TP4=1: NEW at 4 ranks on this one GPU (MPS), on both models, with and without its allreduces
# (the allreduces' share of a token), and whether its tokens are TP=1's (round 1, bin 0).
tp4() {  # tp4 TAG TP1_JSON MODEL DECODE_FLAGS...
    local tag=$1 tp1=$2 model=$3 ar env; shift 3
    room 100 "$tag" || return 0
    for ar in on off; do
        env=(); [ $ar = off ] && env=(TPRUN_BENCH_NO_ALLREDUCE=1)
        env "${env[@]}" "${bins[0]}" --backend cuda --ranks 4 --devices "$devices" --timeout 120 decode \
            --model "$model" "$@" --temperature 0 --ignore-eos --json > "$out/$tag-$ar.json" 2> "$out/$tag-$ar.err" \
            || { fail "$tag allreduces $ar"; tail -3 "$out/$tag-$ar.err"; return 0; }
        tprun_decode_line "$out/$tag-$ar.json" "$out/copy.txt" "$tag, allreduces $ar"
    done
    python3 - "$out/$tag-on.json" "$out/$tag-off.json" "$tp1" <<'PY'
import json, os, sys
on, off = (json.load(open(f)) for f in sys.argv[1:3])
d = on["token_latency_p50_ms"] - off["token_latency_p50_ms"]
print(f"  allreduces ({on['allreduces_per_step']} per token): {d:.3f} ms of a {on['token_latency_p50_ms']:.3f} ms token "
      f"(p50 against p50 without them) = {d / on['token_latency_p50_ms'] * 100:.1f} %")
if os.path.exists(sys.argv[3]):
    a, b = on["token_ids"], json.load(open(sys.argv[3]))["token_ids"]
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    print(f"  TP=4 tokens == TP=1 tokens (first {n}): {first is None}" + ("" if first is None else f" (first difference at step {first})"))
PY
}
if [ "${TP4:-0}" = 1 ]; then
    tprun_devices 4
    trap 'rm -rf "$q" "$l"; tprun_mps_stop' EXIT
    echo "== TP=4 on one GPU (NEW): with and without its allreduces"
    [ $llama = 1 ] && tp4 l8b-tp4 "$out/l8b-r1-0.json" $l --prompt-file /tmp/prompt.txt --max-new-tokens 256
    [ $q35 = 1 ] && tp4 q35-tp4 "$out/q35-r1-0.json" $q --prompt "Once upon a time, in a land far away" --max-new-tokens 128
fi
echo "check_ab.sh: $([ $status -eq 0 ] && echo PASS || echo FAILED) after $(( $(date +%s) - t0 )) s"
exit $status
