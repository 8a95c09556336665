"""The norm after a sublayer (Gemma 2's and 3's post-attention and post-feedforward norms:
RMSNorm of the projection's output y before the residual add), as one row pass each way
beside the projection GEMM, whose epilogue stores y and RED_m partials of y^2 (F3 without the
residual, ``gemm_residual_rms.output_sumsq``). The statistic needs a whole row of y, which
no one output tile holds, so the norm itself cannot finish in that epilogue; the pass reads
y once and writes the new residual stream once:

    P1 (forward):  r   = (sum_t P[m, t] / d + eps)^-1/2             (P: y^2's partials)
                   x1  = x0 + r * g * y                fp32, rounded once
                   and where the next norm is a pre-norm (the post-attention norm's, before
                   the MLP): r1 = (mean_n x1^2 + eps)^-1/2 of the fp32 x1, and a1 = x1 * g1
                   (the next GEMM's A operand, its row scale r1 deferred, as F3's)
    P2 (backward): u   = g * dx1
                   dy  = r * u - y * r^3 * mean_n(u * y)
                   dg  = sum_m r * y * dx1               fp32 partials per block of rows,
                                                         summed once (``norm_rows.col_sums``)
    (dx0 = dx1: the residual.)

``g`` may be fp32 (Gemma's 1 + w, formed in fp32 before the one rounding, as HF's
``Gemma3RMSNorm``). The torch forms here are the CPU path and the oracle; the Triton kernels
run on the GPU (and in Triton's interpreter on the CPU, how CI tests them): P1 one program
per few token rows (``norm_rows``' launch shape for rows of d entries), P2 one per ``ROWS``
token rows, walked in blocks of that few, so that its dg partials are one row per program.
Float64 inputs accumulate in float64 (the CPU proofs).
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._launch import acc_dtype
from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel, next_power_of_2, on_triton
from coda.kernels.norm_rows import MAX_ROW, _rows_launch, col_sums
from coda.primitives.aux import rstd_from_sumsq

ROWS = 64  # token rows per P2 program: one fp32 row of dg partials per 64 rows


# -- torch forms: the CPU path and the oracle ---------------------------------------------------
def post_norm_torch(y, sumsq, x0, gain, eps: float, next_gain=None):
    """P1: (x1, r) or, with ``next_gain``, (x1, r, a1, r1)."""
    acc = acc_dtype(y)
    r = rstd_from_sumsq(sumsq, y.shape[1], eps)
    x1f = x0.to(acc) + r[:, None] * gain.to(acc) * y.to(acc)
    x1 = x1f.to(x0.dtype)
    if next_gain is None:
        return x1, r
    r1 = torch.rsqrt(x1f.pow(2).mean(-1) + eps)
    return x1, r, (x1f * next_gain.to(acc)).to(x0.dtype), r1


def post_norm_bwd_torch(dx1, y, r, gain):
    """P2: (dy in y's dtype, dg in gain's dtype)."""
    acc = acc_dtype(y)
    yf, g = y.to(acc), dx1.to(acc)
    u = g * gain.to(acc)
    dot = (u * yf).sum(-1)
    dy = r[:, None] * u - yf * (r.pow(3) * dot / y.shape[1])[:, None]
    return dy.to(y.dtype), (r[:, None] * yf * g).sum(0).to(gain.dtype)


def _output(x0, rows: tuple):
    """x1's storage: (*rows, d) where ``rows`` is given (a layer's output is a tensor of its
    own, not a view of an (M, d) one: FSDP2 warns of a module output that is a view)."""
    return x0.new_empty(*rows, x0.shape[1]) if rows else torch.empty_like(x0)


# -- the kernels --------------------------------------------------------------------------------
def _p1_launch(d: int) -> tuple[int, int]:
    """P1's (rows per program, warps): ``norm_rows``' launch shape, with two rows a program
    where that one has one and d <= 8192. One row's [1, T] partials reduced as a block ran 15x
    slower than the pass at bandwidth, growing with the warps (an H100 at d = 4096: 2.12 ms
    against 0.14 with two rows; session 73). Wider rows keep one row a program (two would
    spill) and reduce its partials as a vector (the kernel's ``BM == 1`` branch)."""
    bm, warps = _rows_launch(d)
    return (2, warps) if bm == 1 and d <= 8192 else (bm, warps)


def _post_norm_kernel(
    y, P, x0, g, g1, x1, r_out, a1, r1_out, M, D, T, eps,
    NEXT: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    live = rows < M
    r64 = rows.to(tl.int64)[:, None]
    ts = tl.arange(0, BT)
    if BM == 1:  # the row's partials as a vector (see ``_p1_launch``)
        p = tl.load(P + rows.to(tl.int64) * T + ts, mask=(ts < T) & (rows < M), other=0.0)
        r = tl.zeros([BM], dtype=ACC) + 1.0 / tl.sqrt(tl.sum(p.to(ACC), 0) / D + eps)
    else:
        p = tl.load(P + r64 * T + ts[None, :], mask=live[:, None] & (ts < T)[None, :], other=0.0)
        r = 1.0 / tl.sqrt(tl.sum(p.to(ACC), 1) / D + eps)
    tl.store(r_out + rows, r, mask=live)
    cols = tl.arange(0, BD)
    cmask = cols < D
    mask = live[:, None] & cmask[None, :]
    at = r64 * D + cols[None, :]
    yf = tl.load(y + at, mask=mask, other=0.0).to(ACC)
    gf = tl.load(g + cols, mask=cmask, other=0.0).to(ACC)[None, :]
    xf = tl.load(x0 + at, mask=mask, other=0.0).to(ACC) + r[:, None] * gf * yf
    tl.store(x1 + at, xf.to(x1.dtype.element_ty), mask=mask)
    if NEXT:
        tl.store(r1_out + rows, 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps), mask=live)
        g1f = tl.load(g1 + cols, mask=cmask, other=0.0).to(ACC)[None, :]
        tl.store(a1 + at, (xf * g1f).to(a1.dtype.element_ty), mask=mask)


def _post_norm_bwd_kernel(
    dx1, y, r, g, dy, Q, M, D,
    ROWS: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BD)
    cmask = cols < D
    gf = tl.load(g + cols, mask=cmask, other=0.0).to(ACC)[None, :]
    q = tl.zeros([BD], dtype=ACC)
    first = tl.program_id(0) * ROWS
    for i in range(0, ROWS, BM):
        rows = first + i + tl.arange(0, BM)
        live = rows < M
        mask = live[:, None] & cmask[None, :]
        at = rows.to(tl.int64)[:, None] * D + cols[None, :]
        yf = tl.load(y + at, mask=mask, other=0.0).to(ACC)
        df = tl.load(dx1 + at, mask=mask, other=0.0).to(ACC)
        rr = tl.load(r + rows, mask=live, other=0.0).to(ACC)[:, None]
        u = gf * df
        dot = tl.sum(u * yf, 1)[:, None]
        out = rr * u - yf * (rr * rr * rr * dot / D)
        tl.store(dy + at, out.to(dy.dtype.element_ty), mask=mask)
        q += tl.sum(rr * yf * df, 0)
    tl.store(Q + tl.program_id(0).to(tl.int64) * D + cols, q, mask=cmask)


def post_norm_triton(
    y, sumsq, x0, gain, eps: float, next_gain=None, rows: tuple = (), launch: tuple = None
):
    """P1 in one launch: y, x0 (M, d) contiguous, sumsq (M, T) contiguous, gains (d,).
    ``launch``: (rows per program, warps), default ``_p1_launch``'s (a probe's sweep)."""
    M, d = y.shape
    T = sumsq.shape[1]
    acc = acc_dtype(y)
    x1 = _output(x0, rows)
    r = y.new_empty(M, dtype=acc)
    nxt = next_gain is not None
    a1 = torch.empty_like(x0) if nxt else x0
    r1 = y.new_empty(M, dtype=acc) if nxt else r
    if M:
        bm, warps = launch or _p1_launch(d)
        kernel(_post_norm_kernel)[(cdiv(M, bm),)](
            y, sumsq, x0, gain, next_gain if nxt else gain, x1, r, a1, r1, M, d, T, eps,
            NEXT=nxt, BM=bm, BD=next_power_of_2(d), BT=next_power_of_2(max(T, 1)),
            ACC=acc_type(y), num_warps=warps,
        )  # fmt: skip
    return (x1, r, a1, r1) if nxt else (x1, r)


def post_norm_bwd_triton(dx1, y, r, gain, launch: tuple = None):
    """P2 in two launches (the pass, then its dg partials' column sums). ``launch``: (rows
    a block, warps), default ``norm_rows``' launch shape."""
    M, d = y.shape
    dy = torch.empty_like(y)
    q = y.new_empty(cdiv(M, ROWS), d, dtype=acc_dtype(y))
    if M:
        bm, warps = launch or _rows_launch(d)
        kernel(_post_norm_bwd_kernel)[(cdiv(M, ROWS),)](
            dx1, y, r, gain, dy, q, M, d,
            ROWS=ROWS, BM=bm, BD=next_power_of_2(d), ACC=acc_type(y), num_warps=warps,
        )  # fmt: skip
    return dy, col_sums(q, gain.dtype)


# -- what the kernel path calls -----------------------------------------------------------------
def _on_kernel(*tensors) -> bool:
    """The Triton kernels take contiguous rows up to ``MAX_ROW`` wide on the GPU (and in the
    interpreter), outside a torch.compile trace (the custom ops run them there)."""
    t = tensors[0]
    return (
        not torch.compiler.is_compiling()
        and on_triton(t)
        and t.shape[1] <= MAX_ROW
        and all(x is None or x.is_contiguous() for x in tensors)
    )


def post_norm(y, sumsq, x0, gain, eps: float, next_gain=None, rows: tuple = ()):
    """P1: x1 = x0 + rmsnorm(y) * gain, rounded once, from y's sum-of-squares partials
    ``sumsq`` (M, T); returns (x1, r) or, with ``next_gain``, (x1, r, a1, r1) (the module
    docstring). ``rows``: x1's leading dimensions (product M), default (M,)."""
    if _on_kernel(y, sumsq, x0, gain, next_gain):
        return post_norm_triton(y, sumsq, x0, gain, eps, next_gain, rows)
    out = post_norm_torch(y, sumsq, x0, gain, eps, next_gain)
    if not rows:
        return out
    x1 = _output(x0, rows)
    x1.view(out[0].shape).copy_(out[0])
    return (x1, *out[1:])


def post_norm_bwd(dx1, y, r, gain):
    """P2: (dy, dgain) from x1's gradient ``dx1`` (the residual's, dx0, is dx1 itself)."""
    if _on_kernel(y, dx1, r, gain):
        return post_norm_bwd_triton(dx1, y, r, gain)
    return post_norm_bwd_torch(dx1, y, r, gain)


def compile_post_norm(d: int, t: int, gain: str = "bf16", arch: int = 90) -> list[int]:
    """P1 (with and without the next norm) and P2 for bf16 rows of ``d`` entries and ``t``
    partials a row, compiled for ``sm_{arch}`` on the CPU: cubin sizes. ``gain``: the gains'
    Triton type ("fp32": Gemma's 1 + w)."""
    bm, warps = _p1_launch(d)
    bd = next_power_of_2(d)
    rows = {"y": "*bf16", "x0": "*bf16", "x1": "*bf16", "a1": "*bf16", "eps": "fp32"}
    pointers = {**rows, "P": "*fp32", "g": f"*{gain}", "g1": f"*{gain}"}
    pointers.update({"r_out": "*fp32", "r1_out": "*fp32"})
    sizes = [
        compile_sm90(
            _post_norm_kernel,
            pointers,
            {"NEXT": nxt, "BM": bm, "BD": bd, "BT": next_power_of_2(t), "ACC": tl.float32},
            warps,
            arch,
        )
        for nxt in (False, True)
    ]
    pointers = {"dx1": "*bf16", "y": "*bf16", "r": "*fp32", "g": f"*{gain}", "dy": "*bf16"}
    pointers["Q"] = "*fp32"
    bm, warps = _rows_launch(d)
    consts = {"ROWS": ROWS, "BM": bm, "BD": bd, "ACC": tl.float32}
    sizes.append(compile_sm90(_post_norm_bwd_kernel, pointers, consts, warps, arch))
    return sizes
