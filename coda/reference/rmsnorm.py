"""Pure-torch references for RMSNorm around GEMMs: canonical and CODA-reparameterized.

Canonical (HF ``LlamaRMSNorm``): ``r = ((1/d) sum_j h_j^2 + eps)^-1/2``, ``y = r * h * gamma``.

Reparameterized (KERNELS.md section 2, 5.3, 5.4); weights are stored (in, out), ``Y = X @ W``:

- GEMM1 epilogue (F3/F5): ``h = c + x @ w``; ``a = h * gamma``; ``P[m, t] = sum_{n in t} h^2``
- AUX (A1/A2):            ``r = (sum_t P / d + eps)^-1/2``
- GEMM2 epilogue:         ``z = r * (a @ w2)``                          (row scale after GEMM2)
- dz producer epilogue:   ``S = sum_n dz * u`` with ``u = a @ w2``     (statistic one GEMM early)
- AUX:                    ``corr = -(r^3 / d) * S``
- dgrad epilogue:         ``dh = gamma * acc + corr * h + dres``, ``acc = (r * dz) @ w2^T``;
                          ``dgamma = sum_m acc * h``                    (RED_n + AUX)
- wgrad epilogue:         ``dw2 = gamma (rows) * (h^T @ (r * dz))``

Every function computes in the dtype it is given (float64 for proofs, float32 as the fp32
reference of CODA's error protocol); ``ref_dtype`` upcasts half inputs.
"""

from __future__ import annotations

import math

import torch


def ref_dtype(*tensors) -> torch.dtype:
    """float64 if any input is float64, else float32: the precision references compute in."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def rstd_ref(h: torch.Tensor, eps: float) -> torch.Tensor:
    """r[m] = (mean_j h[m, j]^2 + eps)^-1/2."""
    return torch.rsqrt(h.pow(2).mean(dim=-1) + eps)


def rmsnorm_ref(h: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """Canonical RMSNorm y = r * h * gamma, as HF computes it: the statistic and the scaling
    in ``ref_dtype`` (fp32 for half inputs), rounded back to h's dtype, then times gamma."""
    hf = h.to(ref_dtype(h))
    return (hf * rstd_ref(hf, eps)[..., None]).to(h.dtype) * gamma


