"""Weight gradients (KERNELS.md 5.4: B3, B5, B7, B9, B13).

    dW = x^T @ dz                         plain: B3 (LM head), B5 (down), B9 (O proj)
    dW = gamma (rows) * (h^T @ dz~)       B7 (gate/up), B13 (QKV): the norm's gamma scales
                                          the wgrad output's rows (its input features), in
                                          the epilogue (VEC-LD COL gamma), so a = h * gamma
                                          is never saved
The plain ones have no epilogue and run on cuBLAS (``torch.mm``): at every layer shape the
benchmarks record, cuBLAS is at least as fast as quack's raw mainloop for them.
"""

from __future__ import annotations

import torch

from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.gemm_rmsnorm_gemm import gemm_scale_rows_kernel
from coda.kernels.tuned import config_for


def wgrad(x, dz):
    """dW = x^T @ dz (bf16)."""
    return torch.mm(x.t(), dz)


def wgrad_gamma_rows(h, dz, gamma, config: GemmConfig | None = None, dry=False):
    """dW = gamma[:, None] * (h^T @ dz): h (M, d) row-major enters as an M-major A operand.
    ``config`` None: the tuned tile for this shape, chosen here, where the token count M (this
    GEMM's K) is a plain int: under torch.compile with dynamic shapes M is symbolic in the
    autograd Functions, and a table lookup on it there would recompile per token count."""
    if config is None:
        config = config_for("wgrad", h.shape[1], h.shape[0], dz.shape[1])
    # gamma in its own dtype: the epilogue widens it on load (exactly), where a cast to fp32
    # was a launch per call
    return gemm_scale_rows_kernel(h.t(), dz, gamma, config, dry=dry)


def compile_wgrad_gamma_rows(d, n, *, config=DEFAULT, m=256, gamma=torch.bfloat16) -> int:
    """dW (d, n) = gamma * (h^T @ dz): h (m, d) and dz (m, n), both row-major activations;
    ``gamma``: the gain's dtype (fp32: a ``norm_offset`` layer's 1 + w)."""
    h = torch.empty(m, d, dtype=torch.bfloat16)
    dz = torch.empty(m, n, dtype=torch.bfloat16)
    return wgrad_gamma_rows(h, dz, torch.empty(d, dtype=gamma), config, dry=True)
