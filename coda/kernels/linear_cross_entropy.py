"""LM head + cross-entropy forward, logits never written (KERNELS.md F6 + A3).

    acc = a @ W_lm                      a = x2 * gamma_f (from the last GEMM1), W_lm (d x V)
    l   = rstd * acc                    VEC-LD COL rstd (the final norm's deferred row scale)
    part[m, t] = log sum_{n in t} exp l    LSE: online (max, sum-exp) over the tile's subtiles
    l_y[m] = l[m, y_m]                  VEC-ST COL, written by the one tile holding y_m
AUX:  lse = logsumexp_t part;  loss = sum_m w_m (lse_m - l_y[m])   (w: mean over valid rows)

With a logit soft-cap c (Gemma 2's ``final_logit_softcapping``; ``capped_logits_lse_target``):
the LSE is over z = c tanh(l / c), formed as c (2 sigmoid(2 l / c) - 1) (no cancellation
worse than fp32's absolute round-off), the target's l_y stored uncapped (the loss caps it,
``softcap_rows``; the backward needs both); c arrives as a per-row operand (VEC-LD COL cap,
every entry c, filled per call), so one compiled kernel serves every cap.

Ragged last vocabulary tile: columns past V count as -inf. Rows whose target is outside
[0, V) (ignore_index) are never selected and get weight 0. Supported: bf16, d and V multiples
of 8; any M. Backward (dlogits from the saved lse, tile by tile) is the training issue's.
Tests: tests/test_forward_kernels.py.
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.loss_rows import ce_loss_from_stats
from coda.primitives import ColLoad, ColSelect, OnlineLSE, epilogue_program, sigmoid
from coda.primitives.aux import combine_lse
from coda.reference.cross_entropy import linear_cross_entropy_ref  # noqa: F401  (the reference)


@epilogue_program(
    inputs=[ColLoad("rstd")],
    sinks=[OnlineLSE("lse"), ColSelect("target_logit", index="target")],
    writes_d=False,
)
def logits_lse_target(acc, rstd):
    logit = acc * rstd
    return {"lse": logit, "target_logit": logit}


@epilogue_program(
    inputs=[ColLoad("rstd"), ColLoad("cap")],
    sinks=[OnlineLSE("lse"), ColSelect("target_logit", index="target")],
    writes_d=False,
)
def capped_logits_lse_target(acc, rstd, cap):
    logit = acc * rstd
    return {"lse": cap * (2.0 * sigmoid(logit * (2.0 / cap)) - 1.0), "target_logit": logit}


def softcap_rows(logit, cap: float):
    """z = c tanh(l / c): the soft-capped logits (the target's, for the loss)."""
    return torch.tanh(logit * (1.0 / cap)) * cap


def capped_with_slope(logit, cap: float):
    """(z, dz/dl) = (c tanh(l / c), 1 - tanh^2(l / c)) of the targets' uncapped logits: their
    p_y's logit and the slope their gradient entries take (both gradient programs')."""
    t = torch.tanh(logit * (1.0 / cap))
    return t * cap, 1.0 - t * t


def lm_head_stats_kernel(
    a, w_lm, rstd, target, config: GemmConfig = DEFAULT, dry=False, softcap: float | None = None
):
    """Returns (lse partials M x T_N, target logit (M,) fp32, 0 where not selected); with a
    ``softcap`` c the partials are over the capped logits, the target logit uncapped."""
    M, V = a.shape[0], w_lm.shape[1]
    outputs = {
        "lse": a.new_empty(M, config.grid(M, V)[1], dtype=acc_dtype(a)),
        "target_logit": a.new_zeros(M, dtype=acc_dtype(a)),
    }
    operands = {"rstd": rstd, "target": target}
    program = logits_lse_target
    if softcap is not None:  # (c in every row: one kernel for every cap)
        operands["cap"] = torch.full((M,), softcap, dtype=acc_dtype(a), device=a.device)
        program = capped_logits_lse_target
    compiled = launch(program, a, w_lm, config=config, operands=operands, outputs=outputs, dry=dry)
    return compiled if dry else (outputs["lse"], outputs["target_logit"])


def logits_row_sum(a, w_lm, rstd=None):
    """sum_n l_n per row, l = rstd * (a @ w_lm): rstd * (a . sum_n W[:, n]), one GEMV instead
    of a pass over the logits (label smoothing's uniform term); rstd None means 1."""
    acc = acc_dtype(a)
    s = a.to(acc) @ w_lm.sum(1, dtype=acc)
    return s if rstd is None else rstd * s


def linear_cross_entropy_kernel(
    a,
    w_lm,
    rstd,
    target,
    ignore_index=-100,
    reduction="mean",
    config: GemmConfig = DEFAULT,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
):
    """F6 + A3 (+ ``logits_row_sum`` with label smoothing)."""
    from coda.kernels import library  # its custom op while torch.compile traces

    parts, tl = library.lm_head_stats(a, w_lm, rstd, target, config)
    lse = combine_lse(parts)
    logit_sum = logits_row_sum(a, w_lm, rstd) if label_smoothing else None
    loss = ce_loss_from_stats(
        lse,
        tl,
        target,
        ignore_index,
        reduction,
        logit_sum=logit_sum,
        vocab=w_lm.shape[1],
        label_smoothing=label_smoothing,
        z_loss=z_loss,
    )
    return loss, lse


def lm_head_stats_interpreted(
    a, w_lm, rstd, target, config: GemmConfig = DEFAULT, softcap: float | None = None
):
    operands = {"rstd": rstd, "target": target}
    program = logits_lse_target if softcap is None else capped_logits_lse_target
    if softcap is not None:
        operands["cap"] = torch.full((a.shape[0],), softcap, dtype=acc_dtype(a))
    out = interpret_gemm(program, a, w_lm, config=config, operands=operands)
    return out["lse"], torch.nan_to_num(out["target_logit"], nan=0.0)


def compile_lm_head_stats(k, v, *, w_major="n", config=DEFAULT, m=256, capped=False) -> int:
    a, w = example_operands(m, k, v, w_major)
    target = torch.zeros(m, dtype=torch.int64)
    softcap = 30.0 if capped else None
    return lm_head_stats_kernel(a, w, torch.empty(m), target, config, dry=True, softcap=softcap)
