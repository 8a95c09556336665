"""dRoPE and the attention-side norm statistic, as one row pass (KERNELS.md B11, v1).

    dq_pre, dk_pre = R(-theta) dq_rot, R(-theta) dk_rot      rotate back (R is orthogonal)
    dz~0 = rstd0 * [dq_pre | dk_pre | dv]                     the A operand of B12 / B13
    S0   = (1 / rstd0) * sum_n (dqkv * qkv_rot)              rotation invariance [I5.3]
    corr0 = -(rstd0^3 / d) * S0

With a QKV bias (F1 rotates z + bias) the statistic reads F1's stored z = rstd0 * acc instead
of the rotated output (``drope_bias_rows``), which also returns the bias's gradient.
It reads the attention backward's dq, dk, dv and the saved rotated q, k, v. These torch
functions are the CPU path and the oracle; on the GPU the same pass runs as one Triton kernel
(``row_passes.drope_heads_triton``). KERNELS.md's v2 plan folds it into the attention backward.
"""

from __future__ import annotations

import torch

from coda.env import TensorMemo
from coda.kernels._launch import acc_dtype
from coda.primitives.aux import norm_correction
from coda.primitives.math import turns_to_angle


def rotation_tables(positions, freq_turns_hi, freq_turns_lo, head_dim, dtype=torch.float32):
    """cos/sin (M, hd/2) in ``dtype`` (fp32; float64 for proofs) from the same float-float
    frequencies the forward epilogue used."""
    theta = turns_to_angle(positions[:, None], freq_turns_hi, freq_turns_lo)
    return theta.cos().to(dtype), theta.sin().to(dtype)


def head_rotation(positions, freq, head_dim, dtype=torch.float32):
    """cos/sin (M, hd/2) from the RoPE epilogue's per-column frequency table ``freq``
    (``gemm_rope.rope_freq_table``): every rotated head carries the same frequencies, so the
    first head's (hi, lo) pairs give them."""
    head = freq[:head_dim]
    return rotation_tables(positions, head[0::2], head[1::2], head_dim, dtype)


def mrope_head_rotation(positions, sect, freq, head_dim, dtype=torch.float32):
    """``head_rotation`` for multimodal RoPE: ``positions`` (3, M), the time, height and width
    rows, ``sect`` F1's section flags (``gemm_rope.mrope_section_table``): each frequency's
    angle from its own section's row, as the forward epilogue formed it."""
    head, flags = freq[:head_dim], sect[:head_dim]
    section = (flags[0::2] + 2 * flags[1::2]).long()  # (hd/2,): 0 time, 1 height, 2 width
    pos = positions.index_select(0, section).t().contiguous()  # (M, hd/2), rows unit-stride
    theta = turns_to_angle(pos, head[0::2], head[1::2])
    return theta.cos().to(dtype), theta.sin().to(dtype)


cached_mrope_rotation = TensorMemo(mrope_head_rotation, maxsize=2)


def cached_rotation(positions, freq, head_dim: int, dtype, sect=None):
    """B11's cos / sin tables, remembered per positions: ``cached_head_rotation``, or with
    section flags ``sect`` (positions (3, M)) ``cached_mrope_rotation``."""
    if sect is None:
        return cached_head_rotation(positions, freq, head_dim, dtype)
    return cached_mrope_rotation(positions, sect, freq, head_dim, dtype)


# ``head_rotation`` once per (positions, freq) pair: every layer of a step is given the same
# positions rows and frequency table, so a stack's backward builds its cos/sin tables (about
# ten float64 kernels) once per step, or once in all for the default positions. Two entries:
# the step's, and the one before (each holds M x hd fp32 of device memory)
cached_head_rotation = TensorMemo(head_rotation, maxsize=2)


