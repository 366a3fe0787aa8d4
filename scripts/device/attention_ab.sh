#!/usr/bin/env bash
# The attention kernels on a GPU, then decode A/B, in one call:
#
#   scripts/device/attention_ab.sh KERNELS_TEST_BIN NEW_TPRUN BASE_TPRUN
#
# KERNELS_TEST_BIN is the kernels crate's unit-test binary built here and carried
# (cargo test --release -p tprun-kernels --no-run; target/release/deps/tprun_kernels-*,
# stripped into .devbin-cuda/). It runs the attention twins on the GPU (every case against the
# CPU twin) and the attention timings (split + merge, single kernel; graph replays). Then
# decode_ab.sh --selftest NEW BASE (synth llama3-8b bf16, TP=1, 256 tokens after 128, two
# rounds). PEER=1 adds, in the same call, the device copy bandwidth and the peer
# (scripts/peer_hf_decode.py: transformers static cache + torch.compile) on the same
# checkpoint. Results in $OUT (or ./out).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
tests="$(realpath "${1:?kernels test binary}")"
new="${2:?new tprun}"; base="${3:?base tprun}"
out="${OUT:-$root/out}"; mkdir -p "$out"
. "$root/scripts/device/common.sh"
export TPRUN_KERNEL_CACHE="${TPRUN_KERNEL_CACHE:-/tmp/tprun-kernel-cache}"
tprun_nvrtc_link
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
echo "== attention twins on the GPU"
TPRUN_REQUIRE_GPU=1 timeout 200 "$tests" --exact cuda::ops_attention::tests::attention_twins_on_the_gpu --nocapture > "$out/attn-twins.log" 2>&1 || { echo "FAILED: attention twins"; status=1; tail -30 "$out/attn-twins.log"; }
grep -E "^test |passed|failed" "$out/attn-twins.log" | tail -4
echo "== attention timings"
timeout 200 "$tests" --exact cuda::ops_attention::tests::attention_timings --ignored --nocapture > "$out/attn-timings.log" 2>&1 || { echo "FAILED: attention timings"; status=1; tail -20 "$out/attn-timings.log"; }
grep TIMING "$out/attn-timings.log"
"$root/scripts/device/decode_ab.sh" --selftest "$new" "$base" || status=1
if [ "${PEER:-0}" = 1 ]; then
    echo "== device copy bandwidth"
    python3 "$root/scripts/device/copy_bw.py" | tee "$out/copy.txt" || { echo "FAILED: copy bandwidth"; status=1; }
    echo "== peer: transformers static cache + torch.compile (same checkpoint)"
    tprun_peer /tmp/l8b 300
fi
exit $status
