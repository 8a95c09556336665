"""B11, the attention-input backward's row pass, as hand-written Triton kernels (GPU).

What they compute is ``drope.drope_heads`` (dRoPE and the entry norm's statistic) and
``qk_norm.dqk_norm_rope_heads`` (the same with Qwen3's per-head norms): those torch functions
stay the CPU path and the oracle. On the H200 they used to run through ``fused``
(torch.compile), where Inductor split each into three to five kernels that re-read the head
gradients through the (batch, heads, seq, hd) -> (tokens, Nqkv) transpose and the even/odd
pair views: 1.5 ms per Llama-1B layer and 3.2 ms per Qwen3-0.6B layer for ~0.1 ms of traffic
(benchmarks/NOTES.md, session 7). Here each is one pass over memory:

- grid (head, block of BM token rows): each program reads one head's gradient tile
  (BM x hd, any strides of attention's output) and the matching tile of the saved forward
  tensor (with QK-norm: z for a q or k head, the stored v for a v head, where z equals it),
  and writes one tile of dz~0 = rstd0 * [RoPE^T(...) | dv] (the B12/B13 operand);
- the row statistic S0 = sum_n [...] * z / rstd0 leaves as per-head partials (M x heads,
  fp32), summed by one small torch reduction: no atomics, so the pass is deterministic;
- the QK-norm weights' gradients leave as per-(row block, head) partials, summed likewise;
  so does a QKV bias's gradient (``drope.drope_bias_rows``: Qwen2), whose pass reads F1's
  stored z for the statistic instead of the rotated output.

The pair rotation is ``tl.split`` / ``tl.join`` of a tile's adjacent columns: loads and
stores stay whole contiguous head rows. Statistics in fp32 (float64 for float64 inputs: the
kernels also run in Triton's interpreter on the CPU, which is how CI tests them against the
torch oracle, and they compile for sm_90 on the CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coda.kernels._launch import acc_dtype
from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel, next_power_of_2, on_triton
from coda.kernels.drope import drope_bias_heads, drope_heads
from coda.kernels.norm_rows import CORR_SCALED, row_stat

BLOCK_ROWS = 64  # token rows per program by default: a 64 x hd tile
# (kernel, head_dim) -> (token rows per program, warps), where an H200 measurement found better
# than the default (``benchmarks/tune_configs.py``, CODA_TUNE_ONLY=row_pass, alone; each pass
# inside its HF model's step, ``benchmarks/probe_row_passes.py``; the records in ``SWEPT``).
# Medians at M = 16384, default -> tuned: drope at hd 128 0.156 -> 0.143 ms alone at (16, 2)
# (run 23; replaced below by the step's pick); drope at the 1B layer (hd 64) 82.8 us per call
# inside Llama-1B's step, against 90.3 at run 23's alone pick (16, 2) (alone 0.107 ms, the
# default 0.118); the QK-norm pass at Qwen3-0.6B's
# layer 0.337 -> 0.181 ms per call inside the step (alone on the step's own arguments 0.327
# -> 0.195; at one warp its layout conversions need no barriers: 2 in its SASS against 23-45
# at 2-16 warps). Run 23's synthetic sweep had picked (32, 2): 0.282 ms in the step. A
# program walking several row blocks (its dW partials written once, the next block's loads in
# flight) ran slower in both steps (runs 103-104: 271-336 us per QK-norm call, 87 per drope).
# drope at hd 128 inside the d=2048 layer benchmark's step (runs 234-235): 102.0 us per call at
# (4, 1) in both runs against 120.7-123.1 at the alone pick (16, 2): as at hd 64, a one-warp
# program of 512 elements
TUNED: dict[tuple[str, int], tuple[int, int]] = {
    ("dqk_norm", 128): (8, 1),
    ("drope", 64): (8, 1),
    ("drope", 128): (4, 1),
}
SWEPT = (
    "benchmarks/results/2026-11-30_h200_run23.json (commit bdba4f2), tuning row_pass_*; "
    "benchmarks/results/2026-12-02_h200_run97.json (commit f7aaa9b), _run98.json (6dd2e47) "
    "and _run100.json (21870b5), qk_norm_pass; _run103.json and _run104.json (fd258f5), "
    "qk_norm_pass and drope_pass; 2026-12-04_h200_run234.json (232439a) and _run235.json "
    "(875e8b6), drope_pass_layer"
)
# the candidates (every one tested in the interpreter, tests/test_row_passes.py)
LAUNCH_SHAPES = (
    (2, 1),
    (4, 1),
    (8, 1),
    (8, 2),
    (16, 1),
    (16, 2),
    (32, 2),
    (32, 4),
    (64, 4),
    (64, 8),
    (128, 4),
    (128, 8),
    (128, 16),
)


@triton.jit
def _head_gradient_tile(
    dq, dk, dv, h, rows, M, S, n_q, n_k,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
    HD: tl.constexpr, HP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Head h's gradient (q heads, then k, then v: the QKV GEMM's column order) at token
    ``rows``, a (rows x HP) tile in ACC read at attention's own strides (0 past M and past
    the head's HD columns: HP is HD rounded up to a power of two, as Triton's ranges are)."""
    b, s = rows.to(tl.int64) // S, rows.to(tl.int64) % S  # int64: tensors past 2^31 entries
    if h < n_q:
        src = dq + b * sqb + h * sqh + s * sqs
    elif h < n_q + n_k:
        src = dk + b * skb + (h - n_q) * skh + s * sks
    else:
        src = dv + b * svb + (h - n_q - n_k) * svh + s * svs
    j = tl.arange(0, HP)
    mask = (rows < M)[:, None] & (j < HD)[None, :]
    return tl.load(src[:, None] + j[None, :], mask=mask, other=0.0).to(ACC)


