"""LM head + cross-entropy forward AND backward in three GEMMs, chunked over tokens
(KERNELS.md section 4, CE-C): the fast alternative to CE-A's four.

The upstream gradient of a "mean" or "sum" loss is a scalar g, and every gradient is linear
in it, so the forward computes them for g = 1 and the backward only scales (the Liger /
QuACK chunked design). For each chunk of rows R (one chunk of bf16 logits live at a time):

    F6'  acc = a[R] @ W_lm                 l = rstd * acc: TILE-ST l (bf16), LSE partials and
                                           the target logit from the fp32 l (the loss's stats)
    row  p = softmax(l) over the stored l  (its own logsumexp, so sum p = 1 against what is
         stored; KERNELS.md 7); dl = w (p - onehot); dz~ = rstd * dl written over l;
         S = sum_n dl * l / rstd           the final norm's statistic
    B2'  G[R] = dz~ @ W_lm^T               (bf16, M x d)
    B3'  dW_lm += a[R]^T @ dz~             (bf16 accumulate, one rounding per chunk)
then   dh = gamma * G + corr * h, dgamma = sum_m G * h  (corr = -(rstd^3 / d) S).

Extra memory: one (chunk x V) bf16 logits buffer plus G; no fp32 d x V buffer.
Tests: tests/test_backward_kernels.py (CPU loop), tests/test_forward_kernels.py (compile).
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, fused, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.primitives import ColLoad, ColSelect, OnlineLSE, epilogue_program
from coda.primitives.aux import combine_lse


@epilogue_program(
    inputs=[ColLoad("rstd")],
    sinks=[OnlineLSE("lse"), ColSelect("target_logit", index="target")],
)
def logits_with_stats(acc, rstd):
    logit = acc * rstd
    return {"D": logit, "lse": logit, "target_logit": logit}


def logits_chunk(a, w_lm, rstd, target, config: GemmConfig = DEFAULT, dry=False):
    """F6' on rows ``a``: returns (logits bf16, lse fp32, target logit fp32)."""
    M, V = a.shape[0], w_lm.shape[1]
    logits = torch.empty(M, V, dtype=a.dtype, device=a.device)
    outputs = {
        "lse": torch.empty(M, config.grid(M, V)[1], dtype=acc_dtype(a), device=a.device),
        "target_logit": torch.zeros(M, dtype=acc_dtype(a), device=a.device),
    }
    compiled = launch(
        logits_with_stats,
        a,
        w_lm,
        config=config,
        d=logits,
        operands={"rstd": rstd, "target": target},
        outputs=outputs,
        dry=dry,
    )
    if dry:
        return compiled
    return logits, combine_lse(outputs["lse"]), outputs["target_logit"]


def logits_chunk_interpreted(a, w_lm, rstd, target, config: GemmConfig = DEFAULT):
    out = interpret_gemm(
        logits_with_stats,
        a,
        w_lm,
        config=config,
        operands={"rstd": rstd, "target": target},
        out_dtype=a.dtype,
    )
    return out["D"], combine_lse(out["lse"]), torch.nan_to_num(out["target_logit"], nan=0.0)


def softmax_grad_rows(logits, target, rstd, weight, label_smoothing=0.0, z_loss=0.0):
    """The row kernel: dz~ = rstd * dl over stored logits (written in place), with
    dl = w * ((1 + 2 z lse) softmax(l) - (1 - eps) onehot(y) - eps / V) (z-loss z, label
    smoothing eps), and S = sum_n dl * l / rstd. Rows with w = 0 (ignored) give zeros."""
    lf = logits.float() if logits.dtype != torch.float64 else logits
    lse = torch.logsumexp(lf, dim=-1, keepdim=True)
    p = torch.exp(lf - lse)
    if z_loss:
        p = p * (1.0 + 2.0 * z_loss * lse)
    onehot = torch.zeros_like(p).scatter_(1, target.clamp(min=0)[:, None], 1.0 - label_smoothing)
    dl = weight[:, None] * (p - onehot - label_smoothing / lf.shape[1])
    S = (dl * lf).sum(-1) / rstd
    logits.copy_(rstd[:, None] * dl)
    return S


def linear_cross_entropy_chunked(
    a,
    w_lm,
    rstd,
    target,
    weight,
    rows: int = 4096,
    config: GemmConfig = DEFAULT,
    interpreted: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
):
    """Forward stats and g = 1 gradients. Returns (lse, target_logit, G (M x d), S, dW_lm).
    ``weight`` is the per-row loss weight (1/M_valid or 1; 0 on ignored rows)."""
    M, d = a.shape
    lse = torch.empty(M, dtype=acc_dtype(a) if not interpreted else a.dtype, device=a.device)
    tl, S = torch.empty_like(lse), torch.empty_like(lse)
    G = torch.empty(M, d, dtype=a.dtype, device=a.device)
    # dW sums one partial product per token chunk: in fp32 when there are several, rounded to
    # w_lm's dtype once (a bf16 running sum would round once per chunk)
    n_chunks = -(-M // rows)
    dw = torch.zeros_like(w_lm, dtype=acc_dtype(a) if n_chunks > 1 else w_lm.dtype)
    row_kernel = softmax_grad_rows if interpreted else fused(softmax_grad_rows)
    for r0 in range(0, M, rows):
        R = slice(r0, min(r0 + rows, M))
        chunk = logits_chunk_interpreted if interpreted else logits_chunk
        logits, lse[R], tl[R] = chunk(a[R], w_lm, rstd[R], target[R], config)
        S[R] = row_kernel(
            logits, target[R], rstd[R], weight[R].to(lse.dtype), label_smoothing, z_loss
        )
        torch.mm(logits, w_lm.t(), out=G[R])  # B2'
        if dw.dtype == logits.dtype:
            dw.addmm_(a[R].t(), logits)  # B3'
        else:
            dw.add_(torch.mm(a[R].t(), logits))  # B3': bf16 GEMM (fp32 accumulate), fp32 sum
    return lse, tl, G, S, dw.to(w_lm.dtype)


def compile_logits_chunk(d, v, *, w_major="n", config=DEFAULT, m=256) -> int:
    a, w = example_operands(m, d, v, w_major)
    return logits_chunk(a, w, torch.empty(m), torch.zeros(m, dtype=torch.int64), config, dry=True)
