"""Does a layer's down projection pay for the statistic it drops? A same-run A/B (session 42).

A decoder layer's last GEMM (F5: x2 = x1 + s @ W_d) ran the residual program that also sums
h^2 per N-tile (RED_m partials for an RMSNorm's rstd) and dropped the partials: that norm is
the next layer's entry norm, which computes its own. Since session 42 the layer runs the
statistic-free program (``gemm_residual_rms.residual_add``). This times, in one process at
each layer shape's F5 (M = 16384 tokens, the tuned "residual" tile of that (K, N)):

    sumsq   ``epilogue_gemm(stats=True)``: D = x1 + acc, and the sum-of-squares partials
    add     ``epilogue_gemm(stats=False)``: D = x1 + acc alone
    cublas  ``torch.addmm(x1, s, W_d)``: the same output through cuBLAS (the floor's part)

as medians over interleaved rounds (``_common.interleaved``), with each one's kernels (profiled)
and whether both coda programs give the same D (bitwise).

    python benchmarks/probe_residual_add.py [rounds]     (5 unless given)
"""

from __future__ import annotations

import json
import sys

import torch

from benchmarks._common import interleaved, probe_rows
from coda.kernels.gemm_residual_rms import epilogue_gemm
from coda.kernels.tuned import config_for

# (d, ffn): the layer benchmark's two widths and the 1B model's
SHAPES = ((2048, 5632), (2048, 8192), (4096, 11008))
TOKENS = 16384


def operands(M: int, f: int, d: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(f + d)
    bf = torch.bfloat16

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(bf)

    return {"s": rand(M, f), "w": rand(f, d, scale=f**-0.5), "x1": rand(M, d)}


def variants(o: dict, config) -> dict:
    return {
        "sumsq": lambda: epilogue_gemm(o["s"], o["w"], o["x1"], None, config)[0],
        "add": lambda: epilogue_gemm(o["s"], o["w"], o["x1"], None, config, stats=False)[0],
        "cublas": lambda: torch.addmm(o["x1"], o["s"], o["w"]),
    }


def main(rounds: int = 5) -> None:
    for d, f in SHAPES:
        o = operands(TOKENS, f, d)
        config = config_for("residual", TOKENS, f, d)
        fns = variants(o, config)
        same = bool(torch.equal(fns["sumsq"](), fns["add"]()))
        timed = interleaved(fns, rounds=rounds)
        row = {
            "M": TOKENS,
            "K": f,
            "N": d,
            "config": vars(config),
            "D_bitwise_equal": same,
            **probe_rows(fns, timed, top=3),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
