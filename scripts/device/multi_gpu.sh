#!/usr/bin/env bash
# tprun across real GPUs, one command on a machine with several GPUs (issue 14):
#
#   allreduce  tprun info (P2P/IPC matrix); tprun selftest; tprun bench allreduce --check for
#              every algorithm, bf16 and f32, 8 B - 256 MiB, --ipc fd and --ipc legacy; then
#              scripts/peer_nccl_allreduce.py (NCCL, CUDA-graph replay) over the same sizes; then
#              the ratio tprun/NCCL per size (ratio.txt).
#   copy       the device copy bandwidth (torch, 1 GiB, read + write) of every GPU the ranks use.
#   decode     synth llama3-8b and qwen3-32b (bf16), each at TP=1, 2 and 4, batch 1, greedy
#              (--temperature 0 --ignore-eos), 256 new tokens after a 128-token prompt: tok/s,
#              p50 ms/token, the allreduces' ms/token (p50 with them minus p50 of the same run
#              with TPRUN_BENCH_NO_ALLREDUCE=1, whose tokens are wrong: timing only), the weight
#              bytes read per token summed over the ranks (step_weight_bytes_rank0 x TP) and that
#              over the p50 token time, against G x the copy bandwidth (G = distinct GPUs the
#              ranks run on: 1 when they share GPU 0); the greedy tokens of every TP must equal
#              TP=1's (else FAILED). A shard that does not fit one GPU is reported and skipped.
#   q35        synth Qwen3.5 27B with its MLP in GPTQ int4 (as scripts/device/qwen35.sh), TP=1
#              and TP=4, 128 new tokens after the same prompt: the same figures.
# Everything lands in $OUT (default /tmp/tprun-multi-gpu): multi_gpu.log (all that is printed),
# info.txt, selftest.txt, tprun-fd.txt, tprun-legacy.txt, nccl-bf16.txt, nccl-f32.txt, ratio.txt,
# copy.txt, synth-MODEL.log, dec-MODEL-tpN[-noar].json/.err (each decode run), decode_runs.tsv
# and the decode summary, one row per model and TP, decode_table.txt (printed last).
#
#   scripts/device/multi_gpu.sh [TPRUN_BINARY] [RANKS] [SIZES]   (defaults: target/release/tprun,
#                                                                 4, 8:256M)
#
# With fewer GPUs than ranks (a one-GPU machine, for testing this script), the tprun ranks share
# GPU 0 under MPS (devices 0,0 / 0,0,0,0) and NCCL runs on the GPUs there are (NCCL refuses two
# ranks on one GPU). NVLink multicast stays off (NCCL_NVLS_ENABLE=0); tprun never calls
# cuMulticastCreate. The synths (single-threaded, 16 / 66 / 28 GB) start in the background at
# the beginning and write while the allreduce sections run; each model is deleted once its
# decode runs are done. When they do not all fit the free disk at once, they are written one
# after another, each waiting for the space the previous model's deletion frees.
#
# Environment (all optional):
#   SECTIONS="info selftest allreduce nccl copy decode q35"   which sections run (default: all)
#   DEADLINE=EPOCH_SECONDS   a section that no longer fits before it is skipped with a message
#                            ("SKIPPED (time): ..."); every command's timeout ends before it
#   SIZES=8:256M  ALGOS=all  DTYPES=bf16,f32  IPCS="fd legacy"   the allreduce tables
#   MODELS="llama3-8b qwen3-32b"  TPS="1 2 4"  NEW_TOKENS=256   the decode section
#   Q35_TPS="1 4"  Q35_NEW_TOKENS=128                            the q35 section
#   PROMPT_LEN=128 (tokens, BOS included)  MAX_SEQ=1024 (KV cache)  NOAR=0 (no runs without
#   allreduces)  QUICK=1 (defaults MODELS=llama3-8b and Q35_TPS=4: skips the 32B and the 27B
#   at TP=1)  MODELS_DIR=/tmp/tprun-mg-models  KEEP_MODELS=1 (keep and reuse the synth folders)
#   DECODE_S=300   the longest one decode run may take
#   BACKEND=cpu PRESET=tiny   the whole control flow on the CPU backend with tiny presets (no
#                             GPU, NCCL, nvidia-smi or torch needed; copy = host memcpy)
#
# One GPU within one 10-minute call (186 s on an H100, 2026-12-05; carry the binary; qwen3-32b
# needs 68 GB of disk, more than a one-GPU machine's 64 GiB, so QUICK leaves it out):
#   DEADLINE=$(( $(date +%s) + 570 )) QUICK=1 SIZES=8:64M scripts/device/multi_gpu.sh .devbin/tprun-NEW 4
# On the CPU, here:
#   BACKEND=cpu PRESET=tiny SIZES=8:64K NEW_TOKENS=32 Q35_NEW_TOKENS=16 OUT=/tmp/mg-cpu \
#       scripts/device/multi_gpu.sh target/release/tprun 4
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:-$root/target/release/tprun}")"
ranks="${2:-4}"
sizes="${3:-${SIZES:-8:256M}}"
OUT="${OUT:-/tmp/tprun-multi-gpu}"
mkdir -p "$OUT"
# Results of an earlier run in the same folder would be reported as this run's.
rm -f "$OUT"/selftest.txt "$OUT"/tprun-*.txt "$OUT"/nccl-*.txt "$OUT"/ratio.txt "$OUT"/copy.txt \
    "$OUT"/dec-*.json "$OUT"/dec-*.err "$OUT"/decode_runs.tsv "$OUT"/decode_table.txt
