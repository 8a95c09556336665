"""The GEMM-Residual-RMSNorm-GEMM block (KERNELS.md section 2): two epilogue GEMMs and an AUX.

    GEMM1 (gemm_residual_rms): h = residual + x @ w1; a = h * gamma; P = RED_m of h^2
    AUX:                       r = (sum_t P / d + eps)^-1/2
    GEMM2 (scale_rows):        z = r * (a @ w2)        VEC-LD COL r; EW

[I2.3]: (r * h * gamma) @ w2 == r * ((h * gamma) @ w2), so the norm never runs as a kernel of
its own. GEMM2 variants with a pairwise epilogue are ``gemm_swiglu`` and ``gemm_rope``.
Tests: tests/test_forward_kernels.py.
"""

from __future__ import annotations

import torch

from coda.kernels._launch import example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.gemm_residual_rms import (
    gemm_residual_rms_interpreted,
)
from coda.primitives import ColLoad, epilogue_program


@epilogue_program(inputs=[ColLoad("scale")])
def scale_rows(acc, scale):
    return {"D": acc * scale}


def gemm_scale_rows_kernel(a, w, scale, config: GemmConfig = DEFAULT, dry=False):
    """z = scale[:, None] * (a @ w) (bf16; the scale fp32 or bf16, widened on load); with
    ``dry`` only compiles. The row scale is RMSNorm's rstd in forward, gamma in a weight
    gradient (KERNELS.md 5.4)."""
    z = a.new_empty(a.shape[0], w.shape[1])
    compiled = launch(scale_rows, a, w, config=config, d=z, operands={"scale": scale}, dry=dry)
    return compiled if dry else z


def gemm_rmsnorm_gemm_kernel(
    x,
    w1,
    residual,
    gamma,
    w2,
    eps=1e-5,
    config1: GemmConfig = DEFAULT,
    config2: GemmConfig = DEFAULT,
):
    """Returns (h, z, r): GEMM1 + AUX, then GEMM2 with the deferred row scale (each launch a
    custom op while torch.compile traces)."""
    from coda.kernels import library  # its ops wrap this module's kernels

    h, a, r = library.gemm_residual_rms(x, w1, residual, gamma, eps, config1)
    return h, library.gemm_scale_rows(a, w2, r, config2), r


def gemm_rmsnorm_gemm_interpreted(
    x, w1, residual, gamma, w2, eps=1e-5, config1=DEFAULT, config2=DEFAULT
):
    """The same two programs and AUX through the tile interpreter (the CPU twin of
    ``gemm_rmsnorm_gemm_kernel``): fp32 accumulators, outputs rounded to x's dtype where the
    kernel rounds them (h and a as stored tiles, z as GEMM2's D). Returns (h, z, r)."""
    h, a, r, _ = gemm_residual_rms_interpreted(x, w1, residual, gamma, eps, config1)
    h, a = h.to(x.dtype), a.to(x.dtype)
    z = interpret_gemm(scale_rows, a, w2, config=config2, operands={"scale": r}, out_dtype=x.dtype)
    return h, z["D"], r


def compile_gemm_scale_rows(k, n, *, w_major="n", config=DEFAULT, m=256) -> int:
    a, w = example_operands(m, k, n, w_major)
    return gemm_scale_rows_kernel(a, w, torch.empty(m), config, dry=True)
