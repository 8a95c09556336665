"""Exact converters between Hugging Face Llama weights and coda's paired layouts, both ways.

coda's pairwise epilogues need each pair in two adjacent output columns of one GEMM tile:
- W_qkv (d, Nqkv) = [q | k | v] columns, with q and k permuted within each head from HF's
  rotate_half order (i, i + hd/2) to adjacent pairs (2i, 2i+1) (Meta's original layout);
  attention scores are unchanged, because q and k take the same permutation (KERNELS.md 3.2);
- W_il (d, 2f): gate j at column 2j, up j at 2j+1 (KERNELS.md 3.1).
Inputs and outputs on the HF side are ``nn.Linear`` weights (out, in); coda's are (in, out).
Every conversion is a permutation: bit-exact, and its inverse restores the input exactly.
"""

from __future__ import annotations

import torch

from coda import _validate as v
from coda.reference.rope import (
    adjacent_to_hf_columns,
    adjacent_to_hf_linear,
    hf_to_adjacent_columns,
    hf_to_adjacent_linear,
)
from coda.reference.swiglu import interleave_gate_up_linear, split_gate_up_linear


def qkv_weight_from_hf(
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    v_proj: torch.Tensor,
    *,
    n_heads: int,
    n_kv_heads: int,
) -> torch.Tensor:
    """HF q_proj (H hd, d), k_proj and v_proj (Hkv hd, d) -> coda W_qkv (d, (H + 2 Hkv) hd)."""
    v.check_matrix("q_proj", q_proj)
    v.check_positive_int("n_heads", n_heads)
    if q_proj.shape[0] % n_heads:
        raise v.CodaInputError(
            f"q_proj: dim 0 ({q_proj.shape[0]}) must be n_heads ({n_heads}) * head_dim"
        )
    d, hd = q_proj.shape[1], q_proj.shape[0] // n_heads
    v.check_heads(d, n_heads, n_kv_heads, hd)
    for name, t in (("k_proj", k_proj), ("v_proj", v_proj)):
        v.check_matrix(name, t, rows=("n_kv_heads * head_dim", n_kv_heads * hd), cols=("d", d))
    rows = [
        hf_to_adjacent_linear(q_proj, n_heads, hd),
        hf_to_adjacent_linear(k_proj, n_kv_heads, hd),
        v_proj,
    ]
    return torch.cat(rows, dim=0).t().contiguous()


def qkv_weight_to_hf(w_qkv: torch.Tensor, *, n_heads: int, n_kv_heads: int, head_dim: int):
    """Inverse of ``qkv_weight_from_hf``: returns (q_proj, k_proj, v_proj) nn.Linear weights."""
    v.check_heads(1, n_heads, n_kv_heads, head_dim)
    n_cols = (n_heads + 2 * n_kv_heads) * head_dim
    v.check_matrix("w_qkv", w_qkv, cols=("(n_heads + 2 n_kv_heads) head_dim", n_cols))
    lin = w_qkv.t()
    nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
    q = adjacent_to_hf_linear(lin[:nq], n_heads, head_dim)
    k = adjacent_to_hf_linear(lin[nq : nq + nkv], n_kv_heads, head_dim)
    return q.contiguous(), k.contiguous(), lin[nq + nkv :].contiguous()


def qkv_bias_from_hf(q_bias, k_bias, v_bias, *, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """HF q_proj.bias (H hd,), k_proj.bias and v_proj.bias (Hkv hd,) -> coda's bias_qkv (Nqkv,),
    in the column order of ``qkv_weight_from_hf``'s W_qkv (Qwen2's projections)."""
    for name, t in (("q_proj.bias", q_bias), ("k_proj.bias", k_bias), ("v_proj.bias", v_bias)):
        v.check_tensor(name, t)
        if t.dim() != 1:
            raise v.CodaInputError(f"{name}: expected a vector, got shape {tuple(t.shape)}")
    cols = [t[:, None] for t in (q_bias, k_bias, v_bias)]
    return qkv_weight_from_hf(*cols, n_heads=n_heads, n_kv_heads=n_kv_heads)[0]


def qkv_bias_to_hf(bias_qkv: torch.Tensor, *, n_heads: int, n_kv_heads: int, head_dim: int):
    """Inverse of ``qkv_bias_from_hf``: returns (q_proj.bias, k_proj.bias, v_proj.bias)."""
    hf = qkv_weight_to_hf(
        bias_qkv[None, :], n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    return tuple(t[:, 0].contiguous() for t in hf)


def gate_up_weight_from_hf(gate_proj: torch.Tensor, up_proj: torch.Tensor) -> torch.Tensor:
    """HF gate_proj, up_proj (f, d) -> coda W_il (d, 2f), gate/up interleaved."""
    v.check_matrix("gate_proj", gate_proj)
    v.check_matrix("up_proj", up_proj, rows=("gate_proj.shape[0]", gate_proj.shape[0]))
    v.check_matrix("up_proj", up_proj, cols=("gate_proj.shape[1]", gate_proj.shape[1]))
    return interleave_gate_up_linear(gate_proj, up_proj).t().contiguous()


def gate_up_weight_to_hf(w_il: torch.Tensor):
    """Inverse of ``gate_up_weight_from_hf``: returns (gate_proj, up_proj)."""
    v.check_matrix("w_il", w_il)
    if w_il.shape[1] % 2:
        raise v.CodaInputError(f"w_il: dim 1 (2f) must be even, got {w_il.shape[1]}")
    g, u = split_gate_up_linear(w_il.t().contiguous())
    return g.contiguous(), u.contiguous()


def _check_head_weight(weight: torch.Tensor, head_dim) -> int:
    """The QK-norm weight's head_dim (``head_dim``, or its whole length), checked."""
    v.check_tensor("weight", weight)
    hd = weight.shape[0] if head_dim is None or weight.dim() != 1 else head_dim
    if weight.dim() != 1 or hd % 2 or weight.shape[0] % hd:
        raise v.CodaInputError(
            "weight: expected a 1-D QK-norm weight of whole heads of even length "
            f"(head_dim {hd}), got {tuple(weight.shape)}"
        )
    return hd


def head_weight_from_hf(weight: torch.Tensor, head_dim: int = None) -> torch.Tensor:
    """A QK-norm weight in HF order -> the adjacent-pair order of coda's q and k heads (the
    same permutation as their columns): Qwen3's per-head one (hd,), or with ``head_dim`` the
    whole projection's (OLMo's, (heads hd,)), each head permuted."""
    hd = _check_head_weight(weight, head_dim)
    return hf_to_adjacent_columns(weight, weight.shape[0] // hd, hd)


def head_weight_to_hf(weight: torch.Tensor, head_dim: int = None) -> torch.Tensor:
    """Inverse of ``head_weight_from_hf`` (exact)."""
    hd = _check_head_weight(weight, head_dim)
    return adjacent_to_hf_columns(weight, weight.shape[0] // hd, hd).clone()
