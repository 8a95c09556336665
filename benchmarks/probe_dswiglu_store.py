"""Probe: what the dSwiGLU epilogue's recomputed ``s`` store costs (issue 8's lead).

Times, round-robin, the down projection's dgrad three ways at a layer's shape: cuBLAS's plain
GEMM, coda's dSwiGLU kernel as the layer runs it (dz~, s and the statistic stored), and the
same program without the ``s`` store (what it would run if the forward kept s for backward).
Writes one JSON object to stdout. Run from the repository root with it on ``PYTHONPATH``."""

from __future__ import annotations

import json
import sys

import torch

from benchmarks._common import interleaved
from coda.kernels import dswiglu as dsw
from coda.kernels._launch import acc_dtype, launch
from coda.kernels.tuned import config_for
from coda.primitives import ColLoad, RowPartials, TileC, epilogue_program


@epilogue_program(inputs=[TileC(), ColLoad("rstd")], sinks=[RowPartials("stat")], mode="widen")
def dswiglu_no_s(acc, c, rstd):
    """The kernel's own program with its ``s`` store left out (its product is then dead)."""
    out = dsw.dswiglu_rescaled.fn(acc, c, rstd)
    del out["s"]
    return out


def main():
    out = {}
    for M, d, f in [(16384, 2048, 5632), (16384, 2048, 8192), (16384, 4096, 14336)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        dx = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, generator=g)
        w_d = torch.randn(f, d, device="cuda", dtype=torch.bfloat16, generator=g) / d**0.5
        u = torch.randn(M, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g)
        rstd = torch.rand(M, device="cuda", generator=g) + 0.5
        cfg = config_for("dswiglu", M, d, f)
        dz = torch.empty_like(u)
        stat = dx.new_empty(M, cfg.grid(M, f)[1], dtype=acc_dtype(dx))

        def no_s():
            launch(
                dswiglu_no_s,
                dx,
                w_d.t(),
                config=cfg,
                d=dz,
                c=u,
                operands={"rstd": rstd},
                outputs={"stat": stat},
            )

        # the two programs agree on what both store
        dz0, _, st0 = dsw.dswiglu_kernel(dx, w_d, u, rstd, cfg)
        no_s()
        torch.cuda.synchronize()
        same = bool(torch.equal(dz0, dz)) and bool(torch.equal(st0, stat))
        t = interleaved(
            {
                "cublas": lambda: dx @ w_d.t(),
                "dswiglu": lambda: dsw.dswiglu_kernel(dx, w_d, u, rstd, cfg),
                "dswiglu_no_s": no_s,
            }
        )
        out[f"M{M}_d{d}_f{f}"] = {
            "config": str(cfg),
            "same_dz_and_stat": same,
            **{k: {"ms": v["ms"], "rounds_ms": v["rounds_ms"]} for k, v in t.items()},
        }
        print(
            f"M{M} d{d} f{f}",
            {k: round(v["ms"], 4) for k, v in t.items()},
            same,
            file=sys.stderr,
            flush=True,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
