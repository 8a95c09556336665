"""The LM head's final-norm backward (A4 + A5) with the target entries folded in: one Triton
pass over the token rows, for the programs that form their g = 1 gradients in the forward
(CE-S, CE-C).

Those programs hand back G, the softmax share of dL/dy (fp32, each row's target entry left
out), coef, the target entries' per-row coefficient, and the norm's statistic S = sum_j
(dL/dy)_j y_j (``linear_cross_entropy_chunked.norm_stat``: G's row dot plus coef l_y; CE-S's
dX GEMM sums the row dot in its epilogue, CE-C's is a pass over G). With
W the (V, d) rows of the LM head's weight, y = h rstd gamma the GEMMs' normed operand and g
the upstream gradient:

    Gf[m, j]  = G[m, j] + coef_m W[y_m, j]                 the target entry, exact in fp32
    dh[m, j]  = g r_m gamma_j Gf[m, j] - (g S_m r_m^2 / d) h[m, j]    rounded once to h's dtype
    dgamma[j] = sum_m g r_m Gf[m, j] h[m, j]                           fp32

W's rows enter rounded to h's dtype, as the GEMMs read W (under autocast the fp32 weight:
the same values as the forward's bf16 copy, which is not kept). ``head_norm_bwd_torch`` is
that in torch: the CPU path, what a torch.compile trace fuses, and the oracle. Why a kernel:
the forward added the target entries into G (a read and a write of G, 80 us at d = 2048,
16384 tokens) and the backward's Inductor form read G twice (dh, then dgamma's column sums,
128 us; run 118). Here each program takes a column block of d and every P-th block of token
rows, reads G, W[y] and h once, writes dh, and keeps its column block's dgamma terms in
registers across its rows: P rows of partials, summed by one small launch (no atomics:
deterministic). g stays on the device (no host sync). S is not summed here: the program
would need a row's every column block before its first dh (two sweeps over G were measured
slower: benchmarks/NOTES.md, session 27).
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel, on_triton
from coda.kernels.linear_cross_entropy_bwd import final_norm_bwd_normed_scaled
from coda.kernels.norm_rows import col_sums_triton

# (token rows per step, columns of d, row groups = programs per column block = rows of
# dgamma's partials, warps). ``benchmarks/probe_head_norm.py`` timed the candidates alone
# (run 122, M = 16384, L2 flushed): 32 x 128 over 256 row groups at 4 warps 103.5 us at
# d = 2048 and 184.6 at d = 4096 (3.2-3.6 TB/s), the first shape 130.6 and 238.6; the torch
# form through Inductor 297.5 and 549.0
LAUNCH = (32, 128, 256, 4)
LAUNCH_SHAPES = (
    (32, 256, 128, 8), (16, 256, 128, 4), (32, 128, 256, 4), (64, 256, 64, 8),
    (32, 512, 128, 8), (16, 512, 256, 8), (32, 256, 264, 8), (64, 128, 128, 8),
)  # fmt: skip


def head_norm_bwd_torch(G, coef, S, target, w_lm, h, gamma, rstd, g):
    """(dh in h's dtype, dgamma in gamma's) from the softmax share G (M, d), the target
    coefficients coef (M,), the statistic S (M,), the targets (out of range: coef 0), w_lm
    (d, V) in either layout, the final norm's input h, gamma and rstd, and the upstream
    gradient g (0-d)."""
    acc = G.dtype
    y = target.clamp(0, w_lm.shape[1] - 1).long()
    Gf = torch.addcmul(G, coef[:, None].to(acc), w_lm.t()[y].to(h.dtype).to(acc))
    dh, dgamma = final_norm_bwd_normed_scaled(Gf, S, h, gamma, rstd, g)
    return dh, dgamma.to(gamma.dtype)


def _head_norm_bwd_kernel(
    G, W, target, coef, S, h, gamma, rstd, g, dh, part, M, d, V, g_row, h_row, w_d, w_v,
    BM: tl.constexpr, BD: tl.constexpr, P: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cm = cols < d
    gam = tl.load(gamma + cols, mask=cm, other=0.0).to(ACC)
    up = tl.load(g).to(ACC)
    acc = tl.zeros([BD], dtype=ACC)
    for r0 in range(tl.program_id(0) * BM, M, P * BM):
        rows = r0 + tl.arange(0, BM)
        live = rows < M
        mask = live[:, None] & cm[None, :]
        r64 = rows.to(tl.int64)[:, None]
        y = tl.load(target + rows, mask=live, other=0)
        y = tl.minimum(tl.maximum(y, 0), V - 1).to(tl.int64)[:, None]
        c = tl.load(coef + rows, mask=live, other=0.0).to(ACC)
        r = tl.load(rstd + rows, mask=live, other=0.0).to(ACC)
        corr = -(up * tl.load(S + rows, mask=live, other=0.0).to(ACC) * r * r) / d
        w = tl.load(W + cols.to(tl.int64)[None, :] * w_d + y * w_v, mask=mask, other=0.0)
        gf = tl.load(G + r64 * g_row + cols[None, :], mask=mask, other=0.0).to(ACC)
        gf += c[:, None] * w.to(h.dtype.element_ty).to(ACC)
        x = tl.load(h + r64 * h_row + cols[None, :], mask=mask, other=0.0).to(ACC)
        t = (up * r)[:, None] * gf
        out = t * gam[None, :] + corr[:, None] * x
        tl.store(dh + r64 * h_row + cols[None, :], out.to(dh.dtype.element_ty), mask=mask)
        acc += tl.sum(t * x, 0)
    tl.store(part + tl.program_id(0) * d + cols, acc, mask=cm)


def head_norm_bwd_triton(G, coef, S, target, w_lm, h, gamma, rstd, g, launch=None):
    """``head_norm_bwd_torch`` (same arguments) in two launches: G (M, d) and h with unit
    column stride, coef, S, target, gamma and rstd contiguous. dh takes h's row stride.
    ``launch``: (BM, BD, P, warps) instead of ``LAUNCH`` (the probe)."""
    BM, BD, P, warps = launch or LAUNCH
    M, d = h.shape
    assert _fits(G, coef, S, target, h, gamma, rstd), "unit column strides, contiguous tables"
    dh = torch.empty_strided((M, d), (h.stride(0), 1), dtype=h.dtype, device=h.device)
    part = G.new_empty(P, d)  # every program writes its row
    if M:
        kernel(_head_norm_bwd_kernel)[(P, cdiv(d, BD))](
            G, w_lm, target, coef, S, h, gamma, rstd, g, dh, part, M, d, w_lm.shape[1],
            G.stride(0), h.stride(0), w_lm.stride(0), w_lm.stride(1),
            BM=BM, BD=BD, P=P, ACC=acc_type(G), num_warps=warps,
        )  # fmt: skip
    return dh, col_sums_triton(part, gamma.dtype)  # summed in fp32, rounded once


def head_norm_backward(G, coef, S, target, w_lm, h, gamma, rstd, g):
    """The LM head's final-norm backward with its target entries (module docstring): the
    Triton pass on the GPU, outside a torch.compile trace (which fuses the torch form
    itself), on the layouts it takes (unit column strides, contiguous tables: a strided
    target or a column-strided hidden state takes the torch form), else the torch form.
    Returns (dh, dgamma in gamma's dtype)."""
    on_gpu = not torch.compiler.is_compiling() and on_triton(G)
    if on_gpu and _fits(G, coef, S, target, h, gamma, rstd):
        return head_norm_bwd_triton(G, coef, S, target, w_lm, h, gamma, rstd, g)
    return head_norm_bwd_torch(G, coef, S, target, w_lm, h, gamma, rstd, g)


def _fits(G, coef, S, target, h, gamma, rstd) -> bool:
    """The layouts the pass takes: G and h with unit column stride, every table contiguous."""
    tables = (coef, S, target, gamma, rstd)
    return G.stride(1) == 1 and h.stride(1) == 1 and all(t.is_contiguous() for t in tables)


def compile_head_norm_bwd(launch=LAUNCH, arch: int = 90, gamma: str = "bf16") -> int:
    """The kernel (fp32 G and tables, bf16 W and h, int64 targets; gamma's Triton type
    ``gamma``: "fp32" for an fp32 gain, Gemma's) at a launch shape, compiled for
    ``sm_{arch}`` on the CPU: the cubin's size."""
    BM, BD, P, warps = launch
    pointers = {n: "*fp32" for n in ("G", "coef", "S", "rstd", "g", "part")}
    pointers.update({n: "*bf16" for n in ("W", "h", "dh")}, gamma=f"*{gamma}")
    pointers["target"] = "*i64"
    consts = {"BM": BM, "BD": BD, "P": P, "ACC": tl.float32}
    return compile_sm90(_head_norm_bwd_kernel, pointers, consts, num_warps=warps, arch=arch)
