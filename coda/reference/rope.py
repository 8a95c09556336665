"""Pure-torch references for RoPE on adjacent pairs (KERNELS.md 3.2, 5.2).

HF layout (rotate_half): within a head, pair i is (i, i + hd/2). coda's adjacent layout: pair i
is (2i, 2i+1), rotated by the same angle theta[p, i] = p * base^(-2i/hd). The two are related by
the per-head permutation ``perm_h[2i] = i, perm_h[2i+1] = hd/2 + i`` applied to the q and k
columns of W_qkv [I3.4]; V and W_o do not change, and attention scores are unchanged [I3.5].

The kernel reads one table ``cs`` (S x hd) with cs[p, 2i] = cos theta[p, i], cs[p, 2i+1] = sin.
"""

from __future__ import annotations

import torch

from coda.reference.rmsnorm import head_rmsnorm_ref, ref_dtype


def inv_freq(hd: int, base: float = 10000.0, dtype=torch.float64) -> torch.Tensor:
    return base ** (-torch.arange(0, hd, 2, dtype=dtype) / hd)


def rope_angles(positions: torch.Tensor, hd: int, base: float = 10000.0) -> torch.Tensor:
    """theta[m, i] = positions[m] * inv_freq[i], float64 (M x hd/2)."""
    return positions.to(torch.float64)[:, None] * inv_freq(hd, base)[None, :]


def rope_table(positions: torch.Tensor, hd: int, base: float = 10000.0) -> torch.Tensor:
    """cs[m, 2i] = cos theta[m, i], cs[m, 2i+1] = sin theta[m, i] (float64, M x hd)."""
    th = rope_angles(positions, hd, base)
    return torch.stack([th.cos(), th.sin()], dim=-1).flatten(-2)


