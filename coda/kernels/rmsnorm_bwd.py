"""RMSNorm backward with the deferred row scale, in the dgrad GEMM's epilogue
(KERNELS.md 5.3: B2, B6, B12 with their AUX A4/A5, A6/A7, A9).

    acc = dz~ @ W2^T               (M x d), dz~ = rstd * dz from the producer of dz
    dh  = gamma * acc + corr * h (+ dres)   VEC-LD ROW gamma, VEC-LD COL corr, TILE-LD h,
                                            TILE-LD dres as the GEMM's C (residual gradient)
    TILE-ST dh (bf16)
    Q[i, j] = sum_{m in M-tile i} acc * h   RED_n: dgamma partials
AUX:  dgamma = sum_i Q (rounded once to gamma's dtype);   corr = -(rstd^3 / d) * S
      (S from the producer's RED_m partials)

Supported: bf16, d a multiple of 8. Tests: tests/test_backward_kernels.py.
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.norm_rows import CORR, col_sums, row_stat
from coda.primitives import ColLoad, ColPartials, RowLoad, TileC, TileLoad, epilogue_program
from coda.reference.rmsnorm import norm_bwd_apply_ref  # noqa: F401  (the kernel's reference)


@epilogue_program(
    inputs=[TileC(), TileLoad("h"), RowLoad("gamma"), ColLoad("corr")],
    sinks=[ColPartials("dgamma", scaled=True)],
)
def norm_bwd_residual(acc, c, h, gamma, corr):
    return {"D": acc * gamma + corr * h + c, "dgamma": (acc, h)}


@epilogue_program(
    inputs=[TileLoad("h"), RowLoad("gamma"), ColLoad("corr")],
    sinks=[ColPartials("dgamma", scaled=True)],
)
def norm_bwd(acc, h, gamma, corr):
    return {"D": acc * gamma + corr * h, "dgamma": (acc, h)}


def norm_corr(rstd, stat_partials, d: int):
    """AUX: corr = -(rstd^3 / d) * sum_t S[m, t] (fp32)."""
    return row_stat(stat_partials, rstd, d, mode=CORR)


def norm_bwd_kernel(dz, w2, h, gamma, corr, dres=None, config: GemmConfig = DEFAULT, dry=False):
    """acc = dz @ w2^T (``w2`` is the (d, N2) forward weight); returns (dh, dgamma in gamma's
    dtype, summed in fp32)."""
    M, d = dz.shape[0], w2.shape[0]
    dh = dz.new_empty(M, d)
    parts = dz.new_empty(config.grid(M, d)[0], d, dtype=acc_dtype(dz))
    program = norm_bwd if dres is None else norm_bwd_residual
    compiled = launch(
        program,
        dz,
        w2.t(),
        config=config,
        d=dh,
        c=dres,
        operands={"h": h, "gamma": gamma, "corr": corr},
        outputs={"dgamma": parts},
        dry=dry,
    )
    return compiled if dry else (dh, col_sums(parts, gamma.dtype))


def norm_bwd_interpreted(dz, w2, h, gamma, corr, dres=None, config: GemmConfig = DEFAULT):
    program = norm_bwd if dres is None else norm_bwd_residual
    operands = {"h": h, "gamma": gamma, "corr": corr, **({} if dres is None else {"c": dres})}
    out = interpret_gemm(program, dz, w2.t(), config=config, operands=operands)
    return out["D"], col_sums(out["dgamma"], gamma.dtype)


def compile_norm_bwd(n2, d, *, residual: bool, config=DEFAULT, m=256, gamma=torch.bfloat16):
    """Compile for sm_90a without a GPU; ``gamma``: the gain's dtype (fp32: a
    ``norm_offset`` layer's 1 + w). Returns compiles done."""
    dz, w2t = example_operands(m, n2, d, "k")
    bf = torch.bfloat16
    h, g = torch.empty(m, d, dtype=bf), torch.empty(d, dtype=gamma)
    dres = torch.empty(m, d, dtype=bf) if residual else None
    return norm_bwd_kernel(dz, w2t.t(), h, g, torch.empty(m), dres, config, dry=True)
