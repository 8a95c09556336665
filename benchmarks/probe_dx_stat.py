"""Where should CE-S's final-norm statistic be summed? A same-run A/B (session 41).

CE-S needs, per token row, S's softmax share sum_j G[m, j] a[m, j] (G the dX GEMM's fp32
output, a the GEMMs' normed bf16 operand). Until session 41 it was a pass of its own over G
after the dX GEMM (``norm_stat``, an Inductor kernel: 53-60 us at d=2048, 108 at d=4096 in the
LM head's kernel tables); since then the dX GEMM's epilogue sums it (a TILE-LD of a and a RED_m
sink beside its store of G). Session 27 tried S in the *logits* GEMM's epilogue instead and
could not resolve its cost across runs (benchmarks/NOTES.md); this times both forms in one
process, interleaved, at each head's chunk shape (d=2048, V=32768, 16384 rows; d=4096,
V=128256, 4096 rows):

    before  the dX program without the sink (defined here, as it was), then ``fused(norm_stat)``
    after   ``scaled_grad_dx_kernel`` (the sink), then ``norm_stat_rows`` (session 48: one
            launch from the sink's partials; ``norm_stat_from_dot`` of their sum until then)

and reports each one's median over interleaved rounds (``_common.interleaved``), its kernels'
GPU time (profiled), and that both give the same G (bitwise) and S (fp32 summation order:
the per-row relative difference is large on rows whose S cancels to near 0, so the normwise
one is reported beside it).

    python benchmarks/probe_dx_stat.py [rounds]     (5 unless given: run 177's count)
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks._common import interleaved, probe_rows
from coda.kernels._launch import fused, launch
from coda.kernels.ce_scaled_exp import STRIP, dx_config, scaled_grad_dx_kernel
from coda.kernels.ce_scaled_rows import norm_stat_rows
from coda.kernels.linear_cross_entropy_chunked import norm_stat
from coda.primitives import ColLoad, ScaleA, epilogue_program

SHAPES = ((2048, 32768, 16384), (4096, 128256, 4096))  # (d, V, rows of one token chunk)


@epilogue_program(inputs=[ColLoad("row_scale")], a_transform=ScaleA("u", tile_k=STRIP))
def dx_without_stat(acc, row_scale):
    return {"D": acc * row_scale}


def operands(d: int, V: int, C: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16

    def rand(*shape, dtype=torch.float32):
        return torch.rand(*shape, generator=g, device="cuda", dtype=dtype)

    return {
        "e": rand(C, V, dtype=bf),
        "w": ((rand(d, V) - 0.5) * d**-0.5).to(bf),
        "u": torch.exp2(-torch.randint(0, 4, (V // STRIP, C), generator=g, device="cuda")).to(bf),
        "c": rand(C),
        "a": (rand(C, d) - 0.5).to(bf),
        "rstd": rand(C) + 0.5,
        "coef": rand(C) - 0.5,
        "y_logit": rand(C) * 4,
    }


def before(o, G):
    launch(
        dx_without_stat,
        o["e"],
        o["w"].t(),
        config=dx_config(o["w"].shape[0]),
        d=G,
        operands={"row_scale": o["c"], "u": o["u"]},
    )
    return fused(norm_stat)(G, o["a"], o["rstd"], o["coef"], o["y_logit"])


def after(o, G):
    part = scaled_grad_dx_kernel(o["e"], o["w"], o["u"], o["c"], o["a"], G)
    return norm_stat_rows(part, o["rstd"], o["coef"], o["y_logit"])


def main(rounds: int = 5) -> None:
    rows = []
    for d, V, C in SHAPES:
        o = operands(d, V, C)
        G0, G1 = (torch.empty(C, d, device="cuda") for _ in range(2))
        S0, S1 = before(o, G0), after(o, G1)
        torch.cuda.synchronize()
        fns = {"before": lambda o=o, G=G0: before(o, G), "after": lambda o=o, G=G1: after(o, G)}
        timed = interleaved(fns, rounds=rounds)
        rows.append(
            {
                "d": d,
                "V": V,
                "rows": C,
                "G_bitwise_equal": bool(torch.equal(G0, G1)),
                # per row (large where S nears 0: random operands cancel), and normwise
                "S_max_rel_diff": ((S0 - S1).abs() / S0.abs().clamp_min(1e-30)).max().item(),
                "S_diff_over_max_S": ((S0 - S1).abs().max() / S0.abs().max()).item(),
                **probe_rows(fns, timed, top=4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
