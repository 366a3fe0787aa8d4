#!/usr/bin/env bash
# Writes the transformers-built tiny Qwen3.5 fixtures (scripts/ref_qwen35.py) into OUT_DIR;
# run on the GPU machine (it has transformers with Qwen3.5), then copy OUT_DIR/qwen35-tiny*
# into rank/tests/fixtures/.
#   scripts/device/qwen35_ref.sh OUT_DIR
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:?output folder}"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
python3 "$root/scripts/ref_qwen35.py" "$out"
ls -la "$out"/qwen35-tiny*
