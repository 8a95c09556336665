"""The forms an HF layer's state dict takes beyond Llama's keys, which coda's layer speaks:
fused projections, other norm names, and q / k rows already in adjacent-pair order.

``Phi3Attention``'s ``qkv_proj`` is the row concatenation of Llama's ``q_proj``, ``k_proj``
and ``v_proj`` (its forward slices q, then k, then v off the output), and ``Phi3MLP``'s
``gate_up_proj`` that of ``gate_proj`` and ``up_proj`` (its forward chunks gate, then up);
GLM's and GLM-4's layers fuse ``gate_up_proj`` alone. GLM-4 names its four norms otherwise
than Gemma 2 (``GLM4_NORMS``). GLM rotates adjacent pairs (2i, 2i+1) of each head, the order
coda's q and k columns take, where Llama rotates (i, i + hd / 2): its q and k rows (weights
and biases) map to Llama's by the inverse of ``coda.layouts``' permutation, so that
permutation then leaves them as they are. Phi-4-mini rotates (i, i + r / 2) of the first r of
each head's dimensions only (``partial_rotary_factor`` r / hd), passing the others: its rows
map to Llama's so that coda's order puts those pairs first, then the unrotated dimensions
(the layer rotates them at frequency 0). So each form converts to and from Llama's keys
exactly (splitting or concatenating rows, renaming, permuting rows), and
``coda.nn.DecoderLayer``'s Llama conversions (``coda.layouts``) do the rest. Used by
``coda.transformers`` for the layers of those forms (``Form``), whose state-dict hooks
(``to_hf_keys``, ``from_hf_keys``) are here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from coda.reference.rope import head_perm

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
    own), and, for q / k rows in another order than Llama's, its (n_heads, n_kv_heads,
    head_dim) (``adjacent``): GLM's adjacent pairs, or with ``rotated`` (r > 0) the rotate-half
    pairs of a head's first r dimensions (Phi-4-mini's)."""

    fused: tuple = ()
    renames: dict = field(default_factory=dict)
    adjacent: tuple | None = None
    rotated: int = 0

    def __bool__(self) -> bool:
        return bool(self.fused or self.renames or self.adjacent)


def pair_order(head_dim: int, rotated: int = 0) -> torch.Tensor:
    """The model's column for each of coda's columns of a head (coda's position p takes the
    model's ``pair_order[p]``): the identity for GLM's adjacent pairs (``rotated`` 0); for a
    rotate-half RoPE on the first r = ``rotated`` dimensions, its pairs (i, i + r / 2) first,
    then the r-th dimension on, unrotated."""
    if not rotated:
        return torch.arange(head_dim)
    return torch.cat([head_perm(rotated), torch.arange(rotated, head_dim)])


def _paired_rows(out: dict, prefix: str, form: "Form", to_model: bool) -> None:
    """q's and k's weights and biases under ``prefix`` reordered by rows in place, Llama's
    order to the model's (``to_model``) or back: coda's position p reads Llama's row
    ``head_perm[p]`` and the model's row ``pair_order[p]``."""
    n_heads, n_kv_heads, hd = form.adjacent
    llama, model = head_perm(hd), pair_order(hd, form.rotated)
    src, dst = (llama, model) if to_model else (model, llama)
    within = torch.empty_like(src)
    within[dst] = src  # the destination's row j reads the source's row within[j]
    for module, n in zip(_PAIRED, (n_heads, n_kv_heads)):
        idx = (torch.arange(n)[:, None] * hd + within[None, :]).flatten()
        for kind in ("weight", "bias"):
            key = f"{prefix}{module}.{kind}"
            if key in out:
                out[key] = out[key][idx.to(out[key].device)].contiguous()


def to_model(tensors: dict, prefix: str, form: Form) -> dict:
    """Llama-keyed tensors under ``prefix`` -> the layer's own form: q / k rows reordered,
    then ``fuse``, then renamed."""
    out = dict(tensors)
    if form.adjacent:
        _paired_rows(out, prefix, form, to_model=True)
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
        _paired_rows(out, prefix, form, to_model=False)
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


def to_hf_keys(module, state_dict, prefix, local_metadata):
    """A patched layer's state-dict post-hook: its own parameters under HF's keys and layouts
    (``hf_state_dict``), unless ``hf_keys`` is off (``coda.transformers.coda_keys``); its
    submodules' keys (an MoE layer's experts) are the model's already."""
    if not module.hf_keys:
        return
    for name in module._parameters:  # coda's own parameters, under HF's keys instead
        state_dict.pop(prefix + name, None)
    state_dict.update(module.hf_state_dict(prefix))


def from_hf_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """Its load pre-hook: HF's keys for its own parameters, where all are given, converted."""
    keys = [prefix + k for k in module.hf_shapes()]
    if not all(k in state_dict for k in keys):
        return  # already coda keys, or missing ones: load_state_dict reports them
    hf = {k: state_dict.pop(k) for k in keys}
    state_dict.update({prefix + n: t for n, t in module.params_from_hf(hf, prefix).items()})
