#!/usr/bin/env bash
# GPU decode on a GPU machine, in two parts that each fit one 10-minute device call:
#
#   scripts/device/decode.sh check BIN STORIES_DIR   correctness:
#       selftest (every kernel against its CPU twin, every allreduce); stories260k on CUDA at
#       --ranks 1 and --ranks 4 (MPS when one GPU): the greedy tokens of reference.json, logits
#       within 1e-4 relative of the CPU backend (--dump-logits on both); TP=4 = TP=1 tokens on
#       a synth qwen3; bad input (a KV cache that does not fit, a dtype the GPU path does not
#       take) fails with one line and leaves nothing on the GPU; SIGKILL of a rank mid-decode
#       exits 3 within 2 s naming it.
#   scripts/device/decode.sh all BIN STORIES_DIR      both, in one call (DEADLINE=epoch seconds
#                                                     skips what no longer fits)
#   scripts/device/decode.sh quick BIN STORIES_DIR    stories260k's checks and the TP=1 speed
#                                                     modes only
#   scripts/device/decode.sh stories|selftest|kill BIN [STORIES_DIR]   one section of check
#   scripts/device/decode.sh hf BIN                   synth llama3-8b against transformers alone
#                                                     (32 greedy steps, logits cosine)
#   scripts/device/decode.sh tp4 BIN                  TP=4 on one GPU alone (synth llama3-8b, one
#                                                     TP=1 run for its tokens): tok/s, the
#                                                     allreduces' cost per token
#   scripts/device/decode.sh perf BIN                 speed and the Hugging Face comparison:
#       synth llama3-8b bf16 (16 GB); transformers' greedy logits for 32 steps against
#       tprun's (scripts/hf_reference.py, scripts/compare_logits.py); tprun decode TP=1, 256
#       tokens after a 128-token prompt; beside it scripts/peer_hf_decode.py (torch.compile'd
#       static-cache loop) and the device copy bandwidth; TP=4 on one GPU.
#
# STORIES_DIR is the stories260k folder (../shared does not travel to the device: copy it into
# an ignored folder of the checkout and carry it). Results land in $OUT (or ./out).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mode="${1:?check or perf}"
bin="$(realpath "${2:?tprun binary}")"
out="${OUT:-$root/out}"
mkdir -p "$out"
. "$root/scripts/device/common.sh"
export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
tprun_nvrtc_link
status=0

# Max relative difference of two raw f32 logit dumps (same shape).
cmp_logits() {
    python3 - "$1" "$2" <<'PY'
import sys, numpy as np
a = np.fromfile(sys.argv[1], dtype="<f4"); b = np.fromfile(sys.argv[2], dtype="<f4")
n = min(a.size, b.size)
if n == 0 or a.size != b.size:
    print(f"sizes differ: {a.size} vs {b.size}"); sys.exit(1)
d = np.abs(a - b) / (1e-6 + np.abs(b).max())
print(f"{n} logits, max |gpu-cpu| / max|cpu| = {d.max():.2e}")
sys.exit(0 if d.max() <= 1e-4 else 1)
PY
}

stories="$(realpath "${3:-$root/.devdata/stories260k}" 2>/dev/null)"
m=/tmp/l8b

sec_selftest() {
    room 60 selftest || return 0
    echo "== selftest (2 ranks by default, sharing a lone GPU; kernels + allreduce)"
    timeout "${SELFTEST_S:-600}" $bin selftest > "$out/selftest.txt" 2>&1 || fail selftest
    grep -E "FAIL|failed|passed|checks" "$out/selftest.txt" | tail -25
}