# Everything printed also goes to $OUT/multi_gpu.log.
exec > >(tee "$OUT/multi_gpu.log") 2>&1
backend="${BACKEND:-cuda}"
sections=" ${SECTIONS:-info selftest allreduce nccl copy decode q35} "
algos="${ALGOS:-all}"
dtypes="${DTYPES:-bf16,f32}"
ipcs="${IPCS:-fd legacy}"
if [ "${QUICK:-0}" = 1 ]; then
    models="${MODELS:-llama3-8b}"
    q35_tps="${Q35_TPS:-4}"
else
    models="${MODELS:-llama3-8b qwen3-32b}"
    q35_tps="${Q35_TPS:-1 4}"
fi
# TP = 1, 2, 4, ... up to RANKS (and RANKS itself).
default_tps() { local n=1 s=""; while [ $n -lt "$ranks" ]; do s="$s $n"; n=$((n * 2)); done; echo "$s $ranks"; }
tps="${TPS:-$(default_tps)}"
new_tokens="${NEW_TOKENS:-256}"
q35_new_tokens="${Q35_NEW_TOKENS:-128}"
prompt_len="${PROMPT_LEN:-128}"
max_seq="${MAX_SEQ:-1024}"
models_dir="${MODELS_DIR:-/tmp/tprun-mg-models}"
q35=qwen3.5-27b-gptq
mkdir -p "$models_dir"
status=0
. "$root/scripts/device/common.sh"  # fail, room; the GPU helpers below
want() { [[ "$sections" == *" $1 "* ]]; }
# A command's timeout: SECS, cut to end 15 s before DEADLINE.
cap() {
    local s=$1
    [ -z "${DEADLINE:-}" ] || { local left=$(( DEADLINE - $(date +%s) - 15 )); [ "$left" -ge "$s" ] || s=$left; }
    [ "$s" -ge 1 ] || s=1
    echo "$s"
}

if [ "$backend" = cuda ]; then
    tprun_job "$bin" "$ranks" 60
else
    # The CPU backend: every rank is a host process; the device list is only a label.
    export NCCL_NVLS_ENABLE=0
    t="$bin --ranks $ranks --backend $backend --timeout 60"
    devices=$(seq -s, 0 $((ranks - 1)))
    ngpu=0
fi
# NCCL refuses two ranks on one GPU: it runs on the GPUs there are.
nccl_ranks=$(( ngpu < ranks ? ngpu : ranks ))

