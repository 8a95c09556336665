"""dSwiGLU in the epilogue of the down-projection's dgrad GEMM (KERNELS.md B4 + A6).

    acc = ds = dx2 @ W_d^T       (M x f)
    z = rstd * u                 TILE-LD u (saved unscaled pre-activation, as the GEMM's C,
                                 one (gate, up) pair per output column); VEC-LD COL rstd
    dz_g = ds z_u sig (1 + z_g (1 - sig)),  dz_u = ds silu(z_g),  sig = sigmoid(z_g)
    D     = rstd * (dz_g, dz_u)  TILE-ST, bf16 M x 2f interleaved ("widen": one value in,
                                 a packed pair out): the A operand of the W_il dgrad (B6) and
                                 the B operand of its wgrad (B7)
    s     = silu(z_g) z_u        TILE-ST, recomputed: the operand of the W_d wgrad (B5)
    S[m, t] = sum (dz_g u_g + dz_u u_u)   RED_m: the norm-backward statistic, one GEMM early
AUX:  corr = -(rstd^3 / d) * sum_t S       (``coda.kernels.rmsnorm_bwd.norm_corr``)

Supported: bf16; f a multiple of 8. Tests: tests/test_backward_kernels.py.
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.primitives import (
    ColLoad,
    RowPartials,
    TileC,
    TileStore,
    epilogue_program,
    pack,
    sigmoid,
    unpack,
)
from coda.reference.swiglu import dswiglu_ref  # noqa: F401  (the kernel's reference)


@epilogue_program(
    inputs=[TileC(), ColLoad("rstd")],
    stores=[TileStore("s")],
    sinks=[RowPartials("stat")],
    mode="widen",
)
def dswiglu_rescaled(acc, c, rstd):
    ug, uu = unpack(c)
    zg, zu = ug * rstd, uu * rstd
    sig = sigmoid(zg)
    silu_g = zg * sig
    dzg = acc * zu * sig * (1.0 + zg * (1.0 - sig))
    dzu = acc * silu_g
    return {"D": pack(dzg * rstd, dzu * rstd), "s": silu_g * zu, "stat": dzg * ug + dzu * uu}


def dswiglu_kernel(dx, w_d, u, rstd, config: GemmConfig = DEFAULT, dry=False):
    """acc = dx @ w_d^T; returns (dz_tilde M x 2f, s M x f, stat partials M x T_N).
    ``w_d`` is the (f, d) down-projection weight; its transpose is a view."""
    M, f = dx.shape[0], w_d.shape[0]
    dz = torch.empty_like(u)
    outputs = {
        "s": dx.new_empty(M, f),
        "stat": dx.new_empty(M, config.grid(M, f)[1], dtype=acc_dtype(dx)),
    }
    compiled = launch(
        dswiglu_rescaled,
        dx,
        w_d.t(),
        config=config,
        d=dz,
        c=u,
        operands={"rstd": rstd},
        outputs=outputs,
        dry=dry,
    )
    return compiled if dry else (dz, outputs["s"], outputs["stat"])


def dswiglu_interpreted(dx, w_d, u, rstd, config: GemmConfig = DEFAULT):
    out = interpret_gemm(
        dswiglu_rescaled, dx, w_d.t(), config=config, operands={"c": u, "rstd": rstd}
    )
    return out["D"], out["s"], out["stat"]


def compile_dswiglu(d, f, *, config=DEFAULT, m=256) -> int:
    dx, w_dt = example_operands(m, d, f, "k")  # w_d^T of a row-major (f, d) weight: k-major
    u = torch.empty(m, 2 * f, dtype=torch.bfloat16)
    return dswiglu_kernel(dx, w_dt.t(), u, torch.empty(m), config, dry=True)
