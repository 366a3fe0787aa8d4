#!/usr/bin/env bash
# tprun's CPU allreduce against torch.distributed gloo, in one command on one machine, same
# sizes and columns. Needs a release build (cargo build --release) and PyTorch + numpy.
#   scripts/cpu_allreduce_vs_gloo.sh [RANKS] [SIZES]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${1:-4}
sizes=${2:-8:64M}
echo "# $(date -u +%FT%TZ) $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
./target/release/tprun --ranks "$ranks" --backend cpu bench allreduce --sizes "$sizes" --check
python3 scripts/peer_gloo_allreduce.py --ranks "$ranks" --sizes "$sizes" --check
