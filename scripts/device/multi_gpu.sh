#!/usr/bin/env bash
# tprun across real GPUs against NCCL, one command on a machine with several GPUs:
#   tprun info (P2P/IPC matrix); tprun selftest; tprun bench allreduce --check for every
#   algorithm, bf16 and f32, 8 B - 256 MiB, --ipc fd and --ipc legacy; then
#   scripts/peer_nccl_allreduce.py (NCCL, CUDA-graph replay) over the same sizes; then the
#   ratio tprun/NCCL per size.
#   scripts/device/multi_gpu.sh [TPRUN_BINARY] [RANKS] [SIZES]     (defaults: 4, 8:256M)
# With fewer GPUs than ranks (a one-GPU machine, for testing this script), the tprun ranks share
# GPU 0 under MPS and NCCL runs on the GPUs there are (NCCL refuses two ranks on one GPU).
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0); tprun never calls cuMulticastCreate.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:-$root/target/release/tprun}")"
ranks="${2:-4}"
sizes="${3:-8:256M}"
OUT="${OUT:-/tmp/tprun-multi-gpu}"
mkdir -p "$OUT"
. "$root/scripts/device/common.sh"
tprun_job "$bin" "$ranks" 60
# NCCL refuses two ranks on one GPU: it runs on the GPUs there are.
nccl_ranks=$(( ngpu < ranks ? ngpu : ranks ))
status=0
run() { # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "== $name"
    timeout "$secs" "$@" 2>&1 | grep -v '^\[rank' > "$OUT/$name.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { status=1; echo "   rc=$rc"; grep -E '^error' "$OUT/$name.txt" | tail -3; }
}
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv; nvidia-smi topo -m; "$bin" info; } > "$OUT/info.txt" 2>&1
cat "$OUT/info.txt"
run selftest 300 $t selftest
tail -2 "$OUT/selftest.txt"
for ipc in fd legacy; do
    run "tprun-$ipc" 600 $t --ipc "$ipc" bench allreduce --algo all --dtype bf16,f32 --sizes "$sizes" --check
done
for dt in bf16 f32; do
    run "nccl-$dt" 400 python3 "$root/scripts/peer_nccl_allreduce.py" --ranks "$nccl_ranks" --sizes "$sizes" --dtype "$dt"
done
python3 - "$OUT" > "$OUT/ratio.txt" <<'PY'
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
for dt in ("bf16", "f32"):
    nc = table(f"{out}/nccl-{dt}.txt")
    for (size, d), algos in sorted(tp.items()):
        if d != dt or (size, d) not in nc: continue
        auto = next((v for k, v in algos.items() if k.startswith("auto")), None)
        n = nc[(size, d)]["nccl"]
        if auto is None: continue
        g = float(auto[3]) if auto[3] not in ("-",) else auto[0]
        print(f"{size:>12} {d:>5} {n[0]:>9.2f} {auto[0]:>9.2f} {g:>10.2f} {g / n[0]:>9.2f} {auto[1]:>10.2f} {n[1]:>10.2f} {auto[1] / n[1] if n[1] else 0:>8.2f}")
PY
cat "$OUT/ratio.txt"
for f in "$OUT"/tprun-*.txt; do echo "$(basename "$f"): $(grep 'Out of bounds' "$f")"; done
echo "overall status $status"
exit $status
