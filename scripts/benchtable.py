"""Shared by the peer benchmarks (gloo, NCCL): tprun's size syntax, launching one process per
rank, and tprun's table columns, so that the tables line up with `tprun bench allreduce`."""
import os
import tempfile


def parse_bytes(s):
    s = s.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def parse_sizes(s):
    """'8:64M' -> 8, 16, ..., 64M (doubling); '4K,1M' -> a list."""
    if ":" in s:
        lo, hi = (parse_bytes(x) for x in s.split(":"))
        out = []
        while lo <= hi:
            out.append(lo)
            lo *= 2
        return out
    return [parse_bytes(x) for x in s.split(",")]


def row(nbytes, count, dtype, algo, per_iter_us, world, wrong):
    """One table row from the per-iteration times (slowest rank already taken)."""
    per = sorted(per_iter_us)
    med = per[len(per) // 2] if len(per) % 2 else (per[len(per) // 2 - 1] + per[len(per) // 2]) / 2
    p99 = per[round((len(per) - 1) * 0.99)]
    algbw = nbytes / (med * 1e-6) / 1e9
    busbw = algbw * 2 * (world - 1) / world
    return (nbytes, count, dtype, algo, med, p99, algbw, busbw, wrong)


def run_ranks(worker, ranks, args):
    """Starts `ranks` processes running worker(rank, world, args, init_file, queue); returns
    what rank 0 puts on the queue."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init_file = os.path.join(d, "init")
        procs = [ctx.Process(target=worker, args=(r, ranks, args, init_file, q)) for r in range(ranks)]
        for p in procs:
            p.start()
        rows = q.get()
        for p in procs:
            p.join()
    return rows


def print_table(title, rows):
    print(title)
    print(f"{'size(B)':>12} {'count':>12} {'type':>5} {'algo':>13} {'time(us)':>10} {'p99(us)':>10}"
          f" {'algbw':>9} {'busbw':>9} {'#wrong':>7}")
    for r in rows:
        print(f"{r[0]:>12} {r[1]:>12} {r[2]:>5} {r[3]:>13} {r[4]:>10.2f} {r[5]:>10.2f}"
              f" {r[6]:>9.3f} {r[7]:>9.3f} {r[8]:>7}")
