"""QK-norm's row passes: OLMo's norm over the whole q and k projections as two Triton
kernels (F1's row pass and B11), and the dispatch of both QK-norm passes (Qwen3's per-head
B11 is ``row_passes.dqk_norm_rope_heads_triton``).

OLMo's statistic spans all of a row's q columns (and all of its k columns), more than any tile
of the QKV GEMM holds, so F1 stores z = rstd0 * acc and a row pass norms and rotates; the torch
forms (``qk_norm.qk_norm_rope_rows``, ``dqk_norm_rope_rows``) compiled by Inductor ran as ten
kernels a layer, 9.4 ms (one of them 2.7 ms), 151 ms of an OLMo-2-1B-shaped step's 367 ms of
kernel time (run 313, an H100). Here each pass is one kernel: a program takes BM token rows and
walks their q and k head tiles twice (the group sums, then the output), the second walk reading
from cache what the first read from memory. The torch forms stay the CPU path and the oracle;
the kernels run in Triton's interpreter on the CPU in the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coda.kernels._launch import acc_dtype, fused
from coda.kernels._triton import (
    acc_type,
    cdiv,
    compile_sm90,
    contiguous_pass,
    kernel,
    next_power_of_2,
    on_triton,
)
from coda.kernels.qk_norm import dqk_norm_rope_heads_split_z, is_per_head, qk_norm_rope_rows
from coda.kernels.row_passes import (
    POINTERS,
    _head_gradient_tile,
    _head_strides,
    _row_statistic,
    _rows_contiguous,
    dqk_norm_rope_heads_triton,
)


@triton.jit
def _whole_weights(q_norm, k_norm, h, n_q, i, HD: tl.constexpr, ACC: tl.constexpr):
    """Head h's part of OLMo's QK-norm weights (q heads', then k heads'), as the gains of its
    even and odd columns (1 x hd/2 each; 0 past the head's HD columns)."""
    wm = i < HD // 2
    if h < n_q:
        at = q_norm + h * HD + 2 * i
    else:
        at = k_norm + (h - n_q) * HD + 2 * i
    w1 = tl.load(at, mask=wm, other=0.0).to(ACC)[None, :]
    w2 = tl.load(at + 1, mask=wm, other=0.0).to(ACC)[None, :]
    return w1, w2


@triton.jit
def _row_block(
    blk, M, cos, sin, HD: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr
):
    """Block ``blk``'s BM token rows: (rows, int64 rows as a column, a head tile's column
    index j and pair index i, the tile's mask, the rows' RoPE cos and sin for each pair)."""
    rows = blk * BM + tl.arange(0, BM)
    live = rows < M
    r64 = rows.to(tl.int64)[:, None]
    j = tl.arange(0, HP)
    i = tl.arange(0, HP // 2)
    mask = live[:, None] & (j < HD)[None, :]
    half_mask = live[:, None] & (i < HD // 2)[None, :]
    half = r64 * (HD // 2) + i[None, :]
    c = tl.load(cos + half, mask=half_mask, other=1.0).to(ACC)
    sn = tl.load(sin + half, mask=half_mask, other=0.0).to(ACC)
    return rows, r64, j, i, mask, c, sn


def _qk_norm_whole_kernel(
    z, cos, sin, q_norm, k_norm, out, s_head, M, n_q, n_k, eps,
    HD: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """OLMo's QK-norm and RoPE (``qk_norm.qk_norm_rope_rows`` with the weights of the whole q
    and k projections) on BM token rows of z (M, Nqkv): the rows' q and k head tiles walked
    twice, first for the two sums of squares (q's, k's), then for the normed, rotated output;
    v copied; the statistics stored as s (M, 2)."""
    rows, r64, j, i, mask, c, sn = _row_block(tl.program_id(0), M, cos, sin, HD, HP, BM, ACC)
    live = rows < M
    n_cols = (n_q + 2 * n_k) * HD
    ssq = tl.zeros((BM,), dtype=ACC)
    ssk = tl.zeros((BM,), dtype=ACC)
    for h in range(0, n_q + n_k):
        x = tl.load(z + r64 * n_cols + h * HD + j[None, :], mask=mask, other=0.0).to(ACC)
        t = tl.sum(x * x, 1)
        ssq += tl.where(h < n_q, t, 0.0)
        ssk += tl.where(h < n_q, 0.0, t)
    sq = 1.0 / tl.sqrt(ssq / (n_q * HD) + eps)
    sk = 1.0 / tl.sqrt(ssk / (n_k * HD) + eps)
    tl.store(s_head + rows.to(tl.int64) * 2, sq, mask=live)
    tl.store(s_head + rows.to(tl.int64) * 2 + 1, sk, mask=live)
    for h in range(0, n_q + n_k):
        at = r64 * n_cols + h * HD + j[None, :]
        x = tl.load(z + at, mask=mask, other=0.0).to(ACC)
        x1, x2 = tl.split(tl.reshape(x, (BM, HP // 2, 2)))
        w1, w2 = _whole_weights(q_norm, k_norm, h, n_q, i, HD, ACC)
        sc = tl.where(h < n_q, sq, sk)[:, None]
        x1, x2 = x1 * sc * w1, x2 * sc * w2
        y = tl.reshape(tl.join(x1 * c - x2 * sn, x1 * sn + x2 * c), (BM, HP))
        tl.store(out + at, y.to(out.dtype.element_ty), mask=mask)
    for h in range(n_q + n_k, n_q + 2 * n_k):  # v: z as it is
        at = r64 * n_cols + h * HD + j[None, :]
        tl.store(out + at, tl.load(z + at, mask=mask, other=0.0), mask=mask)


@triton.jit
def _whole_head_terms(
    dq, dk, dv, z, q_norm, k_norm, h, rows, c, sn, sq, sk, M, S, n_q, n_k, z_row,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
    HD: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """A q or k head's terms of OLMo's QK-norm backward at token ``rows``, as even and odd
    columns: (dq_n = RoPE^T(dout), q_hat = z s, dq_hat = dq_n w, z, s of the head's group)."""
    x = _head_gradient_tile(
        dq, dk, dv, h, rows, M, S, n_q, n_k,
        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, HD, HP, ACC,
    )  # fmt: skip
    d1, d2 = tl.split(tl.reshape(x, (BM, HP // 2, 2)))
    n1, n2 = d1 * c + d2 * sn, d2 * c - d1 * sn
    i = tl.arange(0, HP // 2)
    half_mask = (rows < M)[:, None] & (i < HD // 2)[None, :]
    zc = rows.to(tl.int64)[:, None] * z_row + h * HD + 2 * i[None, :]  # z's pair (2i, 2i + 1)
    z1 = tl.load(z + zc, mask=half_mask, other=0.0).to(ACC)
    z2 = tl.load(z + zc + 1, mask=half_mask, other=0.0).to(ACC)
    w1, w2 = _whole_weights(q_norm, k_norm, h, n_q, i, HD, ACC)
    sc = tl.where(h < n_q, sq, sk)[:, None]
    return n1, n2, z1 * sc, z2 * sc, n1 * w1, n2 * w2, z1, z2, sc


def _dqk_norm_whole_kernel(
    dq, dk, dv, z, z_v, s_head, rstd, cos, sin, q_norm, k_norm, out, s_part, dw_part,
    M, S, n_q, n_k, z_row, v_row,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
    HD: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """B11 with OLMo's QK-norm (``qk_norm.dqk_norm_rope_rows`` with whole-projection groups)
    on BM token rows: the q and k head tiles walked twice, first for the two groups' sums of
    dq_hat * q_hat, then for the norm's backward (each head's dw partial stored per row
    block), dz~0 and the entry norm's statistic (one partial a row, the v heads' included)."""
    blk = tl.program_id(0)
    rows, r64, j, i, mask, c, sn = _row_block(blk, M, cos, sin, HD, HP, BM, ACC)
    live = rows < M
    sq = tl.load(s_head + rows.to(tl.int64) * 2, mask=live, other=0.0).to(ACC)
    sk = tl.load(s_head + rows.to(tl.int64) * 2 + 1, mask=live, other=0.0).to(ACC)
    r = tl.load(rstd + rows, mask=live, other=1.0).to(ACC)[:, None]
    n_heads = n_q + 2 * n_k
    tq = tl.zeros((BM,), dtype=ACC)
    tk = tl.zeros((BM,), dtype=ACC)
    for h in range(0, n_q + n_k):  # the two groups' sums of dq_hat * q_hat
        _, _, q1, q2, e1, e2, _, _, _ = _whole_head_terms(
            dq, dk, dv, z, q_norm, k_norm, h, rows, c, sn, sq, sk, M, S, n_q, n_k, z_row,
            sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, HD, HP, BM, ACC,
        )  # fmt: skip
        t = tl.sum(e1 * q1 + e2 * q2, 1)
        tq += tl.where(h < n_q, t, 0.0)
        tk += tl.where(h < n_q, 0.0, t)
    mq, mk = tq / (n_q * HD), tk / (n_k * HD)
    s0 = tl.zeros((BM,), dtype=ACC)
    for h in range(0, n_q + n_k):  # the norm's backward, with the groups' means
        n1, n2, q1, q2, e1, e2, z1, z2, sc = _whole_head_terms(
            dq, dk, dv, z, q_norm, k_norm, h, rows, c, sn, sq, sk, M, S, n_q, n_k, z_row,
            sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, HD, HP, BM, ACC,
        )  # fmt: skip
        mean = tl.where(h < n_q, mq, mk)[:, None]
        g1, g2 = sc * (e1 - q1 * mean), sc * (e2 - q2 * mean)
        dw = tl.join(tl.sum(n1 * q1, 0), tl.sum(n2 * q2, 0))  # (hd/2, 2): this block's
        tl.store(dw_part + (blk * (n_q + n_k) + h) * HD + j, tl.reshape(dw, (HP,)), mask=j < HD)
        s0 += tl.sum(g1 * z1 + g2 * z2, 1)
        y = tl.reshape(tl.join(g1 * r, g2 * r), (BM, HP))
        at = r64 * (n_heads * HD) + h * HD + j[None, :]
        tl.store(out + at, y.to(out.dtype.element_ty), mask=mask)
    for h in range(n_q + n_k, n_heads):  # the v heads pass through; their z is the stored v
        x = _head_gradient_tile(
            dq, dk, dv, h, rows, M, S, n_q, n_k,
            sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, HD, HP, ACC,
        )  # fmt: skip
        vc = r64 * v_row + (h - n_q - n_k) * HD + j[None, :]
        s0 += tl.sum(x * tl.load(z_v + vc, mask=mask, other=0.0).to(ACC), 1)
        at = r64 * (n_heads * HD) + h * HD + j[None, :]
        tl.store(out + at, (x * r).to(out.dtype.element_ty), mask=mask)
    tl.store(s_part + rows, s0, mask=live)


# OLMo's two passes: (token rows per program, warps); no GPU sweep yet (session 74)
WHOLE_LAUNCH = (8, 2)


def qk_norm_whole_triton(z, q_norm, k_norm, cos, sin, n_q, n_k, head_dim, eps, shape=None):
    """``qk_norm.qk_norm_rope_rows`` with OLMo's whole-projection weights (q_norm (n_q hd,),
    k_norm (n_k hd,)) in one pass over z (M, Nqkv), contiguous. Returns (qkv (M, Nqkv) in
    z's dtype, s (M, 2) fp32: q's and k's statistics). ``shape``: (rows per program, warps)
    instead of ``WHOLE_LAUNCH``."""
    M, n_cols = z.shape
    hd = head_dim
    assert z.stride() == (n_cols, 1) and n_cols == (n_q + 2 * n_k) * hd
    assert q_norm.shape == (n_q * hd,) and k_norm.shape == (n_k * hd,)
    _rows_contiguous(cos, sin, q_norm, k_norm)
    out = torch.empty_like(z)
    s = z.new_empty(M, 2, dtype=acc_dtype(z))
    bm, warps = shape or WHOLE_LAUNCH
    kernel(_qk_norm_whole_kernel)[(cdiv(M, bm),)](
        z, cos, sin, q_norm, k_norm, out, s, M, n_q, n_k, float(eps),
        HD=hd, HP=next_power_of_2(hd), BM=bm, ACC=acc_type(z), num_warps=warps,
    )  # fmt: skip
    return out, s


def dqk_norm_whole_triton(
    dq, dk, dv, z, z_v, s, rstd, cos, sin, q_norm, k_norm, n_q, n_k, head_dim, d, shape=None
):  # fmt: skip
    """``qk_norm.dqk_norm_rope_heads_split_z`` with OLMo's whole-projection weights, z's q and
    k columns whole (``z``, at least (n_q + n_k) hd wide; unit column stride), in one pass.
    Returns (dz~0 (M, Nqkv) in z's dtype, corr0 (M,), dq_norm (n_q hd,), dk_norm (n_k hd,)),
    the last two fp32 (float64 for float64 inputs)."""
    _, _, S, hd = dq.shape
    assert hd == head_dim and dq.shape[1] == n_q and dk.shape[1] == n_k
    M = z.shape[0]
    assert z.stride(1) == 1 and z.shape[1] >= (n_q + n_k) * hd
    assert z_v.stride(1) == 1 and z_v.shape[1] == n_k * hd
    assert s.shape == (M, 2) and s.is_contiguous()
    _rows_contiguous(rstd, cos, sin, q_norm, k_norm)
    (dq, dk, dv), strides = _head_strides(dq, dk, dv)
    n_heads = n_q + 2 * n_k
    acc = acc_dtype(z)
    out = z.new_empty(M, n_heads * hd)
    s_part = out.new_empty(M, 1, dtype=acc)
    bm, warps = shape or WHOLE_LAUNCH
    blocks = cdiv(M, bm)
    dw_part = out.new_empty(blocks, n_q + n_k, hd, dtype=acc)
    kernel(_dqk_norm_whole_kernel)[(blocks,)](
        dq, dk, dv, z, z_v, s, rstd, cos, sin, q_norm, k_norm, out, s_part, dw_part,
        M, S, n_q, n_k, z.stride(0), z_v.stride(0), *strides,
        HD=hd, HP=next_power_of_2(hd), BM=bm, ACC=acc_type(z), num_warps=warps,
    )  # fmt: skip
    dw = dw_part.sum(0)
    return out, _row_statistic(s_part, rstd, d), dw[:n_q].flatten(), dw[n_q:].flatten()


def qk_norm_pass(
    z, q_norm, k_norm, cos, sin, n_q: int, n_k: int, head_dim: int, eps: float, post=False
):
    """F1's QK-norm and RoPE as a row pass, where the epilogue cannot take them (heads no tile
    holds, OLMo's norm): (qkv, s) of ``qk_norm.qk_norm_rope_rows``. OLMo's by its Triton
    kernel (on the GPU; a torch.compile trace reaches it through ``library.qk_norm_rows``),
    Qwen3's per-head one by its torch form (compiled on the GPU: ``fused``), as is a norm
    whose gains follow the rotation (``post``: Hunyuan's, per head)."""
    whole = not is_per_head(q_norm, k_norm, head_dim)
    if whole and not post and contiguous_pass(z, cos, sin, q_norm, k_norm):
        return qk_norm_whole_triton(z, q_norm, k_norm, cos, sin, n_q, n_k, head_dim, eps)
    return fused(qk_norm_rope_rows)(z, q_norm, k_norm, cos, sin, n_q, n_k, head_dim, eps, post)


def dqk_norm_pass(
    dq, dk, dv, z_even, z_odd, z_v, s, rstd, cos, sin, q_norm, k_norm, d: int, post=False
):
    """B11 with QK-norm (Qwen3's per head, OLMo's over the whole projections: the weights'
    lengths say which): (dz~0, corr0, dq_norm, dk_norm) from attention's dq, dk, dv, the
    forward's z on the q and k columns (as its even and odd columns, or whole: ``z_odd``
    None), the stored v ``z_v`` (z on the v columns) and the statistic s: each form's Triton
    kernel on the GPU, the torch oracle on the CPU. ``post``: the gains after the rotation
    (Hunyuan's, per head)."""
    _rows_contiguous(rstd, cos, sin, q_norm, k_norm)
    rest = (s, rstd, cos, sin, q_norm, k_norm, dq.shape[1], dk.shape[1], dq.shape[-1], d)
    per_head = is_per_head(q_norm, k_norm, dq.shape[-1])
    if post and not per_head:
        raise ValueError("QK-norm gains after RoPE (post) are per head (hd,), not OLMo's")
    if not on_triton(z_even):
        return dqk_norm_rope_heads_split_z(dq, dk, dv, z_even, z_odd, z_v, *rest, post=post)
    if per_head:  # Qwen3's (Hunyuan's with ``post``)
        return dqk_norm_rope_heads_triton(dq, dk, dv, z_even, z_odd, z_v, *rest, post=post)
    assert z_odd is None  # (OLMo's: F1's row-pass form keeps z whole)
    return dqk_norm_whole_triton(dq, dk, dv, z_even, z_v, *rest)


def compile_qk_norm_whole(head_dim: int, arch: int = 90, shape=None, head_w="bf16") -> list[int]:
    """The two kernels (bf16 tensors, ``head_w`` weights) compiled for ``sm_{arch}`` on the
    CPU: cubin sizes."""
    pointers = {**POINTERS, "z": "*bf16", "q_norm": f"*{head_w}", "k_norm": f"*{head_w}"}
    pointers.update(s_head="*fp32", eps="fp32")
    bm, warps = shape or WHOLE_LAUNCH
    consts = {"HD": head_dim, "HP": next_power_of_2(head_dim), "BM": bm, "ACC": tl.float32}
    kernels = (_qk_norm_whole_kernel, _dqk_norm_whole_kernel)
    return [compile_sm90(fn, pointers, consts, warps, arch) for fn in kernels]
