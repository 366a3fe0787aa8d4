#!/usr/bin/env python3
"""Peer benchmark for `tprun bench allreduce` on GPUs: torch.distributed with NCCL.

One process per GPU, the same sizes and columns as tprun (size, count, type, algo, median and
p99 time, algbw, busbw, #wrong). Times are CUDA-graph replays of one in-place all_reduce:
batches of back-to-back replays timed with CUDA events; the median and p99 over batches of the
per-call time, slowest rank. busbw = algbw * 2(n-1)/n. NVLink multicast (NVLS) stays off.

    python3 scripts/peer_nccl_allreduce.py --ranks 4 --sizes 8:256M --dtype bf16
"""
import argparse
import os
import sys

from benchtable import parse_sizes, print_table, row, run_ranks

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def worker(rank, world, args, init_file, q):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for nbytes in parse_sizes(args.sizes):
        count = nbytes // esize
        if count == 0:
            continue
        idx = torch.arange(count, device="cuda", dtype=torch.int64)
        vals = lambda r: (((idx * 7 + r * 13 + 5) % 17).to(torch.float32) * 0.5 - 4.0)
        x = vals(rank).to(dtype)
        dist.all_reduce(x)
        ref = sum(vals(r) for r in range(world)).to(dtype)
        wrong = int((x != ref).sum())
        # Capture one all_reduce in a graph (on a side stream, as torch requires).
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dist.all_reduce(x)
        per_batch = max(1, min(100, (64 << 20) // nbytes))
        batches = args.batches
        times = []
        for b in range(batches + 2):
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            st.record()
            for _ in range(per_batch):
                g.replay()
            en.record()
            torch.cuda.synchronize()
            if b >= 2:
                times.append(st.elapsed_time(en) * 1e3 / per_batch)
        everyone = [None] * world
        dist.all_gather_object(everyone, (times, wrong))
        if rank == 0:
            per = [max(ts[k] for ts, _ in everyone) for k in range(len(times))]
            rows.append(row(count * esize, count, args.dtype, "nccl", per, world,
                            sum(w for _, w in everyone)))
        del g
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", default="8:256M")
    ap.add_argument("--dtype", default="bf16", choices=["f32", "f16", "bf16"])
    ap.add_argument("--batches", type=int, default=20)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        sys.exit("error: this benchmark needs PyTorch with CUDA")
    if torch.cuda.device_count() < args.ranks:
        sys.exit(f"error: NCCL needs one GPU per rank: {args.ranks} ranks, "
                 f"{torch.cuda.device_count()} GPU(s)")
    rows = run_ranks(worker, args.ranks, args)
    print_table(f"# nccl allreduce: {args.ranks} process(es), torch.distributed, CUDA-graph replay, in place", rows)


if __name__ == "__main__":
    main()