# Background synths: their PIDs, killed at exit; the folders go too unless KEEP_MODELS=1.
synth_pids=() to_synth=()
# shellcheck disable=SC2329 # invoked by the EXIT trap
cleanup() {
    local p
    for p in "${synth_pids[@]}"; do kill "$p" 2>/dev/null; done
    for p in "$models_dir"/*.pid; do [ -f "$p" ] && kill "$(cat "$p")" 2>/dev/null; done
    [ ${#synth_pids[@]} -eq 0 ] || wait "${synth_pids[@]}" 2>/dev/null
    for p in "${to_synth[@]}"; do model_done "$p"; rm -f "$models_dir/$p.rc" "$models_dir/$p.pid"; done
    rmdir "$models_dir" 2>/dev/null
    tprun_mps_stop
}
trap cleanup EXIT

run() { # name, seconds, command...
    local name=$1 secs; shift
    room 30 "$name" || return 0
    secs=$(cap "$1"); shift
    echo "== $name"
    timeout "$secs" "$@" 2>&1 | grep -v '^\[rank' > "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -ne 124 ] || echo "   stopped after $secs s (time limit): the table is partial"
    [ "$rc" -eq 0 ] || { status=1; echo "   rc=$rc"; grep -E '^error' "$OUT/$name.txt" | tail -3; }
}

# ---------------------------------------------------------------- allreduce
sec_info() {
    {
        if [ "$backend" = cuda ]; then
            nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m
        fi
        "$bin" info
    } > "$OUT/info.txt" 2>&1
    cat "$OUT/info.txt"
}

sec_selftest() {
    # shellcheck disable=SC2086 # $t is the tprun command line, split into words
    run selftest 300 $t selftest
    [ ! -f "$OUT/selftest.txt" ] || tail -2 "$OUT/selftest.txt"
}

sec_allreduce() {
    local ipc
    for ipc in $ipcs; do
        # shellcheck disable=SC2086 # $t is the tprun command line, split into words
        run "tprun-$ipc" 600 $t --ipc "$ipc" bench allreduce --algo "$algos" --dtype "$dtypes" --sizes "$sizes" --check
    done
    for f in "$OUT"/tprun-*.txt; do [ -f "$f" ] && echo "$(basename "$f"): $(grep 'Out of bounds' "$f")"; done
}

sec_nccl() {
    if [ "$backend" != cuda ] || [ "$nccl_ranks" -lt 1 ]; then echo "== nccl: skipped (no GPU)"; return 0; fi
    local dt
    for dt in ${dtypes//,/ }; do
        run "nccl-$dt" 400 python3 "$root/scripts/peer_nccl_allreduce.py" --ranks "$nccl_ranks" --sizes "$sizes" --dtype "$dt"
    done
    python3 - "$OUT" "$dtypes" > "$OUT/ratio.txt" <<'PY'
import sys, os
out = sys.argv[1]
def table(path):
    rows = {}
    if not os.path.exists(path): return rows
    for l in open(path):
        f = l.split()
        if len(f) >= 9 and f[0].isdigit():
            rows.setdefault((int(f[0]), f[2]), {})[f[3]] = (float(f[4]), float(f[7]), f[8], f[9] if len(f) > 9 else "-")
    return rows
tp = table(f"{out}/tprun-fd.txt")
print(f"{'size(B)':>12} {'type':>5} {'nccl us':>9} {'auto us':>9} {'auto graph':>10} {'auto/nccl':>9} {'busbw auto':>10} {'busbw nccl':>10} {'bw ratio':>8}")
for dt in sys.argv[2].split(","):
    nc = table(f"{out}/nccl-{dt}.txt")
    for (size, d), algos in sorted(tp.items()):
        if d != dt or (size, d) not in nc: continue
        auto = next((v for k, v in algos.items() if k.startswith("auto")), None)
        n = nc[(size, d)]["nccl"]
        if auto is None: continue
        g = float(auto[3]) if auto[3] not in ("-",) else auto[0]
        print(f"{size:>12} {d:>5} {n[0]:>9.2f} {auto[0]:>9.2f} {g:>10.2f} {g / n[0]:>9.2f} {auto[1]:>10.2f} {n[1]:>10.2f} {auto[1] / n[1] if n[1] else 0:>8.2f}")
PY
    echo "== ratio tprun (auto, --ipc fd) / NCCL"
    cat "$OUT/ratio.txt"
}

# ---------------------------------------------------------------- copy bandwidth
# $OUT/copy.txt: one line per GPU, then "per-GPU copy: X GB/s" (read + write, the mean).
sec_copy() {
    room 30 copy || return 0
    echo "== device copy bandwidth (1 GiB, read + write)"
    if [ "$backend" = cuda ]; then
        timeout "$(cap 120)" python3 "$root/scripts/device/copy_bw.py" "$devices" > "$OUT/copy.txt" 2>&1
    else
        # The CPU backend's "device" is host memory: a 256 MiB memcpy.
        python3 - <<'PY' > "$OUT/copy.txt" 2>&1
import time
a = bytearray(256 << 20); b = bytearray(256 << 20); ma, mb = memoryview(a), memoryview(b)
for _ in range(2): mb[:] = ma
t0 = time.perf_counter()
for _ in range(5): mb[:] = ma
t = (time.perf_counter() - t0) / 5
print(f"host memcpy 256 MiB: {2 * (256 << 20) / t / 1e9:.1f} GB/s (read + write)")
print(f"per-GPU copy: {2 * (256 << 20) / t / 1e9:.1f} GB/s")
PY
    fi
    cat "$OUT/copy.txt"
    grep -q '^per-GPU copy' "$OUT/copy.txt" || echo "   no copy bandwidth: the % column stays empty"
}

# ---------------------------------------------------------------- synth
# The synth command line of a model (PRESET replaces the preset, e.g. tiny for the CPU).
synth_args() {
    local a
    case $1 in
        llama3-8b) a="--arch llama --preset llama3-8b --dtype bf16" ;;
        qwen3-32b) a="--arch qwen3 --preset qwen3-32b --dtype bf16" ;;
        "$q35") a="--arch qwen3_5 --preset 27b --quant gptq-int4 --group-size 128 --dtype bf16" ;;
        *) return 1 ;;
    esac
    # The tiny preset's own group size (32) divides its shapes; 128 does not.
    [ -z "${PRESET:-}" ] || a="$(echo "$a" | sed -e "s/--preset [^ ]*/--preset $PRESET/" -e 's/ --group-size 128//')"
    echo "$a"
}
# Its size on disk in GB (rounded up), for the disk-space check and the time estimates.
model_gb() {
    [ -z "${PRESET:-}" ] || { echo 0; return; }
    case $1 in llama3-8b) echo 17 ;; qwen3-32b) echo 66 ;; "$q35") echo 29 ;; *) echo 0 ;; esac
}
avail_gb() { echo $(( $(df -B1 --output=avail "$models_dir" | tail -1) / 1000000000 )); }
total_gb() { echo $(( $(df -B1 --output=size "$models_dir" | tail -1) / 1000000000 )); }