def _drope_kernel(
    dq, dk, dv, qkv, rstd, cos, sin, out, s_part,
    M, S, n_q, n_k,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
    HD: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(0)  # the head: q heads, then k, then v (the QKV GEMM's column order)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    live = rows < M
    x = _head_gradient_tile(
        dq, dk, dv, h, rows, M, S, n_q, n_k,
        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, HD, HP, ACC,
    )  # fmt: skip
    j = tl.arange(0, HP)
    i = tl.arange(0, HP // 2)
    mask = live[:, None] & (j < HD)[None, :]
    half_mask = live[:, None] & (i < HD // 2)[None, :]
    n_cols = (n_q + 2 * n_k) * HD
    at = rows.to(tl.int64)[:, None] * n_cols + h * HD + j[None, :]
    fwd = tl.load(qkv + at, mask=mask, other=0.0).to(ACC)
    tl.store(s_part + rows.to(tl.int64) * (n_q + 2 * n_k) + h, tl.sum(x * fwd, 1), mask=live)
    rot = h < n_q + n_k  # v heads: no rotation (cos 1, sin 0)
    half = rows.to(tl.int64)[:, None] * (HD // 2) + i[None, :]
    c = tl.where(rot, tl.load(cos + half, mask=half_mask, other=1.0).to(ACC), 1.0)
    sn = tl.where(rot, tl.load(sin + half, mask=half_mask, other=0.0).to(ACC), 0.0)
    r = tl.load(rstd + rows, mask=live, other=1.0).to(ACC)[:, None]
    x1, x2 = tl.split(tl.reshape(x, (BM, HP // 2, 2)))
    y = tl.reshape(tl.join((x1 * c + x2 * sn) * r, (x2 * c - x1 * sn) * r), (BM, HP))
    tl.store(out + at, y.to(out.dtype.element_ty), mask=mask)


def _drope_bias_kernel(
    dq, dk, dv, z_even, z_odd, rstd, cos, sin, out, s_part, db_part,
    M, S, n_q, n_k, z_row,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
    HD: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """``drope.drope_bias_rows``: as ``_drope_kernel``, with the statistic on F1's stored z
    (its even and odd columns) and the bias's gradient as per-(row block, head) partials."""
    h = tl.program_id(0)
    blk = tl.program_id(1)
    rows = blk * BM + tl.arange(0, BM)
    live = rows < M
    x = _head_gradient_tile(
        dq, dk, dv, h, rows, M, S, n_q, n_k,
        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, HD, HP, ACC,
    )  # fmt: skip
    d1, d2 = tl.split(tl.reshape(x, (BM, HP // 2, 2)))
    j = tl.arange(0, HP)
    i = tl.arange(0, HP // 2)
    mask = live[:, None] & (j < HD)[None, :]
    half_mask = live[:, None] & (i < HD // 2)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    rot = h < n_q + n_k  # v heads: no rotation (cos 1, sin 0)
    half = r64 * (HD // 2) + i[None, :]
    c = tl.where(rot, tl.load(cos + half, mask=half_mask, other=1.0).to(ACC), 1.0)
    sn = tl.where(rot, tl.load(sin + half, mask=half_mask, other=0.0).to(ACC), 0.0)
    p1, p2 = d1 * c + d2 * sn, d2 * c - d1 * sn  # the gradient before the rotation
    zc = r64 * z_row + h * (HD // 2) + i[None, :]  # z's pair (2i, 2i + 1) of head h
    z1 = tl.load(z_even + zc, mask=half_mask, other=0.0).to(ACC)
    z2 = tl.load(z_odd + zc, mask=half_mask, other=0.0).to(ACC)
    n_heads = n_q + 2 * n_k
    tl.store(s_part + rows.to(tl.int64) * n_heads + h, tl.sum(p1 * z1 + p2 * z2, 1), mask=live)
    db = tl.join(tl.sum(p1, 0), tl.sum(p2, 0))  # (hd/2, 2): this block's bias gradient
    tl.store(db_part + (blk * n_heads + h) * HD + j, tl.reshape(db, (HP,)), mask=j < HD)
    r = tl.load(rstd + rows, mask=live, other=1.0).to(ACC)[:, None]
    y = tl.reshape(tl.join(p1 * r, p2 * r), (BM, HP))
    tl.store(
        out + r64 * (n_heads * HD) + h * HD + j[None, :], y.to(out.dtype.element_ty), mask=mask
    )


def _dqk_norm_kernel(
    dq, dk, dv, z_even, z_odd, z_v, s_head, rstd, cos, sin, q_norm, k_norm, out, s_part,
    dw_part, M, S, n_q, n_k, z_row, z_col, v_row, s_row,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs,
    HD: tl.constexpr, HP: tl.constexpr, BM: tl.constexpr, ACC: tl.constexpr,
    POST: tl.constexpr = False,
):  # fmt: skip
    """``qk_norm.dqk_norm_rope_rows``; ``POST``: the gains after the rotation (Hunyuan's)."""
    h = tl.program_id(0)
    blk = tl.program_id(1)
    rows = blk * BM + tl.arange(0, BM)
    live = rows < M
    x = _head_gradient_tile(
        dq, dk, dv, h, rows, M, S, n_q, n_k,
        sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, HD, HP, ACC,
    )  # fmt: skip
    d1, d2 = tl.split(tl.reshape(x, (BM, HP // 2, 2)))
    j = tl.arange(0, HP)
    i = tl.arange(0, HP // 2)
    mask = live[:, None] & (j < HD)[None, :]
    half_mask = live[:, None] & (i < HD // 2)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    r = tl.load(rstd + rows, mask=live, other=1.0).to(ACC)[:, None]
    n_heads = n_q + 2 * n_k
    at = r64 * (n_heads * HD) + h * HD + j[None, :]
    part = rows.to(tl.int64) * n_heads + h
    if h < n_q + n_k:  # a normed, rotated head: RoPE^T, then the head norm's backward
        zc = r64 * z_row + (h * (HD // 2) + i[None, :]) * z_col  # z's pair (2i, 2i + 1)
        z1 = tl.load(z_even + zc, mask=half_mask, other=0.0).to(ACC)
        z2 = tl.load(z_odd + zc, mask=half_mask, other=0.0).to(ACC)
        half = r64 * (HD // 2) + i[None, :]
        c = tl.load(cos + half, mask=half_mask, other=1.0).to(ACC)
        sn = tl.load(sin + half, mask=half_mask, other=0.0).to(ACC)
        sh = tl.load(s_head + rows.to(tl.int64) * s_row + h, mask=live, other=0.0).to(ACC)[:, None]
        wm = i < HD // 2
        if h < n_q:
            w1 = tl.load(q_norm + 2 * i, mask=wm, other=0.0).to(ACC)[None, :]
            w2 = tl.load(q_norm + 2 * i + 1, mask=wm, other=0.0).to(ACC)[None, :]
        else:
            w1 = tl.load(k_norm + 2 * i, mask=wm, other=0.0).to(ACC)[None, :]
            w2 = tl.load(k_norm + 2 * i + 1, mask=wm, other=0.0).to(ACC)[None, :]
        q1, q2 = z1 * sh, z2 * sh  # q_hat
        if POST:  # out = RoPE(q_hat) * w: dw_h = sum dout RoPE(q_hat), dq_hat = RoPE^T(dout w)
            u1, u2 = q1 * c - q2 * sn, q1 * sn + q2 * c
            dw = tl.join(tl.sum(d1 * u1, 0), tl.sum(d2 * u2, 0))  # (hd/2, 2): this block's
            b1, b2 = d1 * w1, d2 * w2
            e1, e2 = b1 * c + b2 * sn, b2 * c - b1 * sn
        else:  # out = RoPE(q_hat w): dq_n = RoPE^T(dout), dq_hat = dq_n w, dw_h = sum dq_n q_hat
            n1, n2 = d1 * c + d2 * sn, d2 * c - d1 * sn
            dw = tl.join(tl.sum(n1 * q1, 0), tl.sum(n2 * q2, 0))
            e1, e2 = n1 * w1, n2 * w2
        mean = tl.sum(e1 * q1 + e2 * q2, 1)[:, None] / HD
        g1, g2 = sh * (e1 - q1 * mean), sh * (e2 - q2 * mean)
        tl.store(dw_part + (blk * (n_q + n_k) + h) * HD + j, tl.reshape(dw, (HP,)), mask=j < HD)
    else:  # a v head passes through; its z is the stored v
        vc = r64 * v_row + (h - n_q - n_k) * HD + 2 * i[None, :]
        z1 = tl.load(z_v + vc, mask=half_mask, other=0.0).to(ACC)
        z2 = tl.load(z_v + vc + 1, mask=half_mask, other=0.0).to(ACC)
        g1, g2 = d1, d2
    tl.store(s_part + part, tl.sum(g1 * z1 + g2 * z2, 1), mask=live)
    y = tl.reshape(tl.join(g1 * r, g2 * r), (BM, HP))
    tl.store(out + at, y.to(out.dtype.element_ty), mask=mask)


def _warps(head_dim: int) -> int:
    """Default warps per program: 16 fp32 values of each (BLOCK_ROWS x hd/2) tile per thread."""
    return max(4, BLOCK_ROWS * next_power_of_2(head_dim) // 2 // 16 // 32)


def launch_shape(name: str, head_dim: int, shape=None) -> tuple[int, int]:
    """(token rows per program, warps) of kernel ``name`` ("drope" or "dqk_norm"): ``shape``
    if given (the sweep), else the tuned entry, else (BLOCK_ROWS, the default warps)."""
    return shape or TUNED.get((name, head_dim)) or (BLOCK_ROWS, _warps(head_dim))


def _rows_contiguous(*tensors):
    """The per-row tables (rstd, cos, sin) and the norm weights are read at unit strides."""
    assert all(t.is_contiguous() for t in tensors), [tuple(t.stride()) for t in tensors]


def _head_strides(dq, dk, dv):
    """(batch, head, seq) strides of the three head gradients, in elements; a tensor whose hd
    axis is not unit-stride is made so first (attention outputs are)."""
    ts = [t if t.stride(-1) == 1 else t.contiguous() for t in (dq, dk, dv)]
    return ts, [st for t in ts for st in t.stride()[:3]]


def _row_statistic(s_part, rstd, d):
    """corr0 from the per-head partials of S0 * rstd0 (M x heads)."""
    return row_stat(s_part, rstd, d, mode=CORR_SCALED)


def drope_heads_triton(dq, dk, dv, qkv, rstd, cos, sin, n_rot_heads, head_dim, d, shape=None):
    """``drope.drope_heads`` in one pass. Returns (dz~0 (M, Nqkv) in qkv's dtype, corr0 (M,)).
    ``shape``: (rows per program, warps) instead of ``launch_shape``'s."""
    B, n_q, S, hd = dq.shape
    n_k = dk.shape[1]
    assert n_rot_heads == n_q + n_k and hd == head_dim
    M, n_cols = qkv.shape
    assert qkv.stride() == (n_cols, 1) and n_cols == (n_q + 2 * n_k) * hd
    _rows_contiguous(rstd, cos, sin)
    (dq, dk, dv), strides = _head_strides(dq, dk, dv)
    out = torch.empty_like(qkv)
    s_part = qkv.new_empty(M, n_q + 2 * n_k, dtype=acc_dtype(qkv))
    bm, warps = launch_shape("drope", hd, shape)
    grid = (n_q + 2 * n_k, cdiv(M, bm))
    kernel(_drope_kernel)[grid](
        dq, dk, dv, qkv, rstd, cos, sin, out, s_part, M, S, n_q, n_k, *strides,
        HD=hd, HP=next_power_of_2(hd), BM=bm, ACC=acc_type(qkv), num_warps=warps,
    )  # fmt: skip
    return out, _row_statistic(s_part, rstd, d)


def drope_bias_heads_triton(dq, dk, dv, z_even, z_odd, rstd, cos, sin, d, shape=None):
    """``drope.drope_bias_heads`` in one pass. Returns (dz~0 (M, Nqkv) in z's dtype, corr0
    (M,), dbias (Nqkv,) fp32). ``shape``: as ``drope_heads_triton``'s."""
    B, n_q, S, hd = dq.shape
    n_k = dk.shape[1]
    n_heads = n_q + 2 * n_k
    M = z_even.shape[0]
    assert z_even.stride() == z_odd.stride() and z_even.stride(1) == 1
    assert z_even.shape[1] == n_heads * hd // 2
    _rows_contiguous(rstd, cos, sin)
    (dq, dk, dv), strides = _head_strides(dq, dk, dv)
    out = z_even.new_empty(M, n_heads * hd)
    s_part = out.new_empty(M, n_heads, dtype=acc_dtype(z_even))
    bm, warps = launch_shape("drope", hd, shape)
    blocks = cdiv(M, bm)
    db_part = out.new_empty(blocks, n_heads * hd, dtype=s_part.dtype)
    kernel(_drope_bias_kernel)[(n_heads, blocks)](
        dq, dk, dv, z_even, z_odd, rstd, cos, sin, out, s_part, db_part,
        M, S, n_q, n_k, z_even.stride(0), *strides,
        HD=hd, HP=next_power_of_2(hd), BM=bm, ACC=acc_type(z_even), num_warps=warps,
    )  # fmt: skip
    return out, _row_statistic(s_part, rstd, d), db_part.sum(0)


def dqk_norm_rope_heads_triton(
    dq, dk, dv, z_even, z_odd, z_v, s, rstd, cos, sin, q_norm, k_norm, n_q, n_k, head_dim, d,
    shape=None, post=False,
):  # fmt: skip
    """``qk_norm.dqk_norm_rope_heads_split_z`` in one pass: z's q and k columns as their even
    and odd columns (the training F1's stores, at least (n_q + n_k) hd / 2 wide) or whole
    (``z_odd`` None), its v columns as ``z_v`` (M, n_k hd: the stored v, unit stride). Returns
    (dz~0 (M, Nqkv) in z's dtype, corr0 (M,), dq_norm (hd,), dk_norm (hd,)), the last two
    fp32 (float64 for float64 inputs). ``shape``: as ``drope_heads_triton``'s. ``post``: the
    gains after the rotation (Hunyuan's)."""
    B, _, S, hd = dq.shape
    assert hd == head_dim and dq.shape[1] == n_q and dk.shape[1] == n_k
    M = z_even.shape[0]
    if z_odd is None:  # z whole: its even and odd columns are stride-2 views
        z_row, z_col, kept = z_even.stride(0), 2, z_even.shape[1]
        z_odd = z_even[:, 1:]
    else:
        assert z_even.stride() == z_odd.stride() and z_even.stride(1) == 1
        z_row, z_col, kept = z_even.stride(0), 1, 2 * z_even.shape[1]
    assert kept >= (n_q + n_k) * hd and z_v.shape[1] == n_k * hd  # z's q, k columns; v's
    assert z_v.stride(1) == 1
    _rows_contiguous(rstd, cos, sin, q_norm, k_norm)
    assert s.stride(1) == 1  # the head statistic: (M, heads) rows, possibly a column slice
    (dq, dk, dv), strides = _head_strides(dq, dk, dv)
    n_heads = n_q + 2 * n_k
    acc = acc_dtype(z_even)
    out = z_even.new_empty(M, n_heads * hd)
    s_part = out.new_empty(M, n_heads, dtype=acc)
    bm, warps = launch_shape("dqk_norm", hd, shape)
    blocks = cdiv(M, bm)
    dw_part = out.new_empty(blocks, n_q + n_k, hd, dtype=acc)
    kernel(_dqk_norm_kernel)[(n_heads, blocks)](
        dq, dk, dv, z_even, z_odd, z_v, s, rstd, cos, sin, q_norm, k_norm, out, s_part,
        dw_part, M, S, n_q, n_k, z_row, z_col, z_v.stride(0), s.stride(0), *strides,
        HD=hd, HP=next_power_of_2(hd), BM=bm, ACC=acc_type(z_even), POST=post, num_warps=warps,
    )  # fmt: skip
    dw = dw_part.sum(0)
    return out, _row_statistic(s_part, rstd, d), dw[:n_q].sum(0), dw[n_q:].sum(0)


def drope_pass(dq, dk, dv, qkv, rstd, cos, sin, d: int):
    """B11: (dz~0, corr0) from attention's dq (B, H, S, hd), dk, dv (B, Hkv, S, hd) and the
    saved rotated qkv (M, Nqkv): the Triton kernel on the GPU, the torch oracle on the CPU."""
    n_rot, hd = dq.shape[1] + dk.shape[1], dq.shape[-1]
    _rows_contiguous(rstd, cos, sin)  # (both lowerings hold the Triton kernel's contract)
    if on_triton(qkv):
        return drope_heads_triton(dq, dk, dv, qkv, rstd, cos, sin, n_rot, hd, d)
    return drope_heads(dq, dk, dv, qkv, rstd, cos, sin, n_rot, hd, d)


def drope_bias_pass(dq, dk, dv, z_even, z_odd, rstd, cos, sin, d: int):
    """B11 with a QKV bias: (dz~0, corr0, dbias) from attention's dq, dk, dv and F1's z
    (``gemm_rope.rope_scaled_bias``'s even and odd columns): the Triton kernel on the
    GPU, the torch oracle on the CPU."""
    _rows_contiguous(rstd, cos, sin)
    if on_triton(z_even):
        return drope_bias_heads_triton(dq, dk, dv, z_even, z_odd, rstd, cos, sin, d)
    return drope_bias_heads(dq, dk, dv, z_even, z_odd, rstd, cos, sin, d)


# pointer arguments: bf16 tensors, fp32 statistics and tables (every other argument an i32)
POINTERS = {n: "*bf16" for n in ("dq", "dk", "dv", "qkv", "out", "z_even", "z_odd", "z_v")}
POINTERS.update({n: "*bf16" for n in ("q_norm", "k_norm")})
POINTERS.update({n: "*fp32" for n in ("rstd", "cos", "sin", "s_part", "dw_part", "s_head")})
POINTERS["db_part"] = "*fp32"


def compile_row_passes(
    head_dim: int, arch: int = 90, shape=None, head_w="bf16", post=False
) -> list[int]:
    """The three kernels (bf16 tensors) at their launch shapes (``launch_shape``) compiled for
    ``sm_{arch}`` on the CPU: cubin sizes. ``head_w``: the QK-norm weights' Triton type
    ("fp32": Gemma 3's 1 + w, formed in fp32); ``post``: the QK-norm pass's gains after the
    rotation (Hunyuan's)."""
    pointers = {**POINTERS, "q_norm": f"*{head_w}", "k_norm": f"*{head_w}"}
    sizes = []
    kernels = (("drope", _drope_kernel), ("dqk_norm", _dqk_norm_kernel))
    for name, fn in (*kernels, ("drope", _drope_bias_kernel)):
        bm, warps = launch_shape(name, head_dim, shape)
        hp = next_power_of_2(head_dim)
        consts = {"HD": head_dim, "HP": hp, "BM": bm, "ACC": tl.float32}
        if post and fn is _dqk_norm_kernel:
            consts["POST"] = True
        sizes.append(compile_sm90(fn, pointers, consts, warps, arch))
    return sizes
