#!/usr/bin/env bash
# Qwen3.5 (gated DeltaNet hybrid) on the GPU machine (issue 11).
#
#   scripts/device/qwen35.sh check BIN [BACKEND]   the transformers-built tiny fixtures
#       (rank/tests/fixtures/qwen35-tiny*, written by scripts/ref_qwen35.py) through the
#       binary at --ranks 1 and --ranks 4 (MPS on one GPU), graph and eager: the greedy tokens
#       of reference.json exactly and every step's logits within 1e-4 of the largest logit
#       (1e-3 for the GPTQ twin). BACKEND defaults to cuda (cpu runs it here).
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
fail() { echo "FAILED: $*"; status=1; }
if [ "$backend" = cuda ]; then
    . "$root/scripts/device/common.sh"
    export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
    tprun_nvrtc_link
    tprun_devices 4
else
    devices=""
fi
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT

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
    for ranks in 1 4; do
        for graph in on off; do
            local tag="$name-r$ranks-g$graph" dev=()
            [ -n "$devices" ] && [ "$ranks" -eq 4 ] && dev=(--devices "$devices")
            [ -n "$devices" ] && [ "$ranks" -eq 1 ] && dev=(--devices 0)
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

case "$mode" in
    check)
        fixture qwen35-tiny 1e-4
        # TPRUN_QWEN35_GPTQ=0 skips the GPTQ int4 twin.
        if [ "${TPRUN_QWEN35_GPTQ:-1}" != 0 ]; then fixture qwen35-tiny-gptq 1e-3; fi
        ;;
    *) echo "usage: $0 check BIN [BACKEND]"; exit 2 ;;
esac
[ $status -eq 0 ] && echo "qwen35.sh $mode: PASS" || echo "qwen35.sh $mode: FAILED"
exit $status
