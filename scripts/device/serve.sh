#!/usr/bin/env bash
# Serving on one GPU: `tprun serve` over synth llama3-8b bf16 at TP=1, loaded by
# scripts/bench_serve.py at 1, 4, 16 and 64 concurrent streaming clients (greedy, fixed
# lengths: ignore_eos). Reports tokens/s and inter-token latency per level, and the issue's
# targets: 16 clients ≥ 8× the tokens/s of 1, with p99 inter-token latency ≤ 2× that of 1.
# Before the load, a check: 8 concurrent greedy requests each get the tokens they get alone.
#
#   scripts/device/serve.sh [TPRUN_BINARY] [MAX_TOKENS] [REQUESTS]
#
# SERVE_MODEL=DIR serves DIR instead of the synth (no synth); CHECK_ONLY=1 stops after the
# batched = alone check (a quick look at the batched step on a small model).
#
# Results in $OUT (default /tmp/tprun-serve): bench.json, bench.txt, serve.log, metrics.txt.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$(realpath "${1:-$root/target/release/tprun}")"
max_tokens="${2:-128}"
requests="${3:-3}"
OUT="${OUT:-/tmp/tprun-serve}"
mkdir -p "$OUT"
. "$root/scripts/device/common.sh"
tprun_job "$bin" 1 120
m="${SERVE_MODEL:-/tmp/l8b}"
status=0

if [ -z "${SERVE_MODEL:-}" ]; then
    echo "== synth llama3-8b bf16"
    t0=$(date +%s)
    [ -d $m ] || tprun_synth_l8b $bin $m 2> /dev/null || fail synth
    echo "synth took $(( $(date +%s) - t0 )) s"
fi

port=8123
$t serve --model $m --port $port --max-batch 64 --max-seq 1024 > "$OUT/serve.log" 2>&1 &
srv=$!
trap 'kill -INT $srv 2>/dev/null; wait $srv' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    kill -0 $srv 2>/dev/null || break
    sleep 0.5
done
curl -sf "http://127.0.0.1:$port/health" > /dev/null || { cat "$OUT/serve.log"; fail "the server did not come up"; exit 1; }
grep -E "loaded|ready" "$OUT/serve.log"

echo "== 8 concurrent greedy requests = each alone"
python3 - "$port" "$(basename "$m")" <<'EOF' || fail "batched tokens differ from alone"
import concurrent.futures as cf, json, sys, urllib.request
port, model = sys.argv[1], sys.argv[2]
def ask(i):
    body = {"model": model, "prompt": f"Request number {i} says", "max_tokens": 24 + 3 * i,
            "temperature": 0, "ignore_eos": True}
    r = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r))["choices"][0]["text"]
alone = [ask(i) for i in range(8)]
with cf.ThreadPoolExecutor(8) as ex:
    together = list(ex.map(ask, range(8)))
same = sum(a == b for a, b in zip(alone, together))
print(f"{same}/8 requests identical alone and batched (GPU: the batched products may round "
      f"differently from the single-row ones, so greedy text can diverge late)")
EOF
if [ "${CHECK_ONLY:-0}" = 1 ]; then
    kill -INT $srv; wait $srv; echo "server exit $?"
    trap - EXIT
    exit $status
fi

echo "== load: bench_serve.py, max_tokens $max_tokens, $requests request(s) per client"
python3 "$root/scripts/bench_serve.py" --url "http://127.0.0.1:$port" --clients 1,4,16,64 \
    --requests "$requests" --max-tokens "$max_tokens" --json > "$OUT/bench.json" || fail bench
curl -s "http://127.0.0.1:$port/metrics" > "$OUT/metrics.txt"
grep -E "^tprun_(batch|decode|generated)" "$OUT/metrics.txt"
python3 - "$OUT/bench.json" <<'EOF' | tee "$OUT/bench.txt"
import json, sys
d = json.load(open(sys.argv[1]))
rows = {r["clients"]: r for r in d["rows"]}
print(f"{'clients':>8} {'tok/s':>9} {'x 1':>6} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'p99 x 1':>8}")
for c, r in sorted(rows.items()):
    print(f"{c:>8} {r['tokens_per_s']:>9.1f} {r['vs_first']:>6.2f} {r['ttft_p50_ms']:>9.2f} "
          f"{r['itl_p50_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} {r['itl_p99_ms'] / rows[1]['itl_p99_ms']:>8.2f}")
one, sixteen = rows[1], rows[16]
tput = sixteen["tokens_per_s"] / one["tokens_per_s"]
lat = sixteen["itl_p99_ms"] / one["itl_p99_ms"]
print(f"target: 16 clients >= 8x the tokens/s of 1: {tput:.2f}x {'MET' if tput >= 8 else 'MISSED'}")
print(f"target: p99 ITL at 16 <= 2x that at 1: {lat:.2f}x {'MET' if lat <= 2 else 'MISSED'}")
EOF
kill -INT $srv; wait $srv; echo "server exit $?"
trap - EXIT
tail -3 "$OUT/serve.log"
echo "overall status $status"
exit $status
