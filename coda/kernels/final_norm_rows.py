"""The LM head's final-norm backward (A4 + A5) as one Triton pass: a candidate, off
(``ONE_PASS``) because on the H200 it was not faster than the Inductor form it would replace.

From the LM head's fp32 gradients at an upstream gradient of 1, G = dL/dy (M, d) and the row
statistic S = sum_j G y (y = h rstd gamma, the GEMMs' normed operand), and the upstream g:

    dh[m, j]  = g r_m gamma_j G[m, j] - (g S_m r_m^2 / d) h[m, j]     (rounded once, h's dtype)
    dgamma[j] = sum_m g r_m G[m, j] h[m, j]                            (fp32)

which is ``linear_cross_entropy_bwd.final_norm_bwd_normed_scaled`` (the oracle and the CPU
path). Through ``fused`` Inductor makes three kernels of it that read G twice: 0.21 ms at
M = 16384, d = 2048 (benchmarks/NOTES.md, session 8; traffic ~0.08 ms). Here each program
reads one (BM x BD) tile of G and h once, writes its tile of dh and the column sums of its
dgamma terms as one row of per-block partials, summed by one small torch reduction (no
atomics: deterministic). g stays on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._launch import acc_dtype, fused
from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel, on_triton
from coda.kernels.linear_cross_entropy_bwd import (
    final_norm_bwd_normed,
    final_norm_bwd_normed_scaled,
)

# the Triton pass on the GPU instead of Inductor's form: off. The whole LM-head call with it
# (the bench's coda_norm_pass) read 1.085x its floor against the default's 1.069x at d=2048
# and 1.041x against 1.041x at d=4096 (run 31, interleaved); its kernel took 0.118 ms and the
# partials' reduction 0.020 at d=2048, against Inductor's 0.066 + 0.064 + 0.002 (run 31's
# kernel tables): at ~2x its traffic time, this tile shape is not yet a win
ONE_PASS = False
BM, BD = 32, 256  # a program's tile: token rows x columns of d


def _final_norm_bwd_kernel(
    G, h, gamma, rstd, S, g, dh, part, M, d, g_row, h_row,
    BM: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    live = rows < M
    cm = cols < d
    mask = live[:, None] & cm[None, :]
    r64 = rows.to(tl.int64)[:, None]
    up = tl.load(g).to(ACC)
    r = tl.load(rstd + rows, mask=live, other=0.0).to(ACC)
    s = tl.load(S + rows, mask=live, other=0.0).to(ACC)
    corr = -(up * s * r * r) / d
    gam = tl.load(gamma + cols, mask=cm, other=0.0).to(ACC)
    t = (up * r)[:, None] * tl.load(G + r64 * g_row + cols[None, :], mask=mask, other=0.0).to(ACC)
    x = tl.load(h + r64 * h_row + cols[None, :], mask=mask, other=0.0).to(ACC)
    out = t * gam[None, :] + corr[:, None] * x
    tl.store(dh + r64 * h_row + cols[None, :], out.to(dh.dtype.element_ty), mask=mask)
    tl.store(part + tl.program_id(0).to(tl.int64) * d + cols, tl.sum(t * x, 0), mask=cm)


def final_norm_bwd_triton(G, S, h, gamma, rstd, g):
    """``final_norm_bwd_normed_scaled`` (same arguments, g a 0-d tensor) in one pass: G (M, d)
    fp32 and h (M, d) with unit column stride, the rest contiguous. Returns (dh in h's dtype
    and h's row stride, dgamma fp32 (float64 for float64 inputs))."""
    M, d = h.shape
    assert G.stride(1) == 1 and h.stride(1) == 1, (G.stride(), h.stride())
    assert all(t.is_contiguous() for t in (gamma, rstd, S)), "per-row / per-column tables"
    dh = torch.empty_strided((M, d), (h.stride(0), 1), dtype=h.dtype, device=h.device)
    blocks = cdiv(M, BM)
    part = torch.empty(blocks, d, dtype=acc_dtype(G), device=G.device)
    if M:
        kernel(_final_norm_bwd_kernel)[(blocks, cdiv(d, BD))](
            G, h, gamma, rstd, S, g, dh, part, M, d, G.stride(0), h.stride(0),
            BM=BM, BD=BD, ACC=acc_type(G), num_warps=8,
        )  # fmt: skip
    return dh, part.sum(0)


def final_norm_backward(G, S, h, gamma, rstd, g=None):
    """The LM head's final-norm backward: (dh, dgamma fp32) from its g = 1 gradients G, S and
    the upstream gradient g (None: already applied). The Triton pass where ``ONE_PASS`` and
    the tensors are on the GPU (outside a torch.compile trace, which fuses the torch form
    itself), else the torch form through ``fused``."""
    if ONE_PASS and on_triton(G) and not torch.compiler.is_compiling():
        up = g if g is not None else torch.ones((), dtype=G.dtype, device=G.device)
        return final_norm_bwd_triton(G, S, h, gamma, rstd, up)
    if g is None:
        return fused(final_norm_bwd_normed)(G, S, h, gamma, rstd)
    return fused(final_norm_bwd_normed_scaled)(G, S, h, gamma, rstd, g)


def compile_final_norm_bwd(arch: int = 90) -> int:
    """The kernel (fp32 G and tables, bf16 h and gamma) compiled for ``sm_{arch}`` on the CPU:
    the cubin's size."""
    pointers = {n: "*fp32" for n in ("G", "rstd", "S", "g", "part")}
    pointers.update({n: "*bf16" for n in ("h", "gamma", "dh")})
    consts = {"BM": BM, "BD": BD, "ACC": tl.float32}
    return compile_sm90(_final_norm_bwd_kernel, pointers, consts, num_warps=8, arch=arch)
