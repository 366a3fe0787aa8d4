# Sourced by the scripts in scripts/device/: what every GPU run needs.
#   tprun_nvrtc_link        put libnvrtc.so on the loader path (CUDA 13 ships libnvrtc.so.13;
#                           the plain name comes only with the -dev package)
#   tprun_devices RANKS     sets $devices: 0..RANKS-1 when there are enough GPUs, else RANKS
#                           ranks on GPU 0 with the CUDA MPS daemon started (without MPS the
#                           ranks' kernels time-slice and every cross-rank wait costs ms) and
#                           stopped at exit; sets $ngpu
#   tprun_mps_stop          stops that MPS daemon (no-op when it was not started): tprun_devices'
#                           EXIT trap; a script that sets its own EXIT trap after it calls it
#   tprun_mps_restart       stops and restarts that MPS daemon (no-op when it was not started)
#   tprun_job BIN RANKS [TIMEOUT_S]
#                           all a CUDA job needs: the kernel cache ($TPRUN_KERNEL_CACHE, else
#                           /tmp/tprun-kernel-cache), tprun_nvrtc_link, tprun_devices; sets $t
#                           to the tprun command line for RANKS ranks on $devices (--timeout,
#                           default 30 s)
#   tprun_gpu_apps          how many tprun processes the GPU driver lists as running on a GPU
#   tprun_ab BIN...         the start of an A/B script (decode_ab.sh, q4_ab.sh): sets $bins
#                           (the binaries, absolute), $out ($OUT, else $root/out, created)
#                           and status=0; the kernel cache and tprun_nvrtc_link as tprun_job
#   fail WHAT               prints "FAILED: WHAT" and sets status=1 (the caller's exit code)
#   room SECS WHAT          true while DEADLINE (epoch seconds; unset: none) is SECS or more
#                           away, else prints "SKIPPED (time): WHAT" and fails
#   tprun_synth_27b BIN DIR synth qwen3_5 27b with its MLP in GPTQ int4 (group 128), the rest
#                           bf16 (the official checkpoint's layout), into DIR; stdout dropped
#   tprun_synth_l8b BIN DIR synth llama3-8b bf16 (the decode benchmark's 16 GB) into DIR;
#                           stdout dropped
#   tprun_peer MODEL SECS   issue 9's peer on MODEL (scripts/peer_hf_decode.py: transformers
#                           static cache + torch.compile, 256 tokens after 128) into
#                           $out/peer.json, printed; at most SECS, cut to end 20 s before
#                           DEADLINE; `fail peer` when it fails ($root and $out: the caller's)
#   tprun_prompt128 FILE    writes the 127-byte prompt of the Llama benchmarks (128 tokens with
#                           the byte-level tokenizer's BOS) to FILE
#   tprun_decode_line JSON COPY_TXT LABEL
#                           one line for a `decode --json` result: tok/s, p50, GB read per
#                           token and that rate as a share of the copy_bw.py figure in COPY_TXT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

fail() { echo "FAILED: $*"; status=1; }
room() { [ -z "${DEADLINE:-}" ] || [ $(( DEADLINE - $(date +%s) )) -ge "$1" ] || { echo "SKIPPED (time): $2"; return 1; }; }

tprun_synth_27b() {
    "$1" synth --arch qwen3_5 --preset 27b --quant gptq-int4 --group-size 128 --dtype bf16 --out "$2" > /dev/null
}

tprun_synth_l8b() {
    "$1" synth --arch llama --preset llama3-8b --dtype bf16 --out "$2" > /dev/null
}

tprun_peer() {
    local s=$2
    if [ -n "${DEADLINE:-}" ] && [ $(( DEADLINE - $(date +%s) - 20 )) -lt "$s" ]; then
        s=$(( DEADLINE - $(date +%s) - 20 ))
    fi
    PYTHONUNBUFFERED=1 timeout "$s" python3 "$root/scripts/peer_hf_decode.py" --model "$1" --prompt-len 128 \
        --new-tokens 256 --modes compile --repeats 1 --json > "$out/peer.json" 2> "$out/peer.err" \
        || { fail peer; tail -5 "$out/peer.err"; }
    cat "$out/peer.json"
}

tprun_prompt128() {
    python3 -c "print(('Once upon a time, in a land far away, there lived a small robot who loved to count the stars every night. ' * 3)[:127], end='')" > "$1"
}

tprun_ab() {
    bins=()
    for b in "$@"; do bins+=("$(realpath "$b")"); done
    out="${OUT:-$root/out}"
    mkdir -p "$out"
    export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
    tprun_nvrtc_link
    status=0
}

tprun_nvrtc_link() {
    local nvrtc
    nvrtc="$(ls /usr/local/cuda/lib64/libnvrtc.so.1[0-9]* /usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.1[0-9]* 2>/dev/null | grep -v builtins | head -1)"
    [ -n "$nvrtc" ] || nvrtc="$(find / -name 'libnvrtc.so.1[0-9]*' -not -path '/proc/*' 2>/dev/null | grep -v builtins | head -1)"
    mkdir -p /tmp/tprun-nvrtc && ln -sf "$nvrtc" /tmp/tprun-nvrtc/libnvrtc.so
    export LD_LIBRARY_PATH="/tmp/tprun-nvrtc:$(dirname "$nvrtc"):${LD_LIBRARY_PATH:-}"
}

tprun_devices() {
    local ranks=$1
    ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$ngpu" -ge "$ranks" ]; then
        devices=$(seq -s, 0 $((ranks - 1)))
    else
        devices=$(printf '0%.0s,' $(seq "$ranks")); devices=${devices%,}
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/tprun-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/tprun-mps-log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && echo "only $ngpu GPU(s): $ranks ranks share GPU 0 under MPS"
        trap tprun_mps_stop EXIT
    fi
}

tprun_mps_stop() {
    [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
    echo quit | nvidia-cuda-mps-control
    echo "MPS daemon stopped"
}

tprun_mps_restart() {
    [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
    echo quit | nvidia-cuda-mps-control
    sleep 1
    nvidia-cuda-mps-control -d && echo "MPS daemon restarted"
}

tprun_gpu_apps() {
    nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader | grep -c tprun
}

tprun_job() {
    export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
    tprun_nvrtc_link
    tprun_devices "$2"
    t="$1 --ranks $2 --devices $devices --backend cuda --timeout ${3:-30}"
}

tprun_decode_line() {
    python3 - "$1" "$2" "$3" <<'PY'
import json, re, sys
j = json.load(open(sys.argv[1]))
copy = float(re.search(r"([0-9.]+) TB/s", open(sys.argv[2]).read()).group(1))
gbs = j["weight_gb_per_s"]
print(f"{sys.argv[3]}: {j['decode_tokens_per_s']:.1f} tok/s, p50 {j['token_latency_p50_ms']:.3f} ms, "
      f"{j['step_weight_bytes_rank0'] / 1e9:.1f} GB read/token, {gbs:.0f} GB/s = {gbs / (copy * 1e3) * 100:.0f} % of copy, "
      f"{j['kernel_launches_per_token']} launches/token, load {j['load_s']:.1f} s")
PY
}