sec_stories() {
    room 40 stories || return 0
    want=$(python3 -c "import json;r=json.load(open('$stories/reference.json'));print(','.join(map(str,r['generated_token_ids'])))")
    prompt=$(python3 -c "import json;r=json.load(open('$stories/reference.json'));print(r['prompt'])")
    n=$(python3 -c "print(len('$want'.split(',')))")
    echo "== stories260k: reference.json '$prompt' + $n tokens"
    common=(decode --model "$stories" --prompt "$prompt" --temperature 0 --max-new-tokens "$n" --ignore-eos --json)
    $bin --backend cpu --ranks 1 "${common[@]}" --dump-logits "$out/cpu1.f32" > "$out/cpu1.json" 2>"$out/cpu1.err" || fail "cpu decode"
    tprun_devices 4
    for r in 1 4; do
        d=$(echo "$devices" | cut -d, -f1-$r)
        echo "-- cuda ranks $r (devices $d)"
        $bin --backend cuda --ranks $r --devices "$d" "${common[@]}" > "$out/cuda$r.json" 2>"$out/cuda$r.err" || { fail "cuda$r decode"; tail -5 "$out/cuda$r.err"; }
        $bin --backend cuda --ranks $r --devices "$d" "${common[@]}" --dump-logits "$out/cuda$r.f32" > "$out/cuda$r-dump.json" 2>>"$out/cuda$r.err" || fail "cuda$r dump"
        python3 - "$out/cuda$r.json" "$want" <<'PY' || fail "cuda$r tokens"
import json, sys
j = json.load(open(sys.argv[1])); want = [int(x) for x in sys.argv[2].split(",")]
got = j["token_ids"]
print(f"tokens equal to reference.json: {got == want} ({len(got)} tokens); "
      f"{j['decode_tokens_per_s']:.0f} tok/s, graph {j.get('graph')}, {j.get('allreduces_per_step')} allreduces/step")
sys.exit(0 if got == want else 1)
PY
        cmp_logits "$out/cuda$r.f32" "$out/cpu1.f32" || fail "cuda$r logits vs cpu"
        echo "-- cuda ranks $r, the step replayed as one CUDA graph"
        TPRUN_LOG=tprun_rank=debug $bin --backend cuda --ranks $r --devices "$d" --timeout 30 "${common[@]}" --graph on > "$out/cuda$r-graph.json" 2>"$out/cuda$r-graph.err" || { fail "cuda$r graph decode"; tail -12 "$out/cuda$r-graph.err"; continue; }
        grep -m3 "captured\|steps done\|graph destroyed" "$out/cuda$r-graph.err"
        python3 -c "import json;a=json.load(open('$out/cuda$r.json'))['token_ids'];b=json.load(open('$out/cuda$r-graph.json'));print('graph tokens == eager tokens:',a==b['token_ids'],'graph',b['graph'],f\"{b['decode_tokens_per_s']:.0f} tok/s\");exit(0 if a==b['token_ids'] else 1)" || fail "cuda$r graph tokens"
    done
}

sec_q3() {
    room 30 qwen3 || return 0
    echo "== synth qwen3 tiny bf16: TP=4 tokens = TP=1 tokens"
    $bin synth --arch qwen3 --preset tiny --dtype bf16 --out /tmp/q3 > /dev/null 2>&1
    tprun_devices 4
    for r in 1 4; do
        d=$(echo "$devices" | cut -d, -f1-$r)
        $bin --backend cuda --ranks $r --devices "$d" decode --model /tmp/q3 --temperature 0 --max-new-tokens 48 --ignore-eos --json > "$out/q3-$r.json" 2>"$out/q3-$r.err" || { fail "qwen3 ranks $r"; tail -3 "$out/q3-$r.err"; }
    done
    python3 -c "import json;a=json.load(open('$out/q3-1.json'))['token_ids'];b=json.load(open('$out/q3-4.json'))['token_ids'];print('qwen3 TP4 == TP1:',a==b, a[:12]);exit(0 if a==b else 1)" || fail "qwen3 tp4 != tp1"
}