def head_perm(hd: int) -> torch.Tensor:
    """perm_h: adjacent index c takes HF index perm_h[c]."""
    return torch.stack([torch.arange(hd // 2), torch.arange(hd // 2) + hd // 2], -1).flatten()


def rope_hf_ref(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE on (M, heads, hd) with angles theta (M, hd/2)."""
    half = x.shape[-1] // 2
    cos, sin = theta.cos()[:, None, :].to(x.dtype), theta.sin()[:, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def hf_cos_sin(positions: torch.Tensor, hd: int, base: float = 10000.0, dtype=torch.float32):
    """HF Llama's RoPE tables as its model code builds them: fp32 angles positions * inv_freq,
    each repeated for the two halves, cos and sin cast to ``dtype``. (M, hd) each."""
    inv = 1.0 / base ** (torch.arange(0, hd, 2, device=positions.device).float() / hd)
    ang = positions.float()[:, None] * inv
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_hf(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin (broadcast)."""
    return x * cos + rotate_half(x) * sin


def rope_adjacent_ref(x: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """Adjacent-pair RoPE on (M, heads, hd) with the interleaved table cs (M, hd)."""
    c, s = cs[:, None, 0::2].to(x.dtype), cs[:, None, 1::2].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)


def rope_adjacent_bwd_ref(dy: torch.Tensor, cs: torch.Tensor) -> torch.Tensor:
    """dRoPE: rotation by -theta (the transpose of the forward rotation) [I5.2]."""
    c, s = cs[:, None, 0::2].to(dy.dtype), cs[:, None, 1::2].to(dy.dtype)
    d1, d2 = dy[..., 0::2], dy[..., 1::2]
    return torch.stack([d1 * c + d2 * s, -d1 * s + d2 * c], dim=-1).flatten(-2)


def hf_to_adjacent_columns(w: torch.Tensor, n_heads: int, hd: int) -> torch.Tensor:
    """(in, heads*hd) q or k weight, HF column order -> adjacent-pair order (exact)."""
    idx = (torch.arange(n_heads)[:, None] * hd + head_perm(hd)[None, :]).flatten()
    return w[..., idx]


def adjacent_to_hf_columns(w: torch.Tensor, n_heads: int, hd: int) -> torch.Tensor:
    """Inverse of ``hf_to_adjacent_columns``."""
    inv = torch.argsort(head_perm(hd))
    idx = (torch.arange(n_heads)[:, None] * hd + inv[None, :]).flatten()
    return w[..., idx]


def hf_to_adjacent_linear(w_lin: torch.Tensor, n_heads: int, hd: int) -> torch.Tensor:
    """nn.Linear form (heads*hd, in): the permutation on rows."""
    return w_lin.view(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(n_heads * hd, -1)


def adjacent_to_hf_linear(w_lin: torch.Tensor, n_heads: int, hd: int) -> torch.Tensor:
    return w_lin.view(n_heads, hd // 2, 2, -1).transpose(1, 2).reshape(n_heads * hd, -1)


def gemm_rope_ref(a, w_qkv, r, cs, n_q: int, n_kv: int, hd: int, bias=None):
    """F1: z = r * (a @ w_qkv) (+ bias, Qwen2's q, k, v biases in w_qkv's column order);
    adjacent RoPE on the q and k columns with table rows cs (M x hd, one row per token's
    position); v unchanged. Returns z (M x (n_q+2 n_kv) hd)."""
    dt = ref_dtype(a, w_qkv)
    z = r.to(dt)[:, None] * (a.to(dt) @ w_qkv.to(dt))
    if bias is not None:
        z = z + bias.to(dt)
    M = z.shape[0]
    qk = z[:, : (n_q + n_kv) * hd].view(M, n_q + n_kv, hd)
    return torch.cat([rope_adjacent_ref(qk, cs.to(dt)).flatten(1), z[:, (n_q + n_kv) * hd :]], 1)


def gemm_rope_torch(a, w_qkv, r, positions, n_q: int, n_kv: int, hd: int, base=10000.0):
    """The plain PyTorch path (HF style) in the inputs' dtype: normalize, project, then RoPE
    with cos/sin tables in that dtype, on the adjacent layout."""
    y = (a.float() * r[:, None]).to(a.dtype)
    z = y @ w_qkv
    M = z.shape[0]
    cs = rope_table(positions, hd, base).to(device=a.device, dtype=a.dtype)
    qk = rope_adjacent_ref(z[:, : (n_q + n_kv) * hd].view(M, n_q + n_kv, hd), cs)
    return torch.cat([qk.flatten(1), z[:, (n_q + n_kv) * hd :]], 1)


def gemm_qk_norm_rope_ref(
    a, w_qkv, r, cs, n_q: int, n_kv: int, hd: int, q_norm, k_norm, eps, after_rope=False
):
    """F1 with Qwen3's QK-norm: z = r * (a @ w_qkv); each q and k head RMS-normalized over its
    hd values with weight q_norm / k_norm ((hd,), adjacent order), then adjacent RoPE with
    table rows cs; v unchanged. ``after_rope``: Hunyuan's order, RoPE first, then the norm
    with its weights. Returns (M x (n_q + 2 n_kv) hd)."""
    dt = ref_dtype(a, w_qkv)
    z = r.to(dt)[:, None] * (a.to(dt) @ w_qkv.to(dt))
    M, n_rot = z.shape[0], (n_q + n_kv) * hd
    qk = z[:, :n_rot].view(M, n_q + n_kv, hd)
    if after_rope:
        qk = rope_adjacent_ref(qk, cs.to(dt))
    q = head_rmsnorm_ref(qk[:, :n_q], q_norm.to(dt), eps)
    k = head_rmsnorm_ref(qk[:, n_q:], k_norm.to(dt), eps)
    qk = torch.cat([q, k], 1)
    if not after_rope:
        qk = rope_adjacent_ref(qk, cs.to(dt))
    return torch.cat([qk.flatten(1), z[:, n_rot:]], 1)
