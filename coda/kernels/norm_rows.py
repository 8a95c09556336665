"""RMSNorm's row work outside the GEMMs, as hand-written Triton kernels on the GPU: the entry
norm (F0), the final norm before the LM head, and the AUX statistics that finish an
epilogue's per-tile partials (A1's rstd, A6/A8's correction, A7/A9's dgamma sums).

    F0:          a = x * gamma (x's dtype),          r = (mean_n x^2 + eps)^-1/2 (fp32)
    final norm:  y = x * r * gamma, rounded once,    r as above
    A1:          r[m]    = (sum_t P[m, t] / d + eps)^-1/2          (P: RED_m partials of h^2)
    A6:          corr[m] = -(r^3 / d) * sum_t P[m, t]              (P: partials of S)
    A8:          corr[m] = -(r^3 / d) * (sum_t P[m, t] / r)        (P: partials of S * r)
    A7 / A9:     dgamma[n] = sum_i Q[i, n], rounded once to gamma's dtype  (Q: RED_n partials)

Their torch forms (``entry_norm_torch``, ``final_norm_torch`` here, ``primitives.aux`` for
the AUX) are the CPU path and the oracle. Why kernels of our own: through ``fused``
(torch.compile) a norm paid a Dynamo guard check and Inductor's launcher on every call, and
an AUX statistic ran as three to five eager torch kernels (sum, mul, add, rsqrt / pow), a
launch each; here each is one launch (measured in benchmarks/NOTES.md, session 13). One
program per block of rows reads the row (or its partials) once; sums are in a fixed order
(no atomics). Under torch.compile the norms stay these kernels (``library.norm_rows``, a
custom op: the compiled step runs the eager step's norm kernels), and so do the AUX
statistics a GEMM op computes (A1, A7, A8, A9: inside the op); A6's, which the MLP's
backward calls between ops, is traced as its torch form for Inductor. Rows the kernel does not
take (wider than ``MAX_ROW``, strided columns) take the torch forms through
``fused``. Float64 inputs accumulate in float64 (the interpreter proofs on the CPU).
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._launch import acc_dtype, fused
from coda.kernels._triton import acc_type, cdiv, compile_sm90, kernel, next_power_of_2, on_triton
from coda.primitives.aux import combine_col_partials, norm_correction, rstd_from_sumsq

MAX_ROW = 16384  # widest row one program holds in registers; wider rows take the torch form
# the kernels on the GPU; False: the norms through ``fused`` (Inductor) and the statistics as
# eager torch ops, as before these kernels (the benchmarks' same-run comparison)
TRITON = True
# the AUX statistics' modes
RSTD, CORR, CORR_SCALED = 0, 1, 2


# -- torch forms: the CPU path and the oracle ---------------------------------------------------
def _row_rstd(xf, eps):
    return torch.rsqrt(xf.pow(2).mean(-1) + eps)


def entry_norm_torch(x, gamma, eps):
    acc = acc_dtype(x)
    xf = x.to(acc)
    return (xf * gamma.to(acc)).to(x.dtype), _row_rstd(xf, eps)


def final_norm_torch(x, gamma, eps):
    acc = acc_dtype(x)
    xf = x.to(acc)
    r = _row_rstd(xf, eps)
    return (xf * r[:, None] * gamma.to(acc)).to(x.dtype), r


def row_stat_torch(partials, rstd, d: int, eps: float, mode: int):
    if mode == RSTD:
        return rstd_from_sumsq(partials, d, eps)
    s = partials.sum(-1)
    return norm_correction(rstd, s if mode == CORR else s / rstd, d)


# -- the kernels --------------------------------------------------------------------------------
def _norm_rows_kernel(
    x, gamma, out, rstd, M, D, x_row, out_row, eps,
    SCALED: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.arange(0, BD)
    live = rows < M
    mask = live[:, None] & (cols < D)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    xf = tl.load(x + r64 * x_row + cols[None, :], mask=mask, other=0.0).to(ACC)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / D + eps)
    tl.store(rstd + rows, r, mask=live)
    g = tl.load(gamma + cols, mask=cols < D, other=0.0).to(ACC)[None, :]
    y = xf * r[:, None] * g if SCALED else xf * g
    tl.store(out + r64 * out_row + cols[None, :], y.to(out.dtype.element_ty), mask=mask)


def _row_stat_kernel(
    P, rstd, out, M, T, p_row, d, eps,
    MODE: tl.constexpr, BM: tl.constexpr, BT: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    live = rows < M
    r64 = rows.to(tl.int64)[:, None]
    s = tl.zeros([BM], dtype=ACC)
    for t0 in range(0, T, BT):
        cols = t0 + tl.arange(0, BT)
        mask = live[:, None] & (cols < T)[None, :]
        s += tl.sum(tl.load(P + r64 * p_row + cols[None, :], mask=mask, other=0.0).to(ACC), 1)
    if MODE == 0:
        res = 1.0 / tl.sqrt(s / d + eps)
    else:
        r = tl.load(rstd + rows, mask=live, other=1.0).to(ACC)
        if MODE == 2:
            s = s / r
        res = -(s * (r * r * r)) / d
    tl.store(out + rows, res, mask=live)


def _col_sums_kernel(
    Q, out, T, N, q_row, BT: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr
):  # fmt: skip
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    live = cols < N
    s = tl.zeros([BN], dtype=ACC)
    for t0 in range(0, T, BT):
        rows = t0 + tl.arange(0, BT)
        mask = (rows < T)[:, None] & live[None, :]
        q = tl.load(Q + rows.to(tl.int64)[:, None] * q_row + cols[None, :], mask=mask, other=0.0)
        s += tl.sum(q.to(ACC), 0)
    tl.store(out + cols, s.to(out.dtype.element_ty), mask=live)


COL_BLOCK = 64  # columns per program of the partials' sums: 32 programs at d = 2048


def _rows_launch(d: int) -> tuple[int, int]:
    """(rows per program, warps) for rows of ``d`` entries: ~4k values per program."""
    bd = next_power_of_2(max(d, 16))
    return max(1, min(16, 4096 // bd)), 4 if bd <= 2048 else 8 if bd <= 8192 else 16


def norm_rows_triton(x, gamma, eps: float, scaled: bool):
    """F0 (``scaled`` False) or the final norm (True) in one pass: x (M, d) with unit column
    stride, gamma (d,) contiguous. Returns (out in x's dtype, rstd fp32 / float64)."""
    M, d = x.shape
    assert x.stride(1) == 1 and gamma.is_contiguous() and d <= MAX_ROW
    out = x.new_empty(M, d)
    r = x.new_empty(M, dtype=acc_dtype(x))
    if M:
        bm, warps = _rows_launch(d)
        kernel(_norm_rows_kernel)[(cdiv(M, bm),)](
            x, gamma, out, r, M, d, x.stride(0), d, eps,
            SCALED=scaled, BM=bm, BD=next_power_of_2(d), ACC=acc_type(x), num_warps=warps,
        )  # fmt: skip
    return out, r


def row_stat_triton(partials, rstd, d: int, eps: float, mode: int):
    """An AUX statistic (``mode``: RSTD, CORR or CORR_SCALED) from (M, T) per-tile partials
    with unit column stride in one pass. Returns (M,) in the partials' dtype."""
    M, T = partials.shape
    assert partials.stride(1) == 1 or T == 1
    out = partials.new_empty(M)
    if M:
        bm = 128
        kernel(_row_stat_kernel)[(cdiv(M, bm),)](
            partials, partials if rstd is None else rstd, out, M, T, partials.stride(0), d, eps,
            MODE=mode, BM=bm, BT=min(64, next_power_of_2(max(T, 1))),
            ACC=acc_type(partials), num_warps=4,
        )  # fmt: skip
    return out


def col_sums_triton(partials, dtype):
    """A7 / A9: the column sums of (T, N) per-tile partials with unit column stride, summed
    in the partials' dtype and rounded once to ``dtype``, in one launch."""
    T, N = partials.shape
    assert partials.stride(1) == 1 or N == 1
    out = partials.new_empty(N, dtype=dtype)
    if N:
        kernel(_col_sums_kernel)[(cdiv(N, COL_BLOCK),)](
            partials, out, T, N, partials.stride(0),
            BT=64, BN=COL_BLOCK, ACC=acc_type(partials), num_warps=4,
        )  # fmt: skip
    return out


# -- what the kernel path calls -----------------------------------------------------------------
def _on_kernel(t) -> bool:
    """The Triton kernel runs on the GPU (and in the interpreter), outside a torch.compile
    trace, where the torch form is traced and fused instead."""
    return TRITON and not torch.compiler.is_compiling() and on_triton(t)


def _rows_fit(x, gamma) -> bool:
    """The norm kernel takes rows of unit column stride up to ``MAX_ROW`` wide and a
    contiguous gamma; anything else takes the torch form."""
    return x.shape[1] <= MAX_ROW and x.stride(1) == 1 and gamma.is_contiguous()


def norm_rows(x, gamma, eps: float, scaled: bool):
    """F0 (``scaled`` False): (a = x * gamma in x's dtype, r fp32), the norm of a layer's input
    when no producing GEMM computed it; or (True) the final norm before the LM head: y = x *
    rstd * gamma rounded once (as ``F.rms_norm``), and rstd. The LM head takes y, not the
    deferred-scale x * gamma: the loss gradient then enters its GEMMs unscaled, rounded
    exactly as PyTorch rounds it. The kernel path reaches it through ``library.norm_rows`` (a
    custom op under torch.compile). The output is row-major whatever x's strides (the torch
    form would keep a column-major x's): the op's fake implementation says so."""
    if _on_kernel(x) and _rows_fit(x, gamma):
        return norm_rows_triton(x, gamma, eps, scaled)
    out, r = fused(final_norm_torch if scaled else entry_norm_torch)(x, gamma, eps)
    return out.contiguous(), r


def row_stat(partials, rstd, d: int, eps: float = 0.0, mode: int = RSTD):
    """An AUX statistic from per-tile row partials (the module docstring's A1, A6, A9)."""
    if _on_kernel(partials):
        return row_stat_triton(partials, rstd, d, eps, mode)
    return row_stat_torch(partials, rstd, d, eps, mode)


def col_sums(partials, dtype):
    """dgamma from the norm-backward GEMM's RED_n partials (T, N): summed in fp32 (float64
    for proofs) and rounded once to ``dtype`` (gamma's), as one launch on the GPU where torch
    ran a reduction and a cast (two launches of ~8 and ~3 us per layer norm)."""
    if _on_kernel(partials):
        return col_sums_triton(partials, dtype)
    return combine_col_partials(partials).to(dtype)


def compile_norm_rows(d: int, arch: int = 90, gamma: str = "bf16") -> list[int]:
    """The three kernels (bf16 rows, fp32 statistics) at their launch shapes for rows of ``d``
    entries, compiled for ``sm_{arch}`` on the CPU: cubin sizes. ``gamma``: the gain's and
    dgamma's Triton type ("fp32": the LM head's final norm given an fp32 gain, Gemma's)."""
    bm, warps = _rows_launch(d)
    pointers = {"x": "*bf16", "gamma": f"*{gamma}", "out": "*bf16", "rstd": "*fp32", "eps": "fp32"}
    sizes = [
        compile_sm90(
            _norm_rows_kernel,
            pointers,
            {"SCALED": s, "BM": bm, "BD": next_power_of_2(d), "ACC": tl.float32},
            warps,
            arch,
        )
        for s in (False, True)
    ]
    pointers = {"P": "*fp32", "rstd": "*fp32", "out": "*fp32", "eps": "fp32"}
    for mode in (RSTD, CORR, CORR_SCALED):
        consts = {"MODE": mode, "BM": 128, "BT": 64, "ACC": tl.float32}
        sizes.append(compile_sm90(_row_stat_kernel, pointers, consts, 4, arch))
    pointers = {"Q": "*fp32", "out": f"*{gamma}"}
    consts = {"BT": 64, "BN": COL_BLOCK, "ACC": tl.float32}
    sizes.append(compile_sm90(_col_sums_kernel, pointers, consts, 4, arch))
    return sizes