sec_bad() {
    room 20 "bad input" || return 0
    echo "== bad input"
    $bin --backend cuda --ranks 1 decode --model "$stories" --max-seq 2000000000 > /dev/null 2>"$out/bad1.err"; rc=$?
    echo "max-seq 2e9: exit $rc: $(grep -m1 '^error' "$out/bad1.err")"; { [ $rc -ne 0 ] && [ $rc -ne 101 ]; } || fail "huge max-seq"
    $bin --backend cuda --ranks 1 decode --model "$stories" --kv-dtype u32 > /dev/null 2>"$out/bad2.err"; rc=$?
    echo "kv-dtype u32: exit $rc: $(grep -m1 '^error' "$out/bad2.err")"; [ $rc -eq 2 ] || fail "kv dtype"
    sleep 1; echo "tprun processes on the GPU after bad input: $(tprun_gpu_apps)"; [ "$(tprun_gpu_apps)" -eq 0 ] || fail "left on GPU"
}

sec_kill() {
    room 25 sigkill || return 0
    [ -d /tmp/q3 ] || $bin synth --arch qwen3 --preset tiny --dtype bf16 --out /tmp/q3 > /dev/null 2>&1
    tprun_devices 4
    echo "== SIGKILL rank 2 mid-decode (4 ranks)"
    log=$(mktemp)
    TPRUN_LOG=${KILL_LOG:-warn} $bin --backend cuda --ranks 4 --devices "$devices" decode --model /tmp/q3 --max-new-tokens 100000000 --max-seq 2000000 --ignore-eos > /dev/null 2>"$log" &
    coord=$!
    sleep 8
    pid=$(pgrep -P "$coord" -f -- "--rank 2( |$)" | head -1)
    ranks=$(pgrep -P "$coord" | tr '\n' ' ')
    t0=$(date +%s%N); kill -9 "$pid"
    # Where the time goes: every 50 ms, each rank's state (R/S/D/Z or gone) and whether the
    # coordinator has printed its error yet.
    ( while kill -0 "$coord" 2>/dev/null; do
        st=""; for r in $ranks; do st="$st $(awk '{print $3}' /proc/$r/stat 2>/dev/null || echo -)"; done
        echo "$(( ($(date +%s%N) - t0) / 1000000 )) ms: ranks$st, error printed: $(grep -c '^error' "$log"), log lines: $(wc -l < "$log")"
        sleep 0.05
      done ) > "$out/kill-timeline.txt" 2>&1 &
    wait "$coord"; rc=$?; t1=$(date +%s%N)
    ms=$(( (t1 - t0) / 1000000 )); sleep 1
    awk 'NR % 4 == 1' "$out/kill-timeline.txt" | head -40
    echo "exit $rc after $ms ms: $(grep -m1 '^error' "$log"); on the GPU after: $(tprun_gpu_apps)"
    cp "$log" "$out/kill.log"
    { [ $rc -eq 3 ] && [ $ms -le 2000 ] && [ "$(tprun_gpu_apps)" -eq 0 ]; } || { fail "sigkill"; tail -5 "$log"; }
    tprun_mps_restart
}

sec_synth() {
    echo "== synth llama3-8b bf16"
    t0=$(date +%s); tprun_synth_l8b $bin $m 2> /dev/null || fail synth
    echo "synth took $(( $(date +%s) - t0 )) s; $(du -sh $m | cut -f1)"
    # A 128-token prompt (byte-level tokenizer).
    tprun_prompt128 /tmp/prompt.txt
}