def final_norm_ref(h: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """The final norm as the LM-head loss applies it: ``rmsnorm_ref`` (Llama's rounding) for a
    gain in h's dtype; for an fp32 gain with half h (Gemma's final norm, whose gain 1 + w is
    formed in fp32 because a bf16 1 + w would round w to 2^-8) the scaling in fp32, rounded
    once to h's dtype, as HF's ``GemmaRMSNorm`` computes it."""
    if gamma.dtype == torch.float32 and h.dtype in (torch.bfloat16, torch.float16):
        hf = h.float()
        return (hf * rstd_ref(hf, eps)[..., None] * gamma).to(h.dtype)
    return rmsnorm_ref(h, gamma, eps)


def sumsq_partials_ref(h: torch.Tensor, tile_n: int) -> torch.Tensor:
    """RED_m of h^2: P[m, t] = sum over the columns of N-tile t (ragged last tile)."""
    M, N = h.shape
    pad = (-N) % tile_n
    hp = torch.nn.functional.pad(h, (0, pad))
    return hp.pow(2).view(M, math.ceil(N / tile_n), tile_n).sum(-1)


def rstd_from_partials_ref(partials: torch.Tensor, d: int, eps: float) -> torch.Tensor:
    """AUX A1/A2: r = (sum_t P[m, t] / d + eps)^-1/2."""
    return torch.rsqrt(partials.sum(dim=-1) / d + eps)


def gemm_residual_rms_ref(x, w, residual, gamma=None, eps: float = 1e-5, bias=None):
    """Reference of ``coda.gemm_residual_rms``: h = residual + (x @ w + bias), a = h * gamma
    (or None), r = rstd(h). Computed in ``ref_dtype`` (fp32 for bf16 inputs); returns
    (h, a, r)."""
    dt = ref_dtype(x, w, residual)
    y = x.to(dt) @ w.to(dt)
    h = residual.to(dt) + (y if bias is None else y + bias.to(dt))
    a = h * gamma.to(dt) if gamma is not None else None
    return h, a, rstd_ref(h, eps)


def gemm_residual_rms_torch(x, w, residual, gamma=None, eps: float = 1e-5, bias=None):
    """The plain PyTorch path in the inputs' own dtype (bf16 peer of the error protocol):
    ``mm`` (a ``Linear`` with its bias) + add + RMS statistic, each rounded as eager PyTorch
    rounds it."""
    h = residual + (x @ w if bias is None else torch.addmm(bias, x, w))
    a = h * gamma if gamma is not None else None
    return h, a, rstd_ref(h.float(), eps)


def gemm_rmsnorm_gemm_ref(x, w1, residual, gamma, w2, eps: float = 1e-5):
    """Canonical block: h = residual + x @ w1; z = RMSNorm(h) * gamma @ w2; returns (h, z, r)."""
    dt = ref_dtype(x, w1, residual)
    h = residual.to(dt) + x.to(dt) @ w1.to(dt)
    return h, rmsnorm_ref(h, gamma.to(dt), eps) @ w2.to(dt), rstd_ref(h, eps)


def gemm_rmsnorm_gemm_torch(x, w1, residual, gamma, w2, eps: float = 1e-5):
    """The plain PyTorch path in the inputs' dtype (F.rms_norm between two mm's)."""
    h = residual + x @ w1
    y = torch.nn.functional.rms_norm(h, (h.shape[-1],), gamma, eps)
    return h, y @ w2, rstd_ref(h.float(), eps)


# -- backward --------------------------------------------------------------------------------
def rmsnorm_bwd_ref(h, gamma, r, dy):
    """Canonical RMSNorm backward [I5.4, I5.5]: returns (dh, dgamma).
    dh = r*(gamma*dy) - h*(r^3/d)*S with S = sum_j h*gamma*dy; dgamma = sum_m dy*h*r."""
    d = h.shape[-1]
    S = (h * gamma * dy).sum(-1)
    dh = r[:, None] * (gamma * dy) - h * (r.pow(3) / d * S)[:, None]
    dgamma = (dy * h * r[:, None]).sum(0)
    return dh, dgamma


def norm_stat_ref(dz: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The RMSNorm-backward row statistic, taken on GEMM2's output [I5.6]: S = sum_n dz * u."""
    return (dz * u).sum(-1)


def norm_corr_ref(r: torch.Tensor, S: torch.Tensor, d: int) -> torch.Tensor:
    """AUX: corr = -(r^3 / d) * S."""
    return -(r.pow(3) / d) * S


def norm_bwd_apply_ref(acc, h, gamma, corr, dres=None):
    """dgrad epilogue (B2/B6/B12) + AUX dgamma: acc = (r*dz) @ w2^T.
    Returns (dh, dgamma) with dh = gamma*acc + corr*h (+ dres), dgamma = sum_m acc*h."""
    dh = gamma * acc + corr[:, None] * h
    if dres is not None:
        dh = dh + dres
    return dh, (acc * h).sum(0)


def wgrad_gamma_rows_ref(h, dz_tilde, gamma):
    """wgrad epilogue: dW2 = gamma (as a per-row scale) * (h^T @ dz_tilde) [I5.8]."""
    return gamma[:, None] * (h.transpose(-1, -2) @ dz_tilde)


def head_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """QK-norm: x (M, heads, hd) normalized in groups of the weight's length: hd (Qwen3's
    per-head norm, one weight shared by the heads: each (row, head) over its hd values) or
    heads * hd (OLMo's, over the whole projection: each row over all its heads' values). An
    fp32 weight with half x (Gemma 3's 1 + w; OLMo's) scales in fp32 and rounds once, as
    ``final_norm_ref``."""
    M, group = x.shape[0], weight.shape[0]
    return final_norm_ref(x.reshape(M, -1, group), weight, eps).view_as(x)
