"""Qwen3's per-head QK-norm with RoPE on the kernel path, and its backward (v1: row passes).

Forward, after F1 ran without rotation (``gemm_rope`` with a zero frequency table stores
z = rstd0 * acc, the entry norm's deferred row scale applied):

    s[m, h]   = (mean_{j in head h} z[m, j]^2 + eps)^-1/2      q and k heads only
    q_n       = z * s * w_h                                    w_h: q_norm or k_norm (hd,)
    out       = RoPE(q_n) for q and k heads, z for v heads      (bf16, the attention input)

Backward, from dout (attention's dq, dk, dv), per q/k head with q_hat = z * s:

    dq_n   = RoPE^T(dout)
    g      = s * (w dq_n - q_hat * mean_j(w dq_n q_hat))        the head norm's backward
    dw_h  += sum_m dq_n * q_hat                                 (summed over rows and heads)
    dz~0   = rstd0 * [g | dv]                                   B12/B13's A operand, as B11's
    S0     = sum_n [g | dv] * z / rstd0                         the entry norm's statistic

z is saved by the forward in place of the rotated qkv (same size). Both passes are torch code
(``fused``: one or two Triton kernels on the GPU). v2 plan: the statistic s as a prepass in
F1's epilogue (quack's grouped column statistics: a head is a contiguous run of hd columns
inside one output tile), so the forward becomes one GEMM; see benchmarks/NOTES.md.
Oracle: ``coda.reference.layer.decoder_layer_ref`` with q_norm / k_norm (the float64 tests).
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype
from coda.kernels.drope import pack_heads
from coda.primitives.aux import norm_correction


def _rotate(x1, x2, c, s):
    return x1 * c - x2 * s, x1 * s + x2 * c


def _head_weights(q_norm, k_norm, n_q, n_k, dtype):
    """(n_q + n_k, hd): each rotated head's norm weight."""
    return torch.cat([q_norm.to(dtype).expand(n_q, -1), k_norm.to(dtype).expand(n_k, -1)])


def qk_norm_rope_rows(z, q_norm, k_norm, cos, sin, n_q: int, n_k: int, head_dim: int, eps):
    """Returns (qkv bf16 (M, Nqkv): normed and rotated q, k; v = z's, s fp32 (M, n_q + n_k)).
    cos, sin: (M, hd / 2) RoPE tables of every row (adjacent pairs)."""
    M = z.shape[0]
    acc = acc_dtype(z)
    n_rot = (n_q + n_k) * head_dim
    zr = z[:, :n_rot].to(acc).view(M, n_q + n_k, head_dim)
    s = torch.rsqrt(zr.pow(2).mean(-1) + eps)
    qn = zr * s[..., None] * _head_weights(q_norm, k_norm, n_q, n_k, acc)
    x1, x2 = qn[..., 0::2], qn[..., 1::2]
    y1, y2 = _rotate(x1, x2, cos[:, None, :], sin[:, None, :])
    out = torch.empty_like(z)
    out[:, :n_rot] = torch.stack([y1, y2], -1).view(M, n_rot)
    out[:, n_rot:] = z[:, n_rot:]
    return out, s


def dqk_norm_rope_rows(
    dout, z, s, rstd, cos, sin, q_norm, k_norm, n_q: int, n_k: int, head_dim: int, d: int
):
    """Returns (dz~0 (M, Nqkv) in z's dtype, corr0 (M,), dq_norm (hd,), dk_norm (hd,))."""
    M = z.shape[0]
    acc = acc_dtype(z)
    n_rot = (n_q + n_k) * head_dim
    dr = dout[:, :n_rot].to(acc).view(M, n_q + n_k, head_dim)
    d1, d2 = dr[..., 0::2], dr[..., 1::2]
    c, sn = cos[:, None, :], sin[:, None, :]
    dqn = torch.stack([d1 * c + d2 * sn, d2 * c - d1 * sn], -1).view_as(dr)  # RoPE^T
    q_hat = z[:, :n_rot].to(acc).view_as(dr) * s[..., None]
    dq_hat = dqn * _head_weights(q_norm, k_norm, n_q, n_k, acc)
    g = s[..., None] * (dq_hat - q_hat * (dq_hat * q_hat).mean(-1, keepdim=True))
    dw = (dqn * q_hat).sum(0)  # (n_q + n_k, hd)
    gz = torch.cat([g.view(M, n_rot), dout[:, n_rot:].to(acc)], dim=1)
    S0 = (gz * z.to(acc)).sum(-1) / rstd
    dz0 = (gz * rstd[:, None]).to(z.dtype)
    return dz0, norm_correction(rstd, S0, d), dw[:n_q].sum(0), dw[n_q:].sum(0)


def dqk_norm_rope_heads(dq, dk, dv, z, s, rstd, cos, sin, q_norm, k_norm, n_q, n_k, hd, d):
    """``dqk_norm_rope_rows`` on the head gradients as attention returns them."""
    dout = pack_heads(dq, dk, dv)
    return dqk_norm_rope_rows(dout, z, s, rstd, cos, sin, q_norm, k_norm, n_q, n_k, hd, d)