sec_tp1() {
    room 60 tp1 || return 0
    echo "== tprun decode TP=1: 256 tokens after a 128-token prompt"
    for i in eager nopdl default profile; do
        flags=(); pdl=1
        case $i in eager) flags=(--graph off) ;; nopdl) pdl=0 ;; profile) flags=(--profile) ;; esac
        TPRUN_CUDA_PDL=$pdl $bin --backend cuda --ranks 1 --timeout 30 decode "${flags[@]}" --model $m --prompt-file /tmp/prompt.txt --temperature 0 --max-new-tokens 256 --ignore-eos --json > "$out/l8b-tp1-$i.json" 2>"$out/l8b-tp1.err" || { fail "tp1 $i"; tail -5 "$out/l8b-tp1.err"; continue; }
        python3 -c "import json;j=json.load(open('$out/l8b-tp1-$i.json'));print(f\"tprun TP=1 ($i): {j['decode_tokens_per_s']:.1f} tok/s, p50 {j['token_latency_p50_ms']:.3f} ms, {j['weight_gb_per_s']:.0f} GB/s of weights, graph {j['graph']}, {j['kernel_launches_per_token']} launches/token, prompt {j['prefill_tokens']} in {j['prefill_s']*1e3:.0f} ms, load {j['load_s']:.1f} s {j['load_gb_per_s']:.1f} GB/s, device {j['device_bytes_per_rank']/1e9:.1f} GB\")"
    done
    python3 - "$out" <<'PY' || fail "tp1 tokens differ between modes"
import json, sys
o = sys.argv[1]
runs = {i: json.load(open(f"{o}/l8b-tp1-{i}.json")) for i in ("eager", "nopdl", "default", "profile")}
for i, j in runs.items():
    print(f"{i}: tokens == default's: {j['token_ids'] == runs['default']['token_ids']}")
p = runs["profile"].get("profile", [])
tot = sum(e["us_per_token"] for e in p)
print(f"profile: {tot:.0f} us of device time per token")
for e in p[:16]:
    print(f"  {e['us_per_token']:8.1f} us/token  {e['calls'] / 255:5.1f} calls/token  {e['op']}")
sys.exit(0 if all(j["token_ids"] == runs["default"]["token_ids"] for j in runs.values()) else 1)
PY
}

sec_copy() {
    echo "== device copy bandwidth"
    python3 "$root/scripts/device/copy_bw.py" | tee "$out/copy.txt" || fail "copy bandwidth"
}

sec_peer() {
    room 150 peer || return 0
    echo "== peer: transformers static cache + torch.compile"
    tprun_peer $m 600
}

sec_hf() {
    room 120 "hf compare" || return 0
    echo "== tprun TP=1 dump 32 greedy steps; transformers f32 reference (bf16 weights upcast); comparison"
    $bin --backend cuda --ranks 1 decode --model $m --prompt-file /tmp/prompt.txt --temperature 0 --max-new-tokens 32 --ignore-eos --json --dump-logits /tmp/l8b.f32 > "$out/l8b-dump.json" 2>"$out/l8b-dump.err" || { fail dump; tail -5 "$out/l8b-dump.err"; }
    python3 -c "import json;j=json.load(open('$out/l8b-dump.json'));open('/tmp/prompt_ids','w').write(','.join(map(str,j['prompt_ids'])))"
    local left=300; [ -z "${DEADLINE:-}" ] || left=$(( DEADLINE - $(date +%s) - 10 ))
    PYTHONUNBUFFERED=1 timeout $left python3 "$root/scripts/hf_reference.py" --model $m --prompt-ids-file /tmp/prompt_ids --steps 32 --dtype f32 --out /tmp/hf.npz > "$out/hf_ref.txt" 2>&1 || { fail hf_reference; tail -5 "$out/hf_ref.txt"; return 0; }
    python3 "$root/scripts/compare_logits.py" --tprun-logits /tmp/l8b.f32 --vocab 128256 --tprun-json "$out/l8b-dump.json" --hf /tmp/hf.npz --steps 32 > "$out/compare.txt" 2>&1 || fail compare
    tail -6 "$out/compare.txt"
}

