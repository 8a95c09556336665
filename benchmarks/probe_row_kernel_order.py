"""Does a compiled row kernel's first call decide its speed at later sizes? (session 39)

Run 169 profiled the LM head's dW cast (then ``fused(_scaled_cast)``, one Inductor kernel
compiled for dynamic shapes) at 2.1x its time in run 163 at both widths, with no code change
between: the one difference was that the host suite, whose ``LMHeadLoss`` is d=256, V=1024,
now ran first in the process. This times the cast at d=4096, V=128256 and d=2048, V=32768 in
a fresh process after a first call at ``first`` ("none": the big shapes first; "tiny": the
host suite's shape first), both through Inductor (``fused``) and through coda's Triton
kernel (``scaled_cast_triton``, what ``weight_grad_from_acc`` runs since session 39), CUDA
events, median of 30 calls, with the bandwidth each reaches. ``xs`` (session 40) times CE-S's
other (C, d) row pass the same two ways: dW's B operand xs = c (.) a, until then inside the
glue's Inductor kernels, now ``row_scaled_triton``, at the chunk shapes of both heads, and
the glue's per-row values (lse, K, c, coef from GEMM1's (C, T_N) statistics) through Inductor
(``fused(scaled_glue)``) and as ``scaled_glue_triton``. For passes this small an event pair
around one call includes the host's launch time (the GPU idles between calls): their GPU
time is the suites' kernel tables' (benchmarks/NOTES.md, session 40).

    python benchmarks/probe_row_kernel_order.py none|tiny [xs]
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from coda.kernels._launch import fused
from coda.kernels.ce_scaled_rows import (
    row_scaled_torch,
    row_scaled_triton,
    scaled_glue,
    scaled_glue_triton,
)
from coda.kernels.linear_cross_entropy_bwd import _scaled_cast, scaled_cast_triton

FORMS = {
    "inductor": lambda acc, g: fused(_scaled_cast)(acc, g, torch.bfloat16),
    "triton": lambda acc, g: scaled_cast_triton(acc, g, torch.bfloat16),
}


XS_FORMS = {
    "inductor": lambda a, c: fused(row_scaled_torch)(a, c),
    "triton": row_scaled_triton,
}


def median_ms(fn, args, reps: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cast_ms(form: str, d: int, V: int, reps: int = 30) -> float:
    acc = torch.randn(V, d, device="cuda")  # CE-S's (V, d)-major accumulator
    return median_ms(FORMS[form], (acc, torch.tensor(0.5, device="cuda")), reps)


def xs_ms(form: str, C: int, d: int, reps: int = 30) -> float:
    a = torch.randn(C, d, device="cuda").bfloat16()  # a chunk's normed rows
    return median_ms(XS_FORMS[form], (a, torch.rand(C, device="cuda")), reps)


GLUE_FORMS = {
    "inductor": lambda *args: fused(scaled_glue)(*args, 0.0, 0.0),
    "triton": lambda *args: scaled_glue_triton(*args, 0.0, 0.0),
}


def glue_ms(form: str, C: int, t_n: int, reps: int = 30) -> float:
    k = torch.randint(-40, 40, (C, t_n), device="cuda").float()
    s = 1.0 + 100.0 * torch.rand(C, t_n, device="cuda")
    rows = [torch.rand(C, device="cuda") for _ in range(3)]  # target logit, rstd, weight
    return median_ms(GLUE_FORMS[form], (s, k, *rows), reps)


def xs_rows(first: str) -> list[dict]:
    """xs at d = 2048 (one 16384-token chunk at V = 32768) and at d = 4096 and 2048 (a
    4096-token chunk at V = 128256): bf16 read and written, c read."""
    rows = []
    for form in XS_FORMS:
        if first == "tiny":
            xs_ms(form, 128, 256, reps=3)
        for C, d in ((16384, 2048), (4096, 4096), (4096, 2048)):
            ms = xs_ms(form, C, d)
            tbs = C * (4 * d + 4) / ms / 1e9
            rows.append({"pass": "xs", "first": first, "form": form, "C": C, "d": d, "ms": ms,
                         "TB/s": tbs})  # fmt: skip
    for form in GLUE_FORMS:  # the glue at V = 32768 (16384 rows) and V = 128256 (4096 rows)
        if first == "tiny":
            glue_ms(form, 128, 8, reps=3)
        for C, t_n in ((16384, 171), (4096, 668)):
            ms = glue_ms(form, C, t_n)
            rows.append({"pass": "glue", "first": first, "form": form, "C": C, "T_N": t_n,
                         "ms": ms, "TB/s": C * (8 * t_n + 28) / ms / 1e9})  # fmt: skip
    return rows


if __name__ == "__main__":
    first = sys.argv[1]
    if sys.argv[2:] == ["xs"]:
        print(json.dumps(xs_rows(first)))
        sys.exit()
    rows = []
    for form in FORMS:
        if first == "tiny":
            cast_ms(form, 256, 1024, reps=3)
        for d, V in ((4096, 128256), (2048, 32768)):
            ms = cast_ms(form, d, V)
            tbs = V * d * 6 / ms / 1e9  # fp32 read, bf16 written
            rows.append({"first": first, "form": form, "d": d, "V": V, "ms": ms, "TB/s": tbs})
    print(json.dumps(rows))
