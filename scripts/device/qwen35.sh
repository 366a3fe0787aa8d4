#!/usr/bin/env bash
# Qwen3.5 (gated DeltaNet hybrid) on the GPU machine (issue 11).
#
#   scripts/device/qwen35.sh check BIN [BACKEND]   the transformers-built tiny fixtures
#       (rank/tests/fixtures/qwen35-tiny*, written by scripts/ref_qwen35.py) through the
#       binary at --ranks 1, 2 and 4 (MPS on one GPU), graph and eager: the greedy tokens
#       of reference.json exactly and every step's logits within 1e-4 of the largest logit
#       (1e-3 for the GPTQ twin; TPRUN_QWEN35_GPTQ=0 skips it). BACKEND defaults to cuda (cpu
#       runs it here).
#   scripts/device/qwen35.sh perf BIN              speed: synth qwen3_5 27b with its MLP in
#       GPTQ int4 (the official layout, group 128), TP=1, batch 1, 128 new tokens after a
#       short prompt: tok/s and the weight bandwidth against the device copy bandwidth of the
#       same call; then TP=4 on one GPU (MPS) with and without its allreduces.
#   scripts/device/qwen35.sh all BIN               check, then perf (DEADLINE=epoch seconds
#       skips what no longer fits)
#
# The fixtures have no tokenizer: a word-level one ("t0" .. "t255", one word per id) is
# written beside a copy, so the prompt ids go in as text and nothing is lost in between.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mode="${1:?check}"
bin="$(realpath "${2:?tprun binary}")"
backend="${3:-cuda}"
out="${OUT:-$root/out}"
mkdir -p "$out"
status=0
. "$root/scripts/device/common.sh"  # fail, room, tprun_synth_27b; the GPU helpers below
work="$(mktemp -d)"
if [ "$backend" = cuda ]; then
    export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
    tprun_nvrtc_link
    tprun_devices 4
    # tprun_devices' EXIT trap stops the MPS daemon it started; remove the scratch too.
    trap 'rm -rf "$work"; tprun_mps_stop' EXIT
else
    devices=""
    trap 'rm -rf "$work"' EXIT
fi

fixture() {  # NAME TOLERANCE
    local name=$1 tol=$2 dir="$work/$1"
    cp -r "$root/rank/tests/fixtures/$name" "$dir"
    python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
vocab = cfg.get("text_config", cfg)["vocab_size"]
tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
       "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
       "post_processor": None, "decoder": None,
       "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"}}
json.dump(tok, open(f"{d}/tokenizer.json", "w"))
ref = json.load(open(f"{d}/reference.json"))
open(f"{d}/prompt.txt", "w").write(" ".join(f"t{i}" for i in ref["prompt"]))
PY
    local steps; steps=$(python3 -c "import json;print(len(json.load(open('$dir/reference.json'))['tokens']))")
    for ranks in 1 2 4; do
        for graph in on off; do
            local tag="$name-r$ranks-g$graph" dev=()
            [ -n "$devices" ] && dev=(--devices "$(echo "$devices" | cut -d, -f1-"$ranks")")
            "$bin" --backend "$backend" --ranks "$ranks" "${dev[@]}" --timeout 60 decode --model "$dir" \
                --prompt-file "$dir/prompt.txt" --temperature 0 --max-new-tokens "$steps" --ignore-eos \
                --graph "$graph" --kv-dtype f32 --json --dump-logits "$work/$tag.f32" > "$work/$tag.json" 2> "$work/$tag.err" \
                || { fail "$tag: exit $?"; tail -3 "$work/$tag.err"; continue; }
            python3 - "$dir/reference.json" "$work/$tag.json" "$work/$tag.f32" "$tol" "$tag" <<'PY' || fail "$tag"
import array, json, sys
ref = json.load(open(sys.argv[1])); got = json.load(open(sys.argv[2]))
tol, tag = float(sys.argv[4]), sys.argv[5]
want = ref["logits"]
have = array.array("f"); have.frombytes(open(sys.argv[3], "rb").read())
v = len(want[0])
err = max(max(abs(have[s * v + i] - w[i]) for i in range(v)) / max(abs(x) for x in w)
          for s, w in enumerate(want)) if len(have) >= len(want) * v else float("inf")