# Writes model NAME into $models_dir/NAME; $models_dir/NAME.rc gets "rc seconds" (or "rc
# reason") when done. With WAIT_SPACE=1, first waits (until DEADLINE) for its size on disk.
synth_one() {
    local name=$1 dir="$models_dir/$1" args t0 rc
    read -ra args <<< "$(synth_args "$name")"
    if [ -f "$dir/.synth-done" ]; then echo "0 reused" > "$dir.rc"; return; fi
    # A model larger than the whole disk never fits, whatever is deleted (qwen3-32b, 66 GB, on
    # a 64 GiB one-GPU machine): said at once, instead of waiting for space.
    if [ "$(total_gb)" -lt $(( $(model_gb "$name") + 2 )) ]; then echo "1 no-disk-space" > "$dir.rc"; return; fi
    while [ "${WAIT_SPACE:-0}" = 1 ] && [ "$(avail_gb)" -lt $(( $(model_gb "$name") + 2 )) ]; do
        if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$DEADLINE" ]; then echo "1 no-disk-space" > "$dir.rc"; return; fi
        sleep 5
    done
    t0=$(date +%s)
    "$bin" synth "${args[@]}" --out "$dir" > "$OUT/synth-$name.log" 2>&1 &
    echo $! > "$dir.pid"
    wait $!; rc=$?
    rm -f "$dir.pid"
    [ $rc -ne 0 ] || touch "$dir/.synth-done"
    echo "$rc $(( $(date +%s) - t0 ))s" > "$dir.rc"
}

