"""Does a compiled row kernel's first call decide its speed at later sizes? (session 39)

Run 169 profiled the LM head's dW cast (``weight_grad_from_acc``, one Inductor kernel) at
2.1x its time in run 163 at both widths, with no code change between: the one difference was
that the host suite, whose ``LMHeadLoss`` is d=256, V=1024, now runs first in the process.
This times the cast at d=4096, V=128256 in a fresh process after a first call at ``first``
("none": the big shape first; "tiny-bf16" / "tiny-fp32": the host suite's shape with a bf16
or an fp32 weight), CUDA events, median of 30 calls.

    python benchmarks/probe_row_kernel_order.py none|tiny-bf16|tiny-fp32
"""

from __future__ import annotations

import statistics
import sys

import torch

from coda.kernels.linear_cross_entropy_bwd import weight_grad_from_acc


def cast_ms(d: int, V: int, dtype, reps: int = 30) -> float:
    acc = torch.randn(V, d, device="cuda").t()  # CE-S's (V, d)-major accumulator
    like = torch.empty(V, d, device="cuda", dtype=dtype).t()  # LMHeadLoss's weight.t()
    g = torch.tensor(0.5, device="cuda")
    for _ in range(3):
        weight_grad_from_acc(acc, g, like)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        weight_grad_from_acc(acc, g, like)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


if __name__ == "__main__":
    first = sys.argv[1]
    if first != "none":
        cast_ms(256, 1024, torch.bfloat16 if first == "tiny-bf16" else torch.float32, reps=3)
    big = cast_ms(4096, 128256, torch.bfloat16)
    small = cast_ms(2048, 32768, torch.bfloat16)
    print(f"first={first}: d=4096 V=128256 {big:.3f} ms; d=2048 V=32768 {small:.3f} ms")