same = got["token_ids"] == ref["tokens"]
print(f"{tag}: tokens equal to reference.json: {same} ({len(ref['tokens'])}); logits max |d| / max|ref| = {err:.2e} (tol {tol})")
sys.exit(0 if same and err <= tol else 1)
PY
        done
    done
}

# Q35_27B: where the 27b synth goes; perf reuses one already there (issue11.sh writes it ahead).
m27="${Q35_27B:-/tmp/tprun-q35-27b}"
synth27() {
    echo "== synth qwen3_5 27b, MLP GPTQ int4 (group 128), the rest bf16"
    local t0; t0=$(date +%s)
    tprun_synth_27b "$bin" "$m27" 2> "$work/synth.err" \
        || { echo "FAILED: synth"; tail -3 "$work/synth.err"; return 1; }
    echo "synth took $(( $(date +%s) - t0 )) s; $(du -sh "$m27" | cut -f1)"
}

perf() {
    local m=$m27
    [ -d "$m" ] || { room 200 "27b synth and decode" && synth27 || { fail synth; return 0; }; }
    python3 "$root/scripts/device/copy_bw.py" | tee "$out/copy.txt" || fail "copy bandwidth"
    for ranks in 1 4; do
        room 60 "27b TP=$ranks" || return 0
        local dev=(--devices 0) tag="q35-27b-tp$ranks"
        [ "$ranks" -eq 4 ] && dev=(--devices "$devices")
        for ar in on off; do
            [ "$ranks" -eq 1 ] && [ "$ar" = off ] && continue
            local env=(); [ "$ar" = off ] && env=(TPRUN_BENCH_NO_ALLREDUCE=1)
            env "${env[@]}" "$bin" --backend cuda --ranks "$ranks" "${dev[@]}" --timeout 120 decode --model "$m" \
                --prompt "Once upon a time, in a land far away" --temperature 0 --max-new-tokens 128 --ignore-eos --json \
                > "$work/$tag-$ar.json" 2> "$work/$tag.err" || { fail "$tag $ar"; tail -3 "$work/$tag.err"; continue; }
            python3 - "$work/$tag-$ar.json" "$out/copy.txt" "$tag" "$ar" <<'PY'
import json, re, sys
j = json.load(open(sys.argv[1]))
copy = float(re.search(r"([0-9.]+) TB/s", open(sys.argv[2]).read()).group(1))
gbs = j["weight_gb_per_s"]
note = "" if sys.argv[4] == "on" else " (allreduces off: timing only)"
print(f"{sys.argv[3]}{note}: {j['decode_tokens_per_s']:.1f} tok/s, p50 {j['token_latency_p50_ms']:.3f} ms, "
      f"{j['step_weight_bytes_rank0'] / 1e9:.1f} GB read/token (rank 0), {gbs:.0f} GB/s of weights = "
      f"{gbs / (copy * 1e3) * 100:.0f} % of the copy rate, graph {j['graph']}, {j['kernel_launches_per_token']} launches/token, "
      f"load {j['load_s']:.1f} s, device {j['device_bytes_per_rank'] / 1e9:.1f} GB/rank")
PY
        done
    done
    rm -rf "$m"
}

case "$mode" in
    check)
        fixture qwen35-tiny 1e-4
        # TPRUN_QWEN35_GPTQ=0 skips the GPTQ int4 twin.
        if [ "${TPRUN_QWEN35_GPTQ:-1}" != 0 ]; then fixture qwen35-tiny-gptq 1e-3; fi
        ;;
    perf) perf ;;
    all)
        # The 27b synth writes on the CPUs while the fixtures use the GPU.
        synth27 > "$work/synth.log" 2>&1 &
        synth=$!
        fixture qwen35-tiny 1e-4
        if [ "${TPRUN_QWEN35_GPTQ:-1}" != 0 ]; then fixture qwen35-tiny-gptq 1e-3; fi
        wait $synth || fail synth; cat "$work/synth.log"
        perf
        ;;
    *) echo "usage: $0 check|perf|all BIN [BACKEND]"; exit 2 ;;
esac
[ $status -eq 0 ] && echo "qwen35.sh $mode: PASS" || echo "qwen35.sh $mode: FAILED"
exit $status
