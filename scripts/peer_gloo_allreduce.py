#!/usr/bin/env python3
"""Peer benchmark for `tprun bench allreduce` on the CPU: torch.distributed's gloo allreduce.

Runs N processes on this machine over the same sizes and prints the same columns as tprun
(size, count, type, algo, median and p99 time, algbw, busbw, #wrong), measured the same way:
a barrier before every timed call, each call timed on every rank, the slowest rank's time per
iteration, then the median and p99 over iterations. busbw = algbw * 2(n-1)/n.

    python3 scripts/peer_gloo_allreduce.py --ranks 4 --sizes 8:64M --dtype f32
"""
import argparse
import os
import sys

from benchtable import parse_sizes, print_table, row, run_ranks
import time


def default_iters(nbytes):
    # Same rule as tprun's bench (coordinator/src/bench.rs).
    return max(5, min(100, (32 << 20) // max(nbytes, 1)))


def worker(rank, world, args, init_file, q):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for nbytes in parse_sizes(args.sizes):
        count = nbytes // esize
        if count == 0:
            continue
        iters = args.iters or default_iters(count * esize)
        warmup = args.warmup if args.warmup is not None else max(2, iters // 10)
        times = []
        wrong = 0
        idx = torch.arange(count, dtype=torch.int64)
        for it in range(warmup + iters):
            x = (((idx * 7 + rank * 13 + it * 5) % 17).to(torch.float32) * 0.5 - 4.0).to(dtype)
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            t = time.perf_counter() - t0
            if it >= warmup:
                times.append(t * 1e6)
            if args.check:
                ref = sum(
                    (((idx * 7 + r * 13 + it * 5) % 17).to(torch.float32) * 0.5 - 4.0)
                    for r in range(world)
                ).to(dtype)
                wrong += int((x != ref).sum())
        everyone = [None] * world
        dist.all_gather_object(everyone, (times, wrong))
        if rank == 0:
            per_iter = [max(ts[k] for ts, _ in everyone) for k in range(len(times))]
            rows.append(row(count * esize, count, args.dtype, "gloo", per_iter, world,
                            sum(w for _, w in everyone)))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", default="8:64M")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"])
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        sys.exit("error: this benchmark needs PyTorch (pip install torch)")
    rows = run_ranks(worker, args.ranks, args)
    print_table(f"# gloo allreduce: {args.ranks} process(es), torch.distributed, in place", rows)


if __name__ == "__main__":
    main()