sec_tp4() {
    room 60 tp4 || return 0
    tprun_devices 4
    echo "== tprun TP=4 on one GPU (MPS)"
    $bin --backend cuda --ranks 4 --devices "$devices" --timeout 120 decode --model $m --prompt-file /tmp/prompt.txt --temperature 0 --max-new-tokens 128 --ignore-eos --json > "$out/l8b-tp4.json" 2>"$out/l8b-tp4.err" || { fail "tp4"; tail -5 "$out/l8b-tp4.err"; return 0; }
    python3 -c "import json;j=json.load(open('$out/l8b-tp4.json'));print(f\"tprun TP=4 (one GPU, MPS): {j['decode_tokens_per_s']:.1f} tok/s, p50 {j['token_latency_p50_ms']:.3f} ms, graph {j['graph']}, {j['allreduces_per_step']} allreduces/step\")"
    python3 -c "import json,sys;a=json.load(open('$out/l8b-tp4.json'))['token_ids'];b=json.load(open('$out/l8b-tp1-default.json'))['token_ids'][:len(a)];print('TP=4 tokens == TP=1 tokens (first', len(a), '):', a==b);sys.exit(0 if a==b else 1)" || fail "tp4 tokens != tp1"
    TPRUN_BENCH_NO_ALLREDUCE=1 $bin --backend cuda --ranks 4 --devices "$devices" --timeout 120 decode --model $m --prompt-file /tmp/prompt.txt --temperature 0 --max-new-tokens 128 --ignore-eos --json > "$out/l8b-tp4-noar.json" 2>>"$out/l8b-tp4.err" || { fail "tp4 no-ar"; return 0; }
    python3 -c "import json;a=json.load(open('$out/l8b-tp4.json'));b=json.load(open('$out/l8b-tp4-noar.json'));print(f\"TP=4 without allreduces (timing only): {b['decode_tokens_per_s']:.1f} tok/s, p50 {b['token_latency_p50_ms']:.3f} ms: allreduces cost {a['token_latency_p50_ms']-b['token_latency_p50_ms']:.3f} ms per token\")"
}

case "$mode" in
    check) sec_selftest; sec_stories; sec_q3; sec_bad; sec_kill ;;
    kill) sec_kill ;;
    stories) sec_stories ;;
    selftest) sec_selftest ;;
    quick)
        # Correctness on stories260k and the TP=1 speed modes only (a quick look at a change).
        sec_synth > "$out/synth.log" 2>&1 &
        synth=$!
        sec_stories
        wait $synth; cat "$out/synth.log"
        sec_tp1 ;;
    perf) sec_synth; sec_tp1; sec_copy; sec_peer; sec_hf; sec_tp4 ;;
    hf) sec_synth; sec_hf ;;  # synth llama3-8b against transformers alone
    tp4)
        # TP=4 on one GPU alone (42 s on a warm H100, 2026-12-07): one TP=1 run of sec_tp4's
        # 128 tokens, for its tokens, then sec_tp4.
        sec_synth
        if room 90 "tp1 + tp4"; then
            if $bin --backend cuda --ranks 1 --timeout 30 decode --model $m --prompt-file /tmp/prompt.txt --temperature 0 --max-new-tokens 128 --ignore-eos --json > "$out/l8b-tp1-default.json" 2>"$out/l8b-tp1.err"; then
                python3 -c "import json;j=json.load(open('$out/l8b-tp1-default.json'));print(f\"tprun TP=1: {j['decode_tokens_per_s']:.1f} tok/s, p50 {j['token_latency_p50_ms']:.3f} ms\")"
                sec_tp4
            else
                fail "tp1"; tail -5 "$out/l8b-tp1.err"
            fi
        fi ;;
    all)
        # The 16 GB synth writes on the CPUs while the small correctness runs use the GPU.
        sec_synth > "$out/synth.log" 2>&1 &
        synth=$!
        sec_stories
        wait $synth; cat "$out/synth.log"
        sec_tp1; sec_copy; sec_hf; sec_peer; sec_tp4; sec_q3; sec_bad; sec_kill; sec_selftest ;;
    *) echo "usage: decode.sh check|perf|all|quick|tp4|hf|kill|stories|selftest BIN [STORIES_DIR]"; exit 2 ;;
esac
echo "decode.sh $mode: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
