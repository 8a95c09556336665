"""Does a compiled row kernel's first call decide its speed at later sizes? (session 39)

Run 169 profiled the LM head's dW cast (then ``fused(_scaled_cast)``, one Inductor kernel
compiled for dynamic shapes) at 2.1x its time in run 163 at both widths, with no code change
between: the one difference was that the host suite, whose ``LMHeadLoss`` is d=256, V=1024,
now ran first in the process. This times the cast at d=4096, V=128256 and d=2048, V=32768 in
a fresh process after a first call at ``first`` ("none": the big shapes first; "tiny": the
host suite's shape first), both through Inductor (``fused``) and through coda's Triton
kernel (``scaled_cast_triton``, what ``weight_grad_from_acc`` runs since session 39), CUDA
events, median of 30 calls, with the bandwidth each reaches.

    python benchmarks/probe_row_kernel_order.py none|tiny
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from coda.kernels._launch import fused
from coda.kernels.linear_cross_entropy_bwd import _scaled_cast, scaled_cast_triton

FORMS = {
    "inductor": lambda acc, g: fused(_scaled_cast)(acc, g, torch.bfloat16),
    "triton": lambda acc, g: scaled_cast_triton(acc, g, torch.bfloat16),
}


def cast_ms(form: str, d: int, V: int, reps: int = 30) -> float:
    acc = torch.randn(V, d, device="cuda")  # CE-S's (V, d)-major accumulator
    g = torch.tensor(0.5, device="cuda")
    for _ in range(3):
        FORMS[form](acc, g)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        FORMS[form](acc, g)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


if __name__ == "__main__":
    first = sys.argv[1]
    rows = []
    for form in FORMS:
        if first == "tiny":
            cast_ms(form, 256, 1024, reps=3)
        for d, V in ((4096, 128256), (2048, 32768)):
            ms = cast_ms(form, d, V)
            tbs = V * d * 6 / ms / 1e9  # fp32 read, bf16 written
            rows.append({"first": first, "form": form, "d": d, "V": V, "ms": ms, "TB/s": tbs})
    print(json.dumps(rows))
