#!/usr/bin/env python3
"""The device copy bandwidth the GPU scripts compare against: torch copies 1 GiB on each GPU
given (default 0), 3 warm-up copies then 10 timed with CUDA events; bytes read and written
both count. Prints one line per GPU, then the mean:

    GPU 0 (NVIDIA H100 80GB HBM3): device copy 1 GiB: 3.03 TB/s (read + write)
    per-GPU copy: 3028.3 GB/s

    scripts/device/copy_bw.py [DEVICES]      DEVICES: comma-separated ordinals, repeats allowed
"""
import sys

import torch

devices = sorted({int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "0").split(",") if x})
rates = []
for d in devices:
    torch.cuda.set_device(d)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(10):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    t = s.elapsed_time(e) / 10 / 1e3
    rates.append(2 * (1 << 30) / t / 1e9)
    print(f"GPU {d} ({torch.cuda.get_device_name(d)}): device copy 1 GiB: {rates[-1] / 1e3:.2f} TB/s (read + write)")
    del x, y
    torch.cuda.empty_cache()
print(f"per-GPU copy: {sum(rates) / len(rates):.1f} GB/s")
