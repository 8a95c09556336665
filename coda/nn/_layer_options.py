"""``DecoderLayer``'s option checks that take more than a line: LongRoPE's second frequency set,
multimodal RoPE's sections, a second sublayer of the caller's (``mlp``). Each returns the
option's stored form or raises ``CodaInputError`` naming the argument and its rule."""

from __future__ import annotations

import torch
from torch import nn

from coda import _validate as v


def long_rope(long_inv_freq, long_after, head_dim: int):
    """LongRoPE's (long set as float64 on the CPU, original context length), or (None, None)."""
    if (long_inv_freq is None) != (long_after is None):
        raise v.CodaInputError("long_inv_freq and long_after: give both (LongRoPE) or neither")
    if long_inv_freq is None:
        return None, None
    v.check_tensor("long_inv_freq", long_inv_freq)
    if long_inv_freq.shape != (head_dim // 2,):
        raise v.CodaInputError(
            f"long_inv_freq: expected shape (head_dim / 2,) = ({head_dim // 2},), got "
            f"{tuple(long_inv_freq.shape)}"
        )
    return long_inv_freq.detach().to("cpu", torch.float64), v.check_positive_int(
        "long_after", long_after
    )


def check_mlp_module(mlp, ffn, activation, post_norms: bool, o_bias: bool) -> None:
    """``DecoderLayer(mlp=)``: a module (or None), with ``ffn`` 0 and none of the options of
    coda's own MLP or of a residual add it does not do (a bias, a norm before it)."""
    if mlp is None:
        return
    if not isinstance(mlp, nn.Module):
        raise v.CodaInputError(f"mlp: expected an nn.Module (x1 -> y) or None, got {mlp!r}")
    if ffn != 0:
        raise v.CodaInputError(f"ffn: must be 0 with mlp (the MLP is the module's), got {ffn}")
    if activation != "silu" or post_norms or o_bias:
        raise v.CodaInputError(
            "DecoderLayer: mlp (a module of its own) with activation, post_norms or o_bias is "
            "not supported"
        )


def mrope_flags(sections, head_dim: int, with_bias: bool, long_inv_freq):  # (bias: or QK-norm)
    """Multimodal RoPE's section per frequency (a CPU long tensor), or None."""
    if sections is None:
        return None
    s = torch.as_tensor(sections).long().cpu()
    if s.shape != (head_dim // 2,) or not bool(((s >= 0) & (s <= 2)).all()):
        raise v.CodaInputError(
            f"mrope_sections: expected head_dim / 2 = {head_dim // 2} entries in (0, 1, 2), "
            f"got {sections!r}"
        )
    if not with_bias or long_inv_freq is not None:
        raise v.CodaInputError(
            "mrope_sections: supported with qkv_bias (Qwen2-VL's layer) or qk_norm (Qwen3-VL's),"
            " without LongRoPE"
        )
    return s
