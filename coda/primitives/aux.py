"""AUX: the small reductions that finish what the epilogues left as per-tile partials.

They read O(M * T_N) or O(T_M * N) floats, never a full activation, and reduce in a fixed
order (no atomics), so results repeat run to run. One implementation serves both lowerings:
the partial arrays have the same shapes on the CPU and on the GPU.
"""

from __future__ import annotations

import torch


def rstd_from_sumsq(partials: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """RMSNorm's r[m] = (sum_t P[m, t] / d + eps)^-1/2 from RED_m partials of h^2."""
    return partials.sum(dim=-1).mul_(1.0 / d).add_(eps).rsqrt_()


def combine_row_partials(partials: torch.Tensor) -> torch.Tensor:
    """RED_m partials (M x T_N) -> the row sums (M,)."""
    return partials.sum(dim=-1)


def combine_col_partials(partials: torch.Tensor) -> torch.Tensor:
    """RED_n partials (T_M x N) -> the column sums (N,)."""
    return partials.sum(dim=0)


def combine_lse(partials: torch.Tensor) -> torch.Tensor:
    """LSE partials (M x T_N) -> lse (M,): pairwise (max, sum-exp) combine, as logsumexp."""
    return torch.logsumexp(partials, dim=-1)


def norm_correction(rstd: torch.Tensor, stat: torch.Tensor, d: int) -> torch.Tensor:
    """RMSNorm backward's per-row correction corr = -(rstd^3 / d) * S, from the row statistic
    S = sum_n dz * u (``stat``, already combined). The one home of this formula on the kernel
    path (KERNELS.md [I5.6]; the oracle is ``reference.rmsnorm.norm_corr_ref``)."""
    return stat * rstd.pow(3) * (-1.0 / d)


def ce_row_weights(target, ignore_index: int, reduction: str, dtype=torch.float32):
    """The per-row weight of the loss gradient: 1/M_valid ("mean") or 1 ("sum", "none") on rows
    whose target is not ``ignore_index``, 0 elsewhere (all zeros when every row is ignored:
    PyTorch's gradient there is 0)."""
    valid = (target != ignore_index).to(dtype)
    return valid / valid.sum().clamp(min=1) if reduction == "mean" else valid


def ce_loss_from_stats(
    lse,
    target_logit,
    target,
    ignore_index: int,
    reduction: str,
    *,
    logit_sum=None,
    vocab: int = 0,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
):
    """A3: per-row loss lse - (1 - eps) l_y - (eps / V) sum_n l_n + z lse^2 (0 on ignored
    rows; eps = ``label_smoothing`` as in ``F.cross_entropy``, ``logit_sum`` = sum_n l_n;
    z = ``z_loss``), then the reduction. "mean" divides by the number of valid rows, so it is
    NaN when there are none, as in PyTorch."""
    valid = target != ignore_index
    per = lse - target_logit
    if label_smoothing:
        per = per + label_smoothing * (target_logit - logit_sum / vocab)
    if z_loss:
        per = per + z_loss * lse * lse
    per_row = torch.where(valid, per, torch.zeros_like(lse))
    if reduction == "none":
        return per_row
    total = per_row.sum()
    return total / valid.sum() if reduction == "mean" else total
