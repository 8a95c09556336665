"""The LM head's final-norm backward (A4 + A5) with the target entries folded in: one Triton
program per block of token rows, for the programs that form their g = 1 gradients in the
forward (CE-S, CE-C).

Those programs hand back G, the softmax share of dL/dy (fp32, each row's target entry left
out), and coef, the target entries' per-row coefficient. With W the (V, d) rows of the LM
head's weight, y = h rstd gamma the GEMMs' normed operand and g the upstream gradient:

    Gf[m, j]  = G[m, j] + coef_m W[y_m, j]                 the target entry, exact in fp32
    S_m       = rstd_m sum_j Gf[m, j] h[m, j] gamma_j       (= sum_j Gf y, the norm's statistic)
    dh[m, j]  = g r_m gamma_j Gf[m, j] - (g S_m r_m^2 / d) h[m, j]    rounded once to h's dtype
    dgamma[j] = sum_m g r_m Gf[m, j] h[m, j]                           fp32

``head_norm_bwd_torch`` is that in torch: the CPU path, what a torch.compile trace fuses, and
the oracle. Why a kernel: the forward added the target entries into G (a read and a write of
G), summed S (a read of G), and the backward's Inductor form read G twice more (dh, then
dgamma's column sums): 0.27 ms of the d = 2048, V = 32768 LM head's 0.69 ms of row work at
16384 tokens (run 118). Here a program reads its rows' G, W[y] and h twice, S first and then
dh and dgamma's partial column sums, the second sweep in reverse so that the blocks read last
are still in L2, and one small launch sums the partials (no atomics: deterministic). g stays
on the device (no host sync).
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel, on_triton
from coda.kernels.linear_cross_entropy_bwd import final_norm_bwd_normed_scaled
from coda.kernels.norm_rows import col_sums_triton

BM, BD = 16, 256  # a program's token rows; the columns of d per step of its two sweeps


def head_norm_bwd_torch(G, coef, target, w_lm, h, gamma, rstd, g):
    """(dh in h's dtype, dgamma in G's dtype) from the softmax share G (M, d), the target
    coefficients coef (M,), the targets (out of range: coef 0), w_lm (d, V) in either layout,
    the final norm's input h, gamma and rstd, and the upstream gradient g (0-d)."""
    acc = G.dtype
    y = target.clamp(0, w_lm.shape[1] - 1).long()
    Gf = torch.addcmul(G, coef[:, None].to(acc), w_lm.t()[y].to(acc))
    S = rstd.to(acc) * (Gf * (h.to(acc) * gamma.to(acc))).sum(-1)
    return final_norm_bwd_normed_scaled(Gf, S, h, gamma, rstd, g)


def _head_norm_bwd_kernel(
    G, W, target, coef, h, gamma, rstd, g, dh, part, M, d, V, g_row, h_row, w_d, w_v,
    BM: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    live = rows < M
    r64 = rows.to(tl.int64)[:, None]
    y = tl.load(target + rows, mask=live, other=0)
    y = tl.minimum(tl.maximum(y, 0), V - 1).to(tl.int64)[:, None]
    c = tl.load(coef + rows, mask=live, other=0.0).to(ACC)
    r = tl.load(rstd + rows, mask=live, other=0.0).to(ACC)
    up = tl.load(g).to(ACC)
    s = tl.zeros([BM], dtype=ACC)
    for j0 in range(0, d, BD):  # S: the row sums of Gf h gamma
        cols = j0 + tl.arange(0, BD)
        cm = cols < d
        mask = live[:, None] & cm[None, :]
        w = tl.load(W + cols.to(tl.int64)[None, :] * w_d + y * w_v, mask=mask, other=0.0)
        gf = tl.load(G + r64 * g_row + cols[None, :], mask=mask, other=0.0).to(ACC)
        gf += c[:, None] * w.to(ACC)
        x = tl.load(h + r64 * h_row + cols[None, :], mask=mask, other=0.0).to(ACC)
        gam = tl.load(gamma + cols, mask=cm, other=0.0).to(ACC)
        s += tl.sum(gf * x * gam[None, :], 1)
    corr = -(up * s * r * r * r) / d  # -(g S r^2 / d), S = r s
    steps = tl.cdiv(d, BD)
    for i in range(0, steps):  # dh and dgamma's partials, last block first (still in L2)
        cols = (steps - 1 - i) * BD + tl.arange(0, BD)
        cm = cols < d
        mask = live[:, None] & cm[None, :]
        w = tl.load(W + cols.to(tl.int64)[None, :] * w_d + y * w_v, mask=mask, other=0.0)
        gf = tl.load(G + r64 * g_row + cols[None, :], mask=mask, other=0.0).to(ACC)
        gf += c[:, None] * w.to(ACC)
        x = tl.load(h + r64 * h_row + cols[None, :], mask=mask, other=0.0).to(ACC)
        gam = tl.load(gamma + cols, mask=cm, other=0.0).to(ACC)
        t = (up * r)[:, None] * gf
        out = t * gam[None, :] + corr[:, None] * x
        tl.store(dh + r64 * h_row + cols[None, :], out.to(dh.dtype.element_ty), mask=mask)
        tl.store(part + tl.program_id(0).to(tl.int64) * d + cols, tl.sum(t * x, 0), mask=cm)


def head_norm_bwd_triton(G, coef, target, w_lm, h, gamma, rstd, g):
    """``head_norm_bwd_torch`` (same arguments) in two launches: G (M, d) and h with unit
    column stride, coef, target, gamma and rstd contiguous. dh takes h's row stride."""
    M, d = h.shape
    assert G.stride(1) == 1 and h.stride(1) == 1, (G.stride(), h.stride())
    assert all(t.is_contiguous() for t in (coef, target, gamma, rstd)), "per-row / column tables"
    dh = torch.empty_strided((M, d), (h.stride(0), 1), dtype=h.dtype, device=h.device)
    blocks = cdiv(M, BM)
    part = torch.empty(blocks, d, dtype=G.dtype, device=G.device)
    if M:
        kernel(_head_norm_bwd_kernel)[(blocks,)](
            G, w_lm, target, coef, h, gamma, rstd, g, dh, part, M, d, w_lm.shape[1],
            G.stride(0), h.stride(0), w_lm.stride(0), w_lm.stride(1),
            BM=BM, BD=BD, ACC=acc_type(G), num_warps=4,
        )  # fmt: skip
    return dh, col_sums_triton(part, G.dtype)


def head_norm_backward(G, coef, target, w_lm, h, gamma, rstd, g):
    """The LM head's final-norm backward with its target entries (module docstring): the
    Triton program on the GPU, outside a torch.compile trace (which fuses the torch form
    itself), else the torch form. Returns (dh, dgamma in G's dtype)."""
    if not torch.compiler.is_compiling() and on_triton(G):
        return head_norm_bwd_triton(G, coef, target, w_lm, h, gamma, rstd, g)
    return head_norm_bwd_torch(G, coef, target, w_lm, h, gamma, rstd, g)


def compile_head_norm_bwd(arch: int = 90) -> int:
    """The kernel (fp32 G and tables, bf16 W, h and gamma, int64 targets) compiled for
    ``sm_{arch}`` on the CPU: the cubin's size."""
    pointers = {n: "*fp32" for n in ("G", "coef", "rstd", "g", "part")}
    pointers.update({n: "*bf16" for n in ("W", "h", "gamma", "dh")})
    pointers["target"] = "*i64"
    consts = {"BM": BM, "BD": BD, "ACC": tl.float32}
    return compile_sm90(_head_norm_bwd_kernel, pointers, consts, num_warps=4, arch=arch)
