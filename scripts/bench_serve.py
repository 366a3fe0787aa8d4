#!/usr/bin/env python3
"""Load generator for `tprun serve` (a benchmark, not a test): throughput and inter-token latency
at several client counts, with plain asyncio and HTTP/1.1 over sockets (no client library).

    python3 scripts/bench_serve.py --url http://127.0.0.1:8000 [--model ID]
        [--clients 1,4,16,64] [--requests 4] [--max-tokens 64] [--prompt TEXT] [--json]

Each client sends --requests streaming completions one after another (greedy); every token's
arrival time is recorded. Per client count: tokens/s over the wall time, time to first token
and inter-token latency p50/p99, and the ratio of tokens/s to the single-client figure.
Start the server first (`tprun [--ranks N] serve --port 8000 ...`); --model defaults to the
id /v1/models lists.
"""
import argparse
import asyncio
import json
import statistics
import time
import urllib.parse


async def http(host, port, method, path, body=None):
    """One request; yields the body's lines as they arrive (chunked transfer decoded)."""
    r, w = await asyncio.open_connection(host, port)
    data = b"" if body is None else json.dumps(body).encode()
    w.write(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await w.drain()
    head = await r.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    chunked = b"chunked" in head.lower()
    buf = b""
    try:
        while True:
            if chunked:
                size = int((await r.readline()).strip() or b"0", 16)
                if size == 0:
                    break
                buf += await r.readexactly(size)
                await r.readline()
            else:
                part = await r.read(65536)
                if not part:
                    break
                buf += part
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                yield status, line.decode()
        if buf:
            yield status, buf.decode()
    finally:
        w.close()


async def one_request(host, port, model, prompt, max_tokens):
    """Arrival times of one streamed completion's tokens (first relative to the send)."""
    t0 = time.perf_counter()
    times = []
    # ignore_eos: every request generates max_tokens, whatever the model says.
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    async for status, line in http(host, port, "POST", "/v1/completions", body):
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {line}")
        if line.startswith("data: {"):
            v = json.loads(line[6:])
            if v["choices"][0].get("text"):
                times.append(time.perf_counter())
    return t0, times


async def client(host, port, model, prompt, max_tokens, n, out):
    for _ in range(n):
        out.append(await one_request(host, port, model, prompt, max_tokens))


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


async def level(host, port, model, prompt, max_tokens, clients, requests):
    results = []
    t0 = time.perf_counter()
    await asyncio.gather(*(client(host, port, model, prompt, max_tokens, requests, results)
                           for _ in range(clients)))
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for _, t in results)
    ttft = [t[0] - s for s, t in results if t]
    itl = [b - a for _, t in results for a, b in zip(t, t[1:])]
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_ms": pct(ttft, 50) * 1e3,
            "ttft_p99_ms": pct(ttft, 99) * 1e3, "itl_p50_ms": pct(itl, 50) * 1e3,
            "itl_p99_ms": pct(itl, 99) * 1e3}


async def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    u = urllib.parse.urlparse(a.url)
    host, port = u.hostname, u.port or 80
    model = a.model
    if model is None:
        lines = [line async for _, line in http(host, port, "GET", "/v1/models")]
        model = json.loads("".join(lines))["data"][0]["id"]
    rows = []
    for c in [int(x) for x in a.clients.split(",")]:
        rows.append(await level(host, port, model, a.prompt, a.max_tokens, c, a.requests))
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_first"] = r["tokens_per_s"] / base if base else float("nan")
    if a.json:
        print(json.dumps({"model": model, "max_tokens": a.max_tokens, "rows": rows}, indent=2))
        return
    print(f"# tprun serve at {a.url}, model {model}, {a.requests} streamed request(s) per client, "
          f"max_tokens {a.max_tokens}")
    print(f"{'clients':>8} {'tokens':>8} {'tok/s':>10} {'x first':>8} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
    for r in rows:
        print(f"{r['clients']:>8} {r['tokens']:>8} {r['tokens_per_s']:>10.1f} "
              f"{r['vs_first']:>8.2f} {r['ttft_p50_ms']:>9.2f} {r['ttft_p99_ms']:>9.2f} "
              f"{r['itl_p50_ms']:>8.3f} {r['itl_p99_ms']:>8.3f}")


if __name__ == "__main__":
    asyncio.run(main())
