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
