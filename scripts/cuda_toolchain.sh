#!/usr/bin/env bash
# A CUDA 13 compiler without a GPU or a CUDA install: nvcc, ptxas, cicc, the runtime headers,
# NVRTC, cuobjdump and nvdisasm from NVIDIA's pip wheels, unpacked under DIR (default
# ~/.cache/tprun-cuda). Enough to build scripts/device/q4lab.cu here (~35 s) and read its SASS,
# so that a lab candidate reaches the GPU machine compiled and its registers known:
#
#   eval "$(scripts/cuda_toolchain.sh)"       # sets CUDA_TC and PATH; downloads once (~500 MB unpacked)
#   nvcc -O3 -arch=sm_90 -std=c++17 --fmad=false -Xptxas -v -Ikernels/src/gpu \
#       scripts/device/q4lab.cu -o /tmp/q4lab
#   cuobjdump -sass /tmp/q4lab | less
#   python3 scripts/check_cuda_kernels.py --lib "$CUDA_TC/lib/libnvrtc.so.13" --cubin DIR
#
# Prints the shell lines to eval on stdout; progress goes to stderr.
set -euo pipefail
dir="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/tprun-cuda}"
tc="$dir/x/nvidia/cu13"
if [ ! -x "$tc/bin/nvcc" ] || [ ! -x "$tc/nvvm/bin/cicc" ] || [ ! -f "$tc/include/crt/host_config.h" ]; then
    mkdir -p "$dir"
    echo "downloading the CUDA 13 wheels into $dir" >&2
    python3 -m pip download -q --no-deps -d "$dir" nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt \
        nvidia-cuda-runtime nvidia-cuda-cccl nvidia-cuda-nvrtc nvidia-cuda-cuobjdump \
        nvidia-cuda-nvdisasm >&2
    for w in "$dir"/*.whl; do python3 -m zipfile -e "$w" "$dir/x/" && rm -f "$w"; done
    chmod +x "$tc"/bin/* "$tc"/nvvm/bin/* 2>/dev/null || true
fi
echo "export CUDA_TC='$tc'"
echo "export PATH='$tc/bin':\"\$PATH\""
