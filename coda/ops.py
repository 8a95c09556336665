"""coda's torch-facing fused ops: validate, pick the path, run.

Each op takes ordinary torch tensors, checks them (a clear ``CodaInputError`` naming the
argument and the rule), picks the kernel path on an SM90 GPU or the pure-torch reference path
elsewhere (``coda.env``: reported, never silent), and returns plain tensors. Weights are
(in, out) matrices: ``y = x @ w``; an ``nn.Linear`` weight ``W`` is passed as ``W.t()``
(a view, no copy: the kernel takes either major order).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from coda import _validate as v
from coda.env import resolve_backend
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.gemm_residual_rms import gemm_residual_rms_kernel
from coda.reference.rmsnorm import gemm_residual_rms_ref

KERNEL_DTYPES = (torch.bfloat16,)
REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class ResidualRMS(NamedTuple):
    h: torch.Tensor  # residual + x @ w, the new residual stream (x.dtype)
    normed: Optional[torch.Tensor]  # h * gamma (x.dtype), GEMM2's A operand; None without gamma
    rstd: torch.Tensor  # (M,) fp32: (mean(h^2) + eps)^-1/2, applied in GEMM2's epilogue


def gemm_residual_rms(
    x: torch.Tensor,
    w: torch.Tensor,
    residual: torch.Tensor,
    gamma: Optional[torch.Tensor] = None,
    *,
    eps: float = 1e-5,
    backend: str = "auto",
    config: GemmConfig = DEFAULT,
) -> ResidualRMS:
    """h = residual + x @ w; normed = h * gamma; rstd = RMSNorm's row scale of h.

    x (M, K), w (K, N), residual (M, N), gamma (N,). RMSNorm(h) * gamma == rstd[:, None] *
    normed, and (RMSNorm(h) * gamma) @ w2 == rstd[:, None] * (normed @ w2): the row scale is
    deferred to the next GEMM's epilogue (KERNELS.md [I2.3])."""
    v.check_matrix("x", x)
    M, K = x.shape
    v.check_matrix("w", w, rows=("x.shape[1]", K))
    N = w.shape[1]
    v.check_matrix("residual", residual, rows=("x.shape[0]", M), cols=("w.shape[1]", N))
    if gamma is not None:
        v.check_vector("gamma", gamma, ("w.shape[1]", N))
    named = {"x": x, "w": w, "residual": residual, "gamma": gamma}
    device = v.check_same_device(named)
    path = resolve_backend("gemm_residual_rms", backend, device)
    if path == "kernel":
        v.check_float_dtypes(named, KERNEL_DTYPES)
        v.check_tma_operand("x", x)
        v.check_tma_operand("w", w, either_major=True)
        v.check_tma_operand("residual", residual)
        if gamma is not None and not gamma.is_contiguous():
            raise v.CodaInputError("gamma: must be contiguous")
        return ResidualRMS(*gemm_residual_rms_kernel(x, w, residual, gamma, eps, config))
    v.check_float_dtypes(named, REFERENCE_DTYPES)
    h, a, r = gemm_residual_rms_ref(x, w, residual, gamma, eps)
    return ResidualRMS(h.to(x.dtype), None if a is None else a.to(x.dtype), r.float())
