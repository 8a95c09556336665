"""The LM head's two passes over a call's whole rows, one Triton launch each:

    weights  w[m] = [t_m != ignore] / max(1, M_valid)   ("mean"), or [t_m != ignore] (else)
    loss     l[m] = [t_m != ignore] (lse - (1 - eps) l_y - (eps / V) sum_n l_n + z lse^2),
             then "none" (the rows), "sum", or "mean" (/ M_valid: NaN when every row is ignored)

(A3 and the gradient's row weights, docs/KERNELS.md; the torch forms, the CPU path and the
oracle, are ``primitives.aux.ce_row_weights`` and ``ce_loss_from_stats``.) Those forms cost
five and seven small launches a call (comparisons, casts, two reductions, a division, a
select), ~12 of an LM-head forward's ~30 launches and ~2 us of GPU time each
(benchmarks/NOTES.md, session 46's "noticed and left"). Both passes need a reduction over
the whole call (M_valid, the loss's sum) before or after their rows, so each is one program
walking the rows in blocks: one launch, a fixed summation order (deterministic), at ~16
bytes a row read once or twice by one SM, where the LM head's GEMMs read and write M x V.
Under a torch.compile trace, on rows that are not contiguous, on an empty call, past
``MAX_ROWS`` (where one program reading every row is slower than torch's kernels: measured)
and where ``TRITON`` is off, the torch form runs (Inductor fuses it under a trace).
Tests: tests/test_loss_rows.py (Triton's interpreter in float64 against the torch forms,
every reduction and option; the sm_90 compile; on the H200 the kernel against the torch form).
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda.kernels._triton import compile_sm90, contiguous_pass, div_rn, kernel, next_power_of_2
from coda.primitives import aux

MAX_BLOCK = 16384  # rows a program step reads, at most
ROWS_PER_THREAD = 16
# Rows up to which each one-program kernel beats its torch form in GPU time (run 203,
# ``benchmarks/probe_loss_rows.py``, graphed: the weights' 12.3 against 16.1 us at 16384 rows,
# 32.7 against 21.5 at 65536; the loss's 15.2 against 32.7 at 65536, 41.3 against 33.6 at
# 262144). Past them a call's GEMMs take tens of ms and the host is far ahead: the torch form.
MAX_ROWS = {"weights": 32768, "loss": 131072}
TRITON = True  # False: the torch forms on the GPU too (the benchmarks' same-run comparison)
_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}


def _row_weights_kernel(t_ptr, w_ptr, n, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    ACC: tl.constexpr = w_ptr.dtype.element_ty
    count = tl.zeros((BLOCK,), tl.int32)
    if MEAN:  # M_valid first: every row's weight needs it
        for s in range(0, n, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            t = tl.load(t_ptr + offs, mask=offs < n, other=ignore_index)
            count += (t != ignore_index).to(tl.int32)
    denom = tl.maximum(tl.sum(count), 1).to(ACC)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        t = tl.load(t_ptr + offs, mask=offs < n, other=ignore_index)
        valid = (t != ignore_index).to(ACC)
        w = div_rn(valid, denom) if MEAN else valid
        tl.store(w_ptr + offs, w, mask=offs < n)


def _loss_kernel(
    lse_ptr, y_ptr, t_ptr, sum_ptr, out_ptr, n, ignore_index, vocab, smoothing, z_loss,
    REDUCTION: tl.constexpr, SMOOTH: tl.constexpr, Z: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    ACC: tl.constexpr = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK,), ACC)
    count = tl.zeros((BLOCK,), tl.int32)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        m = offs < n
        t = tl.load(t_ptr + offs, mask=m, other=ignore_index)
        lse = tl.load(lse_ptr + offs, mask=m, other=0.0)
        y = tl.load(y_ptr + offs, mask=m, other=0.0)
        per = lse - y
        if SMOOTH:  # as the torch form: eps (l_y - sum_n l_n / V)
            per = per + smoothing * (y - div_rn(tl.load(sum_ptr + offs, mask=m, other=0.0), vocab))
        if Z:
            per = per + z_loss * lse * lse
        valid = t != ignore_index
        per = tl.where(valid, per, 0.0)  # (a select: an ignored row's NaN or inf stays out)
        if REDUCTION == 0:
            tl.store(out_ptr + offs, per, mask=m)
        else:
            total += per
            count += valid.to(tl.int32)
    if REDUCTION != 0:
        loss = tl.sum(total)
        if REDUCTION == 2:  # 0 / 0 = NaN when every row is ignored, as PyTorch's mean
            loss = div_rn(loss, tl.sum(count).to(ACC))
        tl.store(out_ptr, loss)


def launch_shape(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for n rows: every row in one step up to ``MAX_BLOCK`` (one program,
    so latency bounds it: as many loads in flight as it can hold), ``ROWS_PER_THREAD`` a
    thread. Chosen by ``benchmarks/probe_loss_rows.py`` (benchmarks/NOTES.md, session 47)."""
    block = min(MAX_BLOCK, max(1024, next_power_of_2(n)))
    return block, max(4, min(32, block // (32 * ROWS_PER_THREAD)))


def _triton_pass(which: str, *tensors) -> bool:
    n = tensors[0].numel()
    return TRITON and 0 < n <= MAX_ROWS[which] and contiguous_pass(*tensors)


def ce_row_weights(target, ignore_index: int, reduction: str, dtype=torch.float32):
    """``aux.ce_row_weights`` (the per-row weight of the loss gradient), one launch on a GPU."""
    if not _triton_pass("weights", target):
        return aux.ce_row_weights(target, ignore_index, reduction, dtype)
    w = torch.empty(target.shape, dtype=dtype, device=target.device)
    n = target.numel()
    block, warps = launch_shape(n)
    kernel(_row_weights_kernel)[(1,)](
        target, w, n, ignore_index, MEAN=reduction == "mean", BLOCK=block, num_warps=warps
    )
    return w


def ce_loss_from_stats(
    lse, target_logit, target, ignore_index: int, reduction: str, *, logit_sum=None,
    vocab: int = 0, label_smoothing: float = 0.0, z_loss: float = 0.0,
):  # fmt: skip
    """``aux.ce_loss_from_stats`` (A3: the per-row loss and its reduction), one launch on a
    GPU."""
    rows = (lse, target_logit, target) + (() if logit_sum is None else (logit_sum,))
    if not _triton_pass("loss", *rows):
        return aux.ce_loss_from_stats(
            lse, target_logit, target, ignore_index, reduction, logit_sum=logit_sum,
            vocab=vocab, label_smoothing=label_smoothing, z_loss=z_loss,
        )  # fmt: skip
    smooth = bool(label_smoothing)
    out = torch.empty(lse.shape if reduction == "none" else (), dtype=lse.dtype, device=lse.device)
    n = lse.numel()
    block, warps = launch_shape(n)
    kernel(_loss_kernel)[(1,)](
        lse, target_logit, target, logit_sum if smooth else lse, out, n, ignore_index,
        float(vocab or 1), float(label_smoothing), float(z_loss),
        REDUCTION=_REDUCTIONS[reduction], SMOOTH=smooth, Z=bool(z_loss), BLOCK=block,
        num_warps=warps,
    )  # fmt: skip
    return out


# -- sm_90 compiles without a GPU (tests/test_loss_rows.py) ---------------------------------------
def compile_row_weights(mean: bool, target: str = "*i64", n: int = MAX_BLOCK) -> int:
    """The weights' kernel for sm_90 as a call of ``n`` rows launches it: its cubin's size."""
    block, warps = launch_shape(n)
    consts = {"MEAN": mean, "BLOCK": block}
    return compile_sm90(_row_weights_kernel, {"t_ptr": target, "w_ptr": "*fp32"}, consts, warps)


def compile_loss(reduction: str, smooth: bool, z: bool, target="*i64", n=MAX_BLOCK) -> int:
    """The loss's kernel for sm_90 as a call of ``n`` rows launches it: its cubin's size."""
    block, warps = launch_shape(n)
    fp32 = ("lse_ptr", "y_ptr", "sum_ptr", "out_ptr", "vocab", "smoothing", "z_loss")
    types = {"t_ptr": target, **{p: "*fp32" if p.endswith("_ptr") else "fp32" for p in fp32}}
    consts = {"REDUCTION": _REDUCTIONS[reduction], "SMOOTH": smooth, "Z": z, "BLOCK": block}
    return compile_sm90(_loss_kernel, types, consts, warps)  # (the rest are i32: n, ignore)
