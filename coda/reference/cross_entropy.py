"""Pure-torch references for cross-entropy fused into the LM head (KERNELS.md section 4).

logits l = r_f * (a_f @ W_lm); lse[m] = log sum_n exp l[m, n]; loss_m = lse[m] - l[m, y_m];
L = sum_m w[m] loss_m with w = 1/M_valid on rows whose target is not ``ignore_index``
(PyTorch "mean"), or w = 1 ("sum").

- F6 epilogue: per-(row, N-tile) log-sum-exp partials and the target logit (VEC-ST COL)
- A3 combine:  lse = logsumexp over tiles [I4.2]; loss as above [I4.3]
- CE-S GEMM1:  softmax numerators with power-of-two per-tile offsets (``scaled_exp_logits_ref``)
- backward:    dl = g * w * (softmax(l) - onehot(y)) [I4.4]
"""

from __future__ import annotations

import math

import torch

from coda.reference.rmsnorm import ref_dtype


def cross_entropy_ref(
    logits,
    target,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
):
    """Canonical CE in the logits' reference precision (``F.cross_entropy``, its label
    smoothing included), plus the z-loss z * logsumexp(l)^2 on every non-ignored row (as
    PaLM's auxiliary loss), reduced the same way; with ``softcap`` c, of the soft-capped
    logits c tanh(l / c) (Gemma 2's), formed in that precision."""
    lf, t = logits.to(ref_dtype(logits)), target.long()
    if softcap is not None:
        lf = softcap * torch.tanh(lf / softcap)
    if not z_loss:
        return torch.nn.functional.cross_entropy(
            lf, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )
    per = torch.nn.functional.cross_entropy(
        lf, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    valid = t != ignore_index
    per = per + torch.where(valid, z_loss * torch.logsumexp(lf, -1).pow(2), torch.zeros_like(per))
    if reduction == "none":
        return per
    return per.sum() / valid.sum() if reduction == "mean" else per.sum()


def lse_partials_ref(logits: torch.Tensor, tile_n: int) -> torch.Tensor:
    """F6 LSE partials: part[m, t] = logsumexp over the columns of N-tile t."""
    M, V = logits.shape
    pad = (-V) % tile_n
    lp = torch.nn.functional.pad(logits, (0, pad), value=-math.inf)
    return torch.logsumexp(lp.view(M, -1, tile_n), dim=-1)


def scaled_exp_logits_ref(a, w_lm, rstd, target, tile_n: int):
    """The scaled-exp GEMM's outputs (``kernels/ce_scaled_exp.py``) from their definitions,
    in a's precision: E = 2^(l log2 e - k) with k = rne(log2 e * max of l over each
    tile_n-column tile), its per-tile sums, k, and the target logit (0 where y is outside V)."""
    logits = rstd[:, None] * (a @ w_lm)
    M, V = logits.shape
    tiles = logits.view(M, V // tile_n, tile_n)
    k = torch.round(tiles.amax(-1) / math.log(2.0))  # torch.round is half-to-even
    e = torch.exp2(tiles / math.log(2.0) - k[..., None])
    hit = (target >= 0) & (target < V)
    tl = torch.where(hit, logits.gather(1, target.clamp(0, V - 1).long()[:, None])[:, 0], 0.0)
    return e.reshape(M, V), e.sum(-1), k, tl


def lse_combine_ref(partials: torch.Tensor) -> torch.Tensor:
    """A3: lse = logsumexp_t part[m, t] (associative, commutative)."""
    return torch.logsumexp(partials, dim=-1)


def row_weights_ref(target, ignore_index: int = -100, reduction: str = "mean", dtype=torch.float64):
    """w[m]: 1/M_valid ("mean") or 1 ("sum", "none") on rows whose target is not
    ``ignore_index``, 0 on the others."""
    valid = (target != ignore_index).to(dtype)
    return valid / valid.sum().clamp(min=1) if reduction == "mean" else valid


def ce_from_stats_ref(lse, target_logit, target, ignore_index=-100, reduction="mean"):
    """A3: per-row loss lse[m] - l[m, y_m] (0 on ignored rows); L = sum_m w[m] * that, or
    the per-row losses for reduction "none"."""
    per_row = torch.where(target != ignore_index, lse - target_logit, torch.zeros_like(lse))
    if reduction == "none":
        return per_row
    if reduction == "mean":  # 0/0 = NaN when every row is ignored, as in PyTorch
        return per_row.sum() / (target != ignore_index).sum()
    return per_row.sum()


def linear_cross_entropy_ref(
    a, w_lm, r, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0
):
    """Reference of the fused LM head + CE: l = r * (a @ w_lm), then canonical CE."""
    dt = ref_dtype(a, w_lm)
    logits = r.to(dt)[:, None] * (a.to(dt) @ w_lm.to(dt))
    return cross_entropy_ref(logits, target, ignore_index, reduction, label_smoothing, z_loss)


def dlogits_ref(logits, lse, target, ignore_index=-100, reduction="mean", grad=1.0):
    """[I4.4] dl = g * w * (exp(l - lse) - onehot(y))."""
    w = row_weights_ref(target, ignore_index, reduction).to(logits.dtype)
    p = torch.exp(logits - lse[:, None])
    onehot = torch.zeros_like(p)
    valid = target != ignore_index
    onehot[valid.nonzero()[:, 0], target[valid]] = 1
    return grad * w[:, None] * (p - onehot)


def linear_cross_entropy_torch(a, w_lm, r, target, ignore_index=-100, reduction="mean"):
    """The plain PyTorch (HF) path: bf16 logits, upcast, cross-entropy."""
    y = (a.float() * r[:, None]).to(a.dtype)
    logits = y @ w_lm
    return torch.nn.functional.cross_entropy(
        logits.float(), target, ignore_index=ignore_index, reduction=reduction
    )