# Starts every model's synth in the background: all at once when they fit the free disk
# together, else one after another, each waiting for its space.
synth_start() {
    local need=0 m
    for m in "$@"; do rm -f "$models_dir/$m.rc"; need=$(( need + $(model_gb "$m") )); done
    [ $# -gt 0 ] || return 0
    echo "== synth in the background: $* ($need GB; $(avail_gb) GB free in $models_dir)"
    if [ $(( need + 2 )) -le "$(avail_gb)" ]; then
        for m in "$@"; do synth_one "$m" & synth_pids+=($!); done
    else
        echo "   not all at once: one after another, each model deleted after its decode runs"
        ( for m in "$@"; do WAIT_SPACE=1 synth_one "$m"; done ) &
        synth_pids+=($!)
    fi
}

# Waits for model NAME's synth (while NEED_S seconds are left before DEADLINE).
synth_wait() {
    local name=$1 need=$2 rc secs
    wait_st=skipped
    while [ ! -f "$models_dir/$name.rc" ]; do
        room "$need" "$name (its synth is not done)" || return 1
        sleep 2
    done
    read -r rc secs < "$models_dir/$name.rc"
    if [ "$rc" -ne 0 ]; then
        wait_st=synth-failed; fail "synth $name (exit $rc, $secs)"; tail -3 "$OUT/synth-$name.log" 2>/dev/null; return 1
    fi
    echo "synth $name: $secs, $(du -sh "$models_dir/$name" | cut -f1)"
}

# Done with model NAME: its synth stops if still running (a skipped model), its folder goes.
model_done() {
    [ ! -f "$models_dir/$1.pid" ] || kill "$(cat "$models_dir/$1.pid")" 2>/dev/null
    [ "${KEEP_MODELS:-0}" = 1 ] && [ -f "$models_dir/$1/.synth-done" ] || rm -rf "${models_dir:?}/$1"
}

# ---------------------------------------------------------------- decode
prompt="$OUT/prompt.txt"
# A PROMPT_LEN-token prompt: the synth tokenizer is byte-level and decode adds BOS.
python3 -c "
import sys; n = int(sys.argv[1]) - 1
s = 'Once upon a time, in a land far away, there lived a small robot who loved to count the stars every night. '
print((s * (n // len(s) + 1))[:n], end='')" "$prompt_len" > "$prompt"

# $OUT/decode_runs.tsv, one line per model and TP: model, TP, devices, distinct GPUs, status
# with allreduces, status without (ok, failed, no-fit, timeout, skipped, -), new tokens.
runs="$OUT/decode_runs.tsv"
: > "$runs"

# One decode run: MODEL TP on|off NEW_TOKENS; sets $st (ok, no-fit, timeout, failed).
decode_one() {
    local name=$1 tp=$2 ar=$3 new=$4 tag="dec-$1-tp$2" dlist envs=() devflag=() secs rc
    [ "$ar" = on ] || { tag="$tag-noar"; envs=(TPRUN_BENCH_NO_ALLREDUCE=1); }
    if [ "$backend" = cuda ]; then dlist=$(echo "$devices" | cut -d, -f1-"$tp"); devflag=(--devices "$dlist"); fi
    secs=$(cap "${DECODE_S:-300}")
    env "${envs[@]}" timeout "$secs" "$bin" --backend "$backend" --ranks "$tp" "${devflag[@]}" --timeout 120 \
        decode --model "$models_dir/$name" --prompt-file "$prompt" --temperature 0 --ignore-eos \
        --max-new-tokens "$new" --max-seq "$max_seq" --json > "$OUT/$tag.json" 2> "$OUT/$tag.err"
    rc=$?
    if [ $rc -eq 0 ]; then
        st=ok
        python3 - "$OUT/$tag.json" "$name" "$tp" "$ar" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); tp = int(sys.argv[3])
note = "" if sys.argv[4] == "on" else " without allreduces (timing only)"
print(f"{sys.argv[2]} TP={tp}{note}: {j['decode_tokens_per_s']:.1f} tok/s, p50 {j['token_latency_p50_ms']:.3f} ms, "
      f"{j['step_weight_bytes_rank0'] * tp / 1e9:.2f} GB read/token (all ranks), graph {j['graph']}, "
      f"{j['allreduces_per_step']} allreduces/step, prompt {j['prefill_tokens']} tokens, "
      f"load {j['load_s']:.1f} s, device {j['device_bytes_per_rank'] / 1e9:.1f} GB/rank")
PY
    elif grep -qiE 'of device memory .* are free|out of memory' "$OUT/$tag.err"; then
        st=no-fit
        echo "$name TP=$tp does not fit the GPU memory: $(grep -m1 -ioE "rank [0-9]*'s shard needs.*|.*out of memory.*" "$OUT/$tag.err") -- going on"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        st=timeout; fail "$name TP=$tp ($ar): stopped after $secs s"; tail -3 "$OUT/$tag.err"
    else
        st=failed; fail "$name TP=$tp ($ar): exit $rc"; grep -v '^\[rank' "$OUT/$tag.err" | tail -3
    fi
}

# Every TP of one model (with and without allreduces), then its rows of the table.
decode_model() { # NAME NEW_TOKENS TP...
    local name=$1 new=$2 tp gb est st_on st_off dlist gpus
    shift 2
    gb=$(model_gb "$name")
    est=$(( 20 + gb ))   # seconds a run takes at most, roughly: start, load, prefill, decode
    echo "== decode $name: TP $*, $new new tokens after $prompt_len prompt tokens, greedy"
    if ! synth_wait "$name" "$est"; then
        for tp in "$@"; do printf '%s\t%s\t-\t-\t%s\t-\t%s\n' "$name" "$tp" "$wait_st" "$new" >> "$runs"; done
        model_done "$name"; return 0
    fi
    for tp in "$@"; do
        if [ "$backend" = cuda ]; then
            dlist=$(echo "$devices" | cut -d, -f1-"$tp"); gpus=$(echo "$dlist" | tr , '\n' | sort -u | wc -l)
        else
            dlist=cpu; gpus=1
        fi
        st_on=skipped; st_off=-
        if room "$est" "$name TP=$tp"; then
            decode_one "$name" "$tp" on "$new"; st_on=$st
            if [ "$tp" -gt 1 ] && [ "${NOAR:-1}" != 0 ] && [ "$st_on" = ok ]; then
                st_off=skipped
                if room "$est" "$name TP=$tp without allreduces"; then decode_one "$name" "$tp" off "$new"; st_off=$st; fi
            fi
        fi
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$tp" "$dlist" "$gpus" "$st_on" "$st_off" "$new" >> "$runs"
    done
    model_done "$name"
    decode_table "$name" || status=1
}

# The table of $runs (MODEL: only its rows; none: all, into $OUT/decode_table.txt). Exit 1 when
# some TP's greedy tokens differ from TP=1's (from the lowest TP that ran, without a TP=1 run).
decode_table() {
    python3 - "$OUT" "${1:-}" <<'PY'
import json, os, re, sys
out, only = sys.argv[1], sys.argv[2]
copy = None
if os.path.exists(f"{out}/copy.txt"):
    m = re.search(r"^per-GPU copy: ([0-9.]+) GB/s", open(f"{out}/copy.txt").read(), re.M)
    copy = float(m.group(1)) if m else None
def load(path):
    try: return json.load(open(path))
    except (OSError, ValueError): return None
rows = [l.rstrip("\n").split("\t") for l in open(f"{out}/decode_runs.tsv") if l.strip()]
rows = [r for r in rows if not only or r[0] == only]
runs = {}
for name, tp, _, _, st_on, st_off, _ in rows:
    runs[(name, int(tp))] = (load(f"{out}/dec-{name}-tp{tp}.json") if st_on == "ok" else None,
                             load(f"{out}/dec-{name}-tp{tp}-noar.json") if st_off == "ok" else None)
bad = False
hdr = ["model", "TP", "devices", "tok/s", "ms/token", "allreduce ms/token", "weight GB/token (all ranks)",
       "aggregate GB/s", "% of G x copy", "tokens = TP=1"]
lines = []
for name, tp, devs, gpus, st_on, st_off, new in rows:
    tp = int(tp)
    on, off = runs[(name, tp)]
    if st_on != "ok" or on is None:
        lines.append([name, str(tp), devs, st_on, "-", "-", "-", "-", "-", "-"]); continue
    p50 = on["token_latency_p50_ms"]
    ar = "-" if tp == 1 else (f"{p50 - off['token_latency_p50_ms']:.3f}" if off else st_off)
    gb = on["step_weight_bytes_rank0"] * tp / 1e9
    agg = gb / (p50 / 1e3)
    pct = f"{agg / (copy * int(gpus)) * 100:.0f} % of {gpus}x" if copy else "-"
    # The reference: TP=1's tokens, else those of the lowest TP that ran.
    ok_tps = sorted(t for (n, t), (j, _) in runs.items() if n == name and j)
    ref_tp = 1 if 1 in ok_tps else ok_tps[0]
    ref = runs[(name, ref_tp)][0]["token_ids"]
    got = on["token_ids"]
    if tp == ref_tp:
        eq = "(reference)" if ref_tp == 1 else "(reference: no TP=1)"
    elif got == ref:
        eq = "yes" + ("" if ref_tp == 1 else f" (= TP={ref_tp})")
    else:
        bad = True
        k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        eq = f"NO: from token {k} of {len(ref)}" + ("" if ref_tp == 1 else f" (vs TP={ref_tp})")
    lines.append([name, str(tp), devs, f"{on['decode_tokens_per_s']:.1f}", f"{p50:.3f}", ar,
                  f"{gb:.2f}" if gb >= 0.1 else f"{gb:.2e}",
                  f"{agg:.0f}" if agg >= 10 else f"{agg:.2f}", pct, eq])
w = [max(len(r[i]) for r in [hdr] + lines) for i in range(len(hdr))]
text = "\n".join("  ".join(c.rjust(w[i]) if 2 < i < 9 or i == 1 else c.ljust(w[i]) for i, c in enumerate(r)).rstrip()
                 for r in [hdr] + lines)
print(text)
if not only:
    with open(f"{out}/decode_table.txt", "w") as f:
        f.write(text + "\n")
        f.write(f"\nbatch 1, greedy; ms/token and aggregate GB/s from the p50 token time; allreduce ms/token = p50 minus\n"
                f"p50 of the same run with TPRUN_BENCH_NO_ALLREDUCE=1; weight bytes = step_weight_bytes_rank0 x TP;\n"
                f"G = distinct GPUs the ranks ran on; copy (read + write, per GPU) = {copy} GB/s\n")
if bad:
    print("FAILED: greedy tokens differ between TPs")
sys.exit(1 if bad else 0)
PY
}

sec_decode() {
    local m
    for m in $models; do
        # shellcheck disable=SC2086 # the TP list splits into words
        decode_model "$m" "$new_tokens" $tps
    done
}

sec_q35() {
    # shellcheck disable=SC2086
    decode_model "$q35" "$q35_new_tokens" $q35_tps
}

# ---------------------------------------------------------------- main
for m in $models $q35; do synth_args "$m" > /dev/null || { echo "unknown model $m (llama3-8b, qwen3-32b)"; exit 2; }; done
check_tps=""
want decode && check_tps="$tps"
want q35 && check_tps="$check_tps $q35_tps"
for tp in $check_tps; do
    [ "$tp" -ge 1 ] && [ "$tp" -le "$ranks" ] || { echo "TP $tp: not within 1..RANKS ($ranks)"; exit 2; }
done
if want decode; then read -ra to_synth <<< "$models"; fi
if want q35; then to_synth+=("$q35"); fi
synth_start "${to_synth[@]}"
want info && sec_info
want selftest && sec_selftest
want allreduce && sec_allreduce
want nccl && sec_nccl
want copy && sec_copy
want decode && sec_decode
want q35 && sec_q35
if [ -s "$runs" ]; then
    echo "== decode summary ($OUT/decode_table.txt)"
    decode_table || status=1
fi
echo "overall status $status"
exit $status
