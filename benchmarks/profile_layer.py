"""Where a coda layer's training step spends its time: torch.profiler over forward+backward
of one DecoderLayer (M = 16384, d from the command line), kernels ranked by CUDA time.

    python benchmarks/profile_layer.py 2048
"""

from __future__ import annotations

import sys

import torch

import coda.nn as cnn
from benchmarks.bench_forward import ffn, heads


def main(d: int):
    f, (H, Hkv) = ffn(d), heads(d)
    layer = cnn.DecoderLayer(d, H, Hkv, f, device="cuda", backend="kernel")
    x = torch.randn(4, 4096, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for _ in range(3):
        layer(x).backward(dy)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x).backward(dy)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 5 / 1e3
    print(f"d={d}: {total:.3f} ms of kernel time per step")
    for e in events[:28]:
        print(f"{e.device_time_total / 5 / 1e3:8.3f} ms {e.count // 5:3d}x  {e.key[:110]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2048)
