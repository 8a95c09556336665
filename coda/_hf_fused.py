"""Phi-3's fused projections in the keys coda's layer speaks (Llama's).

``Phi3Attention``'s ``qkv_proj`` is the row concatenation of Llama's ``q_proj``, ``k_proj``
and ``v_proj`` (its forward slices q, then k, then v off the output), and ``Phi3MLP``'s
``gate_up_proj`` that of ``gate_proj`` and ``up_proj`` (its forward chunks gate, then up).
So a Phi-3 layer's state dict converts to and from Llama's keys exactly, by splitting or
concatenating rows, and ``coda.nn.DecoderLayer``'s Llama conversions (``coda.layouts``) do
the rest. Used by ``coda.transformers`` for the layers whose projections are fused.
"""

from __future__ import annotations

import torch

# each fused HF key: the Llama keys whose rows it concatenates, in order
FUSED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


def fused_keys(keys: tuple) -> tuple:
    """The fused keys in place of ``keys`` (a coda weight's Llama keys, ``HF_KEYS``), or
    ``keys`` where none fuses them."""
    for fused, parts in FUSED.items():
        if keys == parts:
            return (fused,)
    return keys


def fuse(tensors: dict, prefix: str = "") -> dict:
    """Llama-keyed tensors under ``prefix`` -> the same with each fused key's parts
    concatenated by rows into it (a fused key whose parts are absent stays absent: a
    gradient not formed)."""
    out = dict(tensors)
    for fused, parts in FUSED.items():
        if all(prefix + p in out for p in parts):
            out[prefix + fused] = torch.cat([out.pop(prefix + p) for p in parts])
    return out


def fuse_shapes(shapes: dict, prefix: str = "") -> dict:
    """``fuse`` on {key: shape}: the parts' rows summed."""
    out = dict(shapes)
    for fused, parts in FUSED.items():
        if all(prefix + p in out for p in parts):
            got = [out.pop(prefix + p) for p in parts]
            out[prefix + fused] = (sum(s[0] for s in got), got[0][1])
    return out


def split(tensors: dict, shapes: dict, prefix: str = "") -> dict:
    """``fuse``'s inverse: each fused key's tensor split by rows into the Llama keys of
    ``shapes`` (their {key: shape}, which says each part's rows)."""
    out = dict(tensors)
    for fused, parts in FUSED.items():
        if prefix + fused in out:
            rows = [shapes[prefix + p][0] for p in parts]
            pieces = out.pop(prefix + fused).split(rows)
            out.update({prefix + p: t for p, t in zip(parts, pieces)})
    return out
