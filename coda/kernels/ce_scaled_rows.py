"""CE-S's row passes between its logits GEMM and its two gradient GEMMs (the GEMMs and the
driver: ``ce_scaled_exp``), each from GEMM1's per-(row, N-tile) statistics or the chunk's rows:

    glue   lse, K = max_t k, c = r w v and the target entry's coefficient (``scaled_glue``)
    xs     c (.) a, the dW GEMM's B operand (``row_scaled``)
    u      the strip 2^(k[m, t(b)] - K[m]) per 64 vocabulary columns (``strip_u``)

and the one after the dX GEMM, from its epilogue's row-dot partials (per N-tile of d):

    S      (sum_t dot[m, t] + coef l_y / r) / r, the final norm's statistic (``norm_stat_rows``)

Each has a torch form (the CPU path and the oracle; the glue's and xs's also run through
Inductor, ``fused``, for rows that are not contiguous) and a Triton pass with its tile fixed
here (the GPU path, one launch each: Inductor's forms of the same passes ran 1.4-5x slower in
the LM head's kernel tables, with launch configs Inductor picked once, at a first call:
benchmarks/NOTES.md, sessions 39-40), with an sm_90 compile of each for CI.
Tests: tests/test_ce_scaled_rows.py (the Triton interpreter against the torch forms; GPU).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from coda.kernels._launch import fused
from coda.kernels._triton import (
    acc_type,
    cdiv,
    compile_sm90,
    contiguous_pass,
    div_rn,
    kernel,
    on_triton,
)
from coda.kernels._triton import interpreted as in_triton_interpreter
from coda.kernels.linear_cross_entropy_chunked import norm_stat_from_dot, target_coef
from coda.primitives.aux import combine_row_partials

STRIP = 64  # vocabulary columns per strip value: the transform's k-tile in dx, 64 rows in dW
U_FLOOR = 100  # strips hold 2^(k - K) >= 2^-100: normal in bf16, whose floor is 2^-126


def scaled_total(sum_exp, k):
    """(K, T): K[m] = max_t k[m, t] and T[m] = sum_t 2^(k[m, t] - K) s[m, t] = 2^-K sum_n e^l,
    in [1, V sqrt 2]: the softmax denominator with its power of two split off."""
    K = k.amax(dim=1, keepdim=True)
    return K[:, 0], (torch.exp2(k - K) * sum_exp).sum(dim=1)


def _lse(K, T):
    return math.log(2.0) * (K + torch.log2(T))


def lse_from_scaled(sum_exp, k):
    """lse[m] = ln 2 * (K + log2 T) (``scaled_total``): nothing overflows, however large."""
    return _lse(*scaled_total(sum_exp, k))


def scaled_glue(sum_exp, k, target_logit, rstd, weight, z_loss, smoothing):
    """Per row, from GEMM1's partials (C x T_N values, no pass over C x V): lse, K = max_t k
    (``strip_u``'s input), the per-row factor c = r w v (fp32; v = 2^K e^-lse (1 + 2 z lse)),
    and the target entry's gradient r w (alpha p_y - (1 - eps)) in fp32 (``target_coef``;
    label smoothing eps: its uniform -eps / V share of every entry is a rank-1 term the caller
    adds). The torch form: the CPU path and the oracle (``glue_pass`` runs it as one Triton
    pass on the GPU); dW's B operand xs = c a, the glue's one pass over (C, d), is
    ``row_scaled``'s.
    """
    K, T = scaled_total(sum_exp, k)
    lse = _lse(K, T)
    alpha = 1.0 + 2.0 * z_loss * lse if z_loss else 1.0
    v = alpha / T  # 2^K e^-lse alpha, without forming 2^K (which overflows fp32 past K = 127)
    c = rstd * weight * v
    return lse, K, c, target_coef(target_logit, lse, rstd, weight, smoothing, z_loss)


@triton.jit
def _expm1(x, LIBDEVICE: tl.constexpr):
    """e^x - 1 without cancellation near 0: libdevice's on the GPU (what Inductor's form of
    ``torch.expm1`` calls), else Kahan's (u - 1) x / ln u, u = e^x (Triton's interpreter has
    no libdevice)."""
    if LIBDEVICE:
        return libdevice.expm1(x)
    else:
        u = tl.exp(x)
        um1 = u - 1.0
        ln_u = tl.where(um1 == 0.0, 1.0, tl.log(u))
        return tl.where(um1 == 0.0, x, tl.where(um1 == -1.0, -1.0, um1 * x / ln_u))


def _glue_kernel(
    sum_exp, k, y_logit, rstd, weight, lse, K, c, coef, C, T, z_loss, smoothing,
    BM: tl.constexpr, BT: tl.constexpr, ACC: tl.constexpr, LIBDEVICE: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    live = m < C
    row = m.to(tl.int64)[:, None] * T
    # K = max_t k and T = sum_t 2^(k - K) s in one pass, the running sum rescaled by the exact
    # power of two 2^(K_old - K_new) whenever the running max rises (k is integer-valued)
    top = tl.full([BM], -float("inf"), ACC)
    total = tl.zeros([BM], ACC)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        mask = live[:, None] & (t < T)[None, :]
        kv = tl.load(k + row + t[None, :], mask=mask, other=-float("inf")).to(ACC)
        sv = tl.load(sum_exp + row + t[None, :], mask=mask, other=0.0).to(ACC)
        new = tl.maximum(top, tl.max(kv, 1))
        new = tl.where(live, new, 0.0)  # a row past C: finite, never stored
        total = total * tl.exp2(top - new) + tl.sum(tl.exp2(kv - new[:, None]) * sv, 1)
        top = new
    lse_m = 0.6931471805599453 * (top + tl.log2(total))
    alpha = 1.0 + 2.0 * z_loss * lse_m
    rw = tl.load(rstd + m, mask=live, other=0.0).to(ACC) * tl.load(
        weight + m, mask=live, other=0.0
    ).to(ACC)
    p_y_m1 = _expm1(tl.load(y_logit + m, mask=live, other=0.0).to(ACC) - lse_m, LIBDEVICE)
    tl.store(lse + m, lse_m, mask=live)
    tl.store(K + m, top, mask=live)
    tl.store(c + m, rw * (alpha / total), mask=live)
    tl.store(coef + m, rw * (alpha * p_y_m1 + (alpha - 1.0 + smoothing)), mask=live)


GLUE_BLOCK = (16, 128)  # a program's (token rows, N-tiles a step), 4 warps


def scaled_glue_triton(sum_exp, k, target_logit, rstd, weight, z_loss, smoothing):
    """``scaled_glue`` as one Triton launch over the chunk's rows, its tile fixed here, each
    value rounded as the torch form rounds it (no fused multiply-adds: with them l_y - lse was
    formed from lse's unrounded last product, up to half an ulp of lse from the torch form's,
    which on a near-confident row is a 1e-3 relative change of p_y - 1: run 175). Inside
    Inductor (``fused``, dynamic shapes) the same values took 20-25 us a chunk at both heads'
    shapes (runs 163-170), then 482 us for four 4096-token chunks at V = 128256 in run 173,
    where its reduction was compiled apart from xs (the launch config of a dynamic-shape
    reduction is Inductor's, chosen once: benchmarks/NOTES.md, session 40)."""
    C, T = k.shape
    assert k.is_contiguous() and sum_exp.is_contiguous(), "GEMM1's statistics, as it writes them"
    outs = [torch.empty_like(rstd, dtype=k.dtype) for _ in range(4)]  # lse, K, c, coef
    if C:
        bm, bt = GLUE_BLOCK
        kernel(_glue_kernel)[(cdiv(C, bm),)](
            sum_exp, k, target_logit, rstd, weight, *outs, C, T, float(z_loss),
            float(smoothing), BM=bm, BT=bt, ACC=acc_type(k), LIBDEVICE=not in_triton_interpreter(),
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return tuple(outs)


def glue_pass(sum_exp, k, target_logit, rstd, weight, z_loss, smoothing):
    """``scaled_glue``: the Triton pass on its device for contiguous rows (CE-S runs in a
    custom op: never inside a torch.compile trace), else the torch form through ``fused``."""
    args = (sum_exp, k, target_logit, rstd, weight, z_loss, smoothing)
    if contiguous_pass(*args[:5]):
        return scaled_glue_triton(*args)
    return fused(scaled_glue)(*args)


def compile_scaled_glue(arch: int = 90) -> int:
    """The glue kernel (fp32 statistics and rows) compiled for ``sm_{arch}`` on the CPU: the
    cubin's size."""
    bm, bt = GLUE_BLOCK
    names = ("sum_exp", "k", "y_logit", "rstd", "weight", "lse", "K", "c", "coef")
    pointers = {n: "*fp32" for n in names} | {"z_loss": "fp32", "smoothing": "fp32"}
    consts = {"BM": bm, "BT": bt, "ACC": tl.float32, "LIBDEVICE": True}
    return compile_sm90(_glue_kernel, pointers, consts, 4, arch, enable_fp_fusion=False)


def row_scaled_torch(a, c):
    """xs = c (.) a: each row of ``a`` times its fp32 factor, rounded once to a's dtype."""
    return (c[:, None] * a.to(c.dtype)).to(a.dtype)


def _row_scale_kernel(a, c, out, C, D, BM: tl.constexpr, BD: tl.constexpr):
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    j = tl.program_id(1) * BD + tl.arange(0, BD)
    live_m = m < C
    live = live_m[:, None] & (j < D)[None, :]
    at = m.to(tl.int64)[:, None] * D + j[None, :]
    cm = tl.load(c + m, mask=live_m, other=0.0)
    x = tl.load(a + at, mask=live, other=0.0)
    # one product in c's dtype, rounded once to a's (to nearest even on the GPU, as torch)
    tl.store(out + at, (cm[:, None] * x.to(cm.dtype)).to(out.dtype.element_ty), mask=live)


ROW_SCALE_BLOCK = (8, 512)  # a program's (rows, columns): 32 bf16 a thread at 4 warps


def row_scaled_triton(a, c):
    """``row_scaled_torch`` of a contiguous ``a`` as one Triton launch: Inductor's form of the
    same pass (inside the fused glue) profiled at 66-87 us for a 16384 x 2048 bf16 chunk, ~1.5-2
    TB/s (runs 155-170), for 128 MiB of traffic."""
    C, D = a.shape
    out = torch.empty_like(a)
    if C and D:
        bm, bd = ROW_SCALE_BLOCK
        grid = (cdiv(C, bm), cdiv(D, bd))
        kernel(_row_scale_kernel)[grid](a, c, out, C, D, BM=bm, BD=bd, num_warps=4)
    return out


def row_scaled(a, c):
    """xs = c (.) a, dW's B operand: the Triton pass where ``a`` and ``c`` are contiguous on
    their device and not inside a torch.compile trace (CE-S runs in a custom op: never
    traced), else the torch form through ``fused``."""
    if contiguous_pass(a, c):
        return row_scaled_triton(a, c)
    return fused(row_scaled_torch)(a, c)


def compile_row_scaled(arch: int = 90) -> int:
    """The xs kernel (bf16 rows, fp32 factors) compiled for ``sm_{arch}`` on the CPU: the
    cubin's size."""
    bm, bd = ROW_SCALE_BLOCK
    pointers = {"a": "*bf16", "c": "*fp32", "out": "*bf16"}
    return compile_sm90(_row_scale_kernel, pointers, {"BM": bm, "BD": bd}, 4, arch)


# The strip u (V / 64, C): exact powers of two 2^(k[m, t(b)] - K[m]) per 64-column block b
# (in N-tile t(b) = b // (tile_n / 64)), floored at 2^-100 so that bf16 holds them (a tile
# whose max is > 69 nats under the row's then reads p 2^30 x too large: < 1e-30, and its
# target entry stays finite and exact, being formed with the same u). Transposed against k,
# so that the gradient GEMMs' transform reads it along the token rows.
def strip_u_torch(k, K, tile_n: int, dtype):
    """``strip_u`` in torch: the CPU path and the oracle."""
    uk = torch.exp2((k - K[:, None]).clamp(min=-U_FLOOR))
    return uk.repeat_interleave(tile_n // STRIP, dim=1).t().contiguous().to(dtype)


def _strip_kernel(
    k, K, u, C, B, k_row,
    R: tl.constexpr, BB: tl.constexpr, BM: tl.constexpr, FLOOR: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0) * BB + tl.arange(0, BB)  # strip rows (64-column blocks of V)
    m = tl.program_id(1) * BM + tl.arange(0, BM)  # token rows: u's contiguous axis
    live_m = m < C
    mask = (b < B)[:, None] & live_m[None, :]
    kv = tl.load(k + m.to(tl.int64)[None, :] * k_row + (b // R)[:, None], mask=mask, other=0.0)
    top = tl.load(K + m, mask=live_m, other=0.0)
    e = tl.exp2(tl.maximum(kv - top[None, :], -FLOOR))
    tl.store(u + b.to(tl.int64)[:, None] * C + m[None, :], e.to(u.dtype.element_ty), mask=mask)


STRIP_BLOCK = (32, 128)  # a program's (strip rows, token rows)


def strip_u_triton(k, K, tile_n: int, dtype):
    """``strip_u`` in one pass that writes u along its contiguous token axis (Inductor's
    transposing form ran at ~0.5 TB/s: 53 us a 4096-token chunk at V = 128256, run 116)."""
    C, t_n = k.shape
    assert k.stride(1) == 1 and K.is_contiguous(), "GEMM1's statistics, as it writes them"
    B = t_n * (tile_n // STRIP)
    u = k.new_empty(B, C, dtype=dtype)
    if B and C:
        bb, bm = STRIP_BLOCK
        kernel(_strip_kernel)[(cdiv(B, bb), cdiv(C, bm))](
            k, K, u, C, B, k.stride(0),
            R=tile_n // STRIP, BB=bb, BM=bm, FLOOR=float(U_FLOOR), num_warps=4,
        )  # fmt: skip
    return u


def strip_u(k, K, tile_n: int, dtype):
    """u (V / 64, C) in ``dtype`` from GEMM1's tile statistic k (C, T_N) and its row max K:
    the Triton pass on the GPU, else the torch form (CE-S runs inside a custom op, so never in
    a torch.compile trace). Both are exact: every value is a power of two."""
    if on_triton(k):
        return strip_u_triton(k, K, tile_n, dtype)
    return strip_u_torch(k, K, tile_n, dtype)


def compile_strip_u(tile_n: int = 192, arch: int = 90) -> int:
    """The strip kernel (fp32 statistics, bf16 u) compiled for ``sm_{arch}`` on the CPU: the
    cubin's size."""
    bb, bm = STRIP_BLOCK
    pointers = {"k": "*fp32", "K": "*fp32", "u": "*bf16"}
    consts = {"R": tile_n // STRIP, "BB": bb, "BM": bm, "FLOOR": float(U_FLOOR)}
    return compile_sm90(_strip_kernel, pointers, consts, num_warps=4, arch=arch)


# -- the final norm's statistic S from the dX epilogue's row-dot partials ------------------------
def norm_stat_rows_torch(part, rstd, coef, target_logit):
    """S[m] = (sum_t part[m, t] + coef_m l_y / r_m) / r_m (``norm_stat_from_dot`` of the
    partials' row sums): the CPU path and the oracle; five small launches on the GPU."""
    return norm_stat_from_dot(combine_row_partials(part), rstd, coef, target_logit)


def _norm_stat_kernel(part, rstd, coef, y, S, C, T, BM: tl.constexpr, BT: tl.constexpr):
    ACC: tl.constexpr = S.dtype.element_ty
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    live = m < C
    dot = tl.zeros([BM], dtype=ACC)
    for t0 in range(0, T, BT):
        t = t0 + tl.arange(0, BT)
        at = part + m.to(tl.int64)[:, None] * T + t[None, :]
        dot += tl.sum(tl.load(at, mask=live[:, None] & (t < T)[None, :], other=0.0).to(ACC), 1)
    r = tl.load(rstd + m, mask=live, other=1.0).to(ACC)
    c = tl.load(coef + m, mask=live, other=0.0).to(ACC)
    hot = div_rn(c * tl.load(y + m, mask=live, other=0.0).to(ACC), r)  # coef l_y / r
    tl.store(S + m, div_rn(dot + hot, r), mask=live)


NORM_STAT_BLOCK = (128, 16)  # a program's (token rows, partials a step), 4 warps


def norm_stat_rows_triton(part, rstd, coef, target_logit):
    """``norm_stat_rows_torch`` as one Triton launch (the torch form's sum, multiply, add and
    two divisions are five), each value rounded as the torch form rounds it but the sum over
    the row's partials (another order: fp32 round-off)."""
    C, T = part.shape
    assert part.is_contiguous(), "the dX epilogue's partials, as it writes them (row stride T)"
    S = torch.empty_like(rstd, dtype=part.dtype)
    if C:
        bm, bt = NORM_STAT_BLOCK
        kernel(_norm_stat_kernel)[(cdiv(C, bm),)](
            part, rstd, coef, target_logit, S, C, T, BM=bm, BT=bt, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return S


def norm_stat_rows(part, rstd, coef, target_logit):
    """S from the dX epilogue's (rows, T) row-dot partials: the Triton pass on its device for
    contiguous tables (CE-S runs in a custom op: never inside a torch.compile trace), else the
    torch form."""
    if contiguous_pass(part, rstd, coef, target_logit):
        return norm_stat_rows_triton(part, rstd, coef, target_logit)
    return norm_stat_rows_torch(part, rstd, coef, target_logit)


def compile_norm_stat_rows(arch: int = 90) -> int:
    """The statistic's kernel (fp32 partials and rows) compiled for ``sm_{arch}`` on the CPU:
    the cubin's size."""
    bm, bt = NORM_STAT_BLOCK
    pointers = {n: "*fp32" for n in ("part", "rstd", "coef", "y", "S")}
    consts = {"BM": bm, "BT": bt}
    return compile_sm90(_norm_stat_kernel, pointers, consts, 4, arch, enable_fp_fusion=False)
