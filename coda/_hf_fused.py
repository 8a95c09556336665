"""The forms an HF layer's state dict takes beyond Llama's keys, which coda's layer speaks:
fused projections, other norm names, and q / k rows already in adjacent-pair order.

``Phi3Attention``'s ``qkv_proj`` is the row concatenation of Llama's ``q_proj``, ``k_proj``
and ``v_proj`` (its forward slices q, then k, then v off the output), and ``Phi3MLP``'s
``gate_up_proj`` that of ``gate_proj`` and ``up_proj`` (its forward chunks gate, then up);
GLM's and GLM-4's layers fuse ``gate_up_proj`` alone. GLM-4 names its four norms otherwise
than Gemma 2 (``GLM4_NORMS``). GLM rotates adjacent pairs (2i, 2i+1) of each head, the order
coda's q and k columns take, where Llama rotates (i, i + hd / 2): its q and k rows (weights
and biases) map to Llama's by the inverse of ``coda.layouts``' permutation, so that
permutation then leaves them as they are. So each form converts to and from Llama's keys
exactly (splitting or concatenating rows, renaming, permuting rows), and
``coda.nn.DecoderLayer``'s Llama conversions (``coda.layouts``) do the rest. Used by
``coda.transformers`` for the layers of those forms (``Form``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from coda.reference.rope import adjacent_to_hf_linear, hf_to_adjacent_linear

# each fused HF key: the Llama keys whose rows it concatenates, in order
FUSED = {
    "self_attn.qkv_proj.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
# GLM-4's norm keys for the keys coda's post-norm layer speaks (Gemma 2's)
GLM4_NORMS = {
    "post_attention_layernorm.weight": "post_self_attn_layernorm.weight",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_mlp_layernorm.weight",
}
_PAIRED = ("self_attn.q_proj", "self_attn.k_proj")  # (with n_heads, n_kv_heads heads)


@dataclass(frozen=True)
class Form:
    """A layer's HF form: its fused keys (of ``FUSED``), its renamed keys (Llama's -> its
    own), and, for q / k rows in adjacent-pair order, its (n_heads, n_kv_heads, head_dim)."""

    fused: tuple = ()
    renames: dict = field(default_factory=dict)
    adjacent: tuple | None = None

    def __bool__(self) -> bool:
        return bool(self.fused or self.renames or self.adjacent)


def _paired_rows(out: dict, prefix: str, heads: tuple, convert) -> None:
    """q's and k's weights and biases under ``prefix`` converted by rows in place."""
    n_heads, n_kv_heads, hd = heads
    for module, n in zip(_PAIRED, (n_heads, n_kv_heads)):
        for kind in ("weight", "bias"):
            key = f"{prefix}{module}.{kind}"
            if key in out:
                t = out[key]
                rows = t if t.dim() == 2 else t[:, None]
                rows = convert(rows, n, hd)
                out[key] = (rows if t.dim() == 2 else rows[:, 0]).contiguous()


def to_model(tensors: dict, prefix: str, form: Form) -> dict:
    """Llama-keyed tensors under ``prefix`` -> the layer's own form: q / k rows reordered,
    then ``fuse``, then renamed."""
    out = dict(tensors)
    if form.adjacent:
        _paired_rows(out, prefix, form.adjacent, hf_to_adjacent_linear)
    out = fuse(out, prefix, form.fused)
    return {_renamed(k, prefix, form.renames): t for k, t in out.items()}


def shapes_to_model(shapes: dict, prefix: str, form: Form) -> dict:
    """``to_model`` on {key: shape}."""
    out = fuse_shapes(shapes, prefix, form.fused)
    return {_renamed(k, prefix, form.renames): s for k, s in out.items()}


def from_model(tensors: dict, shapes: dict, prefix: str, form: Form) -> dict:
    """``to_model``'s inverse (``shapes``: the Llama keys' {key: shape})."""
    back = {v: k for k, v in form.renames.items()}
    out = {_renamed(k, prefix, back): t for k, t in tensors.items()}
    out = split(out, shapes, prefix, form.fused)
    if form.adjacent:
        _paired_rows(out, prefix, form.adjacent, adjacent_to_hf_linear)
    return out


def model_keys(keys: tuple, form: Form) -> tuple:
    """A coda weight's Llama keys (``HF_KEYS``) as the layer's own form names them."""
    return tuple(form.renames.get(k, k) for k in fused_keys(keys, form.fused))


def _renamed(key: str, prefix: str, renames: dict) -> str:
    if renames and key.startswith(prefix):
        return prefix + renames.get(key[len(prefix) :], key[len(prefix) :])
    return key


def fused_keys(keys: tuple, which=tuple(FUSED)) -> tuple:
    """The fused keys (of ``which``) in place of ``keys`` (a coda weight's Llama keys,
    ``HF_KEYS``), or ``keys`` where none fuses them."""
    for fused in which:
        if keys == FUSED[fused]:
            return (fused,)
    return keys


def fuse(tensors: dict, prefix: str = "", which=tuple(FUSED)) -> dict:
    """Llama-keyed tensors under ``prefix`` -> the same with each fused key's (of ``which``)
    parts concatenated by rows into it (a fused key whose parts are absent stays absent: a
    gradient not formed)."""
    out = dict(tensors)
    for fused in which:
        parts = FUSED[fused]
        if all(prefix + p in out for p in parts):
            out[prefix + fused] = torch.cat([out.pop(prefix + p) for p in parts])
    return out


def fuse_shapes(shapes: dict, prefix: str = "", which=tuple(FUSED)) -> dict:
    """``fuse`` on {key: shape}: the parts' rows summed."""
    out = dict(shapes)
    for fused in which:
        parts = FUSED[fused]
        if all(prefix + p in out for p in parts):
            got = [out.pop(prefix + p) for p in parts]
            out[prefix + fused] = (sum(s[0] for s in got), got[0][1])
    return out


def split(tensors: dict, shapes: dict, prefix: str = "", which=tuple(FUSED)) -> dict:
    """``fuse``'s inverse: each fused key's tensor split by rows into the Llama keys of
    ``shapes`` (their {key: shape}, which says each part's rows)."""
    out = dict(tensors)
    for fused in which:
        parts = FUSED[fused]
        if prefix + fused in out:
            rows = [shapes[prefix + p][0] for p in parts]
            pieces = out.pop(prefix + fused).split(rows)
            out.update({prefix + p: t for p, t in zip(parts, pieces)})
    return out