def rotate_pairs(x1, x2, cos, sin, inverse: bool = False):
    """Adjacent-pair rotation by theta (RoPE), or by -theta (its transpose, dRoPE)."""
    if inverse:
        return x1 * cos + x2 * sin, x2 * cos - x1 * sin
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def drope_rows(dqkv, qkv, rstd, cos, sin, n_rot_heads: int, head_dim: int, d: int):
    """Returns (dz~0 bf16 M x Nqkv, corr0 fp32 M). dqkv, qkv: (M, Nqkv) bf16."""
    M = dqkv.shape[0]
    acc = acc_dtype(dqkv)
    n_rot = n_rot_heads * head_dim
    S0 = (dqkv.to(acc) * qkv.to(acc)).sum(-1) / rstd
    out = torch.empty_like(dqkv)
    rot = dqkv[:, :n_rot].to(acc).view(M, n_rot_heads, head_dim // 2, 2)
    p1, p2 = rotate_pairs(rot[..., 0], rot[..., 1], cos[:, None, :], sin[:, None, :], True)
    r = rstd[:, None, None]
    out[:, :n_rot] = torch.stack([p1 * r, p2 * r], -1).view(M, -1)
    out[:, n_rot:] = (dqkv[:, n_rot:].to(acc) * rstd[:, None]).to(dqkv.dtype)
    return out, norm_correction(rstd, S0, d)


def pack_heads(dq, dk, dv):
    """The three head gradients (batch, heads, seq, hd) as the (tokens, Nqkv) rows of the
    QKV GEMM's layout. Inside a ``fused`` row pass this is index math on the loads, not a
    copy (it replaces three copies into one buffer)."""
    B, _, S, hd = dq.shape
    return torch.cat([dq, dk, dv], dim=1).transpose(1, 2).reshape(B * S, -1)


def drope_heads(dq, dk, dv, qkv, rstd, cos, sin, n_rot_heads: int, head_dim: int, d: int):
    """``drope_rows`` on the head gradients as attention returns them."""
    return drope_rows(pack_heads(dq, dk, dv), qkv, rstd, cos, sin, n_rot_heads, head_dim, d)


def drope_bias_rows(dqkv, z, rstd, cos, sin, n_rot_heads: int, head_dim: int, d: int):
    """B11 for a QKV projection with a bias (z + bias rotated in F1): the head gradients rotated
    back, d_pre; dz~0 = rstd0 * d_pre; S0 = sum_n d_pre * z / rstd0 on F1's stored z (rstd0 acc,
    no bias: the statistic is the norm's, whose output the bias does not see); dbias = the
    column sums of d_pre. Returns (dz~0 in dqkv's dtype, corr0, dbias (Nqkv,) fp32)."""
    M = dqkv.shape[0]
    n_rot = n_rot_heads * head_dim
    pre = dqkv.to(acc_dtype(dqkv), copy=True)  # (written below: never dqkv itself)
    rot = pre[:, :n_rot].view(M, n_rot_heads, head_dim // 2, 2)
    p1, p2 = rotate_pairs(rot[..., 0], rot[..., 1], cos[:, None, :], sin[:, None, :], True)
    pre[:, :n_rot] = torch.stack([p1, p2], -1).view(M, -1)
    S0 = (pre * z.to(pre.dtype)).sum(-1) / rstd
    dz0 = (pre * rstd[:, None]).to(dqkv.dtype)
    return dz0, norm_correction(rstd, S0, d), pre.sum(0)


def drope_bias_heads(dq, dk, dv, z_even, z_odd, rstd, cos, sin, d: int):
    """``drope_bias_rows`` on the head gradients as attention returns them and F1's z as its
    even and odd columns (``gemm_rope.rope_scaled_bias``'s stores)."""
    z = torch.stack([z_even, z_odd], dim=-1).flatten(1)
    n_rot, hd = dq.shape[1] + dk.shape[1], dq.shape[-1]
    return drope_bias_rows(pack_heads(dq, dk, dv), z, rstd, cos, sin, n_rot, hd, d)
