"""Probe: the LM head's final-norm backward pass (``coda.kernels.final_norm_rows``) at each
launch shape of ``LAUNCH_SHAPES``, beside its torch form through Inductor (what it replaced).

Run 121 timed the pass inside the LM head at 126 us for M = 16384, d = 2048 (V = 32768), about
2.5 TB/s for the bytes it must move (G fp32, W's target rows, h and dh in bf16): this times
it alone on synthetic inputs of the LM heads' shapes at every candidate (BM, BD, P, warps),
each checked against the default's output, and reports us and the achieved bandwidth.
``gpu_suite.py`` runs it only when named (``--only head_norm_pass``).
"""

from __future__ import annotations

import torch

from benchmarks._common import Diagnostic, bench, out_of_time, progress

SUITE = "head_norm_pass"
SHAPES = {"d2048": (16384, 2048, 32768), "d4096": (16384, 4096, 128256)}  # (M, d, V)


def _inputs(M, d, V):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dt)

    bf = torch.bfloat16
    target = torch.randint(0, V, (M,), generator=g, device="cuda")
    target[::7] = -100
    return (
        rnd(M, d),  # G
        rnd(M) * (target >= 0),  # coef
        rnd(M),  # S
        target,
        rnd(V, d, dt=bf).t(),  # HF's (V, d) storage
        rnd(M, d, dt=bf),  # h
        1 + 0.1 * rnd(d, dt=bf),  # gamma
        rnd(M).abs() + 0.5,  # rstd
        torch.tensor(1.0, device="cuda"),  # g
    )


def run() -> list[dict]:
    from coda.kernels._launch import fused
    from coda.kernels.final_norm_rows import (
        LAUNCH,
        LAUNCH_SHAPES,
        head_norm_bwd_torch,
        head_norm_bwd_triton,
    )

    rows = []
    for name, (M, d, V) in SHAPES.items():
        args = _inputs(M, d, V)
        moved = M * d * (4 + 2 + 2 + 2)  # G, W[y], h read; dh written
        ref = head_norm_bwd_triton(*args)
        torch_form = fused(head_norm_bwd_torch)
        candidates = [("torch_form", lambda: torch_form(*args))]
        for shape in LAUNCH_SHAPES:
            candidates.append((shape, lambda s=shape: head_norm_bwd_triton(*args, launch=s)))
        for label, fn in candidates:
            if out_of_time():
                break
            dh, dgamma = fn()
            same_dh = bool(torch.equal(dh, ref[0]))
            dg_err = float((dgamma - ref[1]).abs().max() / ref[1].abs().max())
            us = bench(fn)["ms"] * 1e3
            shape = list(label) if isinstance(label, tuple) else label
            rows.append(
                progress(
                    {
                        "name": f"{SUITE}/{name}",
                        "M": M,
                        "d": d,
                        "V": V,
                        "launch": shape,
                        "default": label == LAUNCH,
                        "us": us,
                        "tb_per_s": moved / us * 1e-6,
                        "dh_equal_default": same_dh,
                        "dgamma_err_vs_default": dg_err,
                    }
                )
            )
    return rows


class Suite(Diagnostic):
    def run(self) -> list[dict]:
        return run()
