"""What ``coda.transformers.apply_coda`` reads from a model's config and rotary module for its
layers: the config's rules (``check_config``), the RoPE types it takes (``ROPE_TYPES``) and
each one's inverse frequencies (``rope_arguments``: LongRoPE's two sets, YaRN's constant,
a partial RoPE's rotated dimensions), Gemma 3's RoPE per layer type (``typed_rotary``),
multimodal RoPE's rows (``mrope_sections``), and which dimensions of a head turn together,
and which way (``rope_pairs``). Kept apart from the families' tables (``_hf_families``),
which these rules serve."""

from __future__ import annotations

import sys
import types

import torch

from coda import _validate as v
from coda._hf_families import ACTIVATIONS, activation_name

# RoPE types whose angles are positions times fixed inverse frequencies (the rotary module's
# ``inv_freq``): "yarn" also scales cos and sin by a constant c (the module's
# ``attention_scaling``), which a patched layer folds into the attention's scale, as
# (c R q) . (c R k) = c^2 (R q) . (R k); "longrope" (Phi-3.5's) has two such sets, the long one
# for a call whose largest position reaches the original context (HF's rule), and YaRN's kind
# of constant; "dynamic" recomputes its frequencies from the sequence length
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "ntk_alpha")
# Hunyuan's NTK-alpha RoPE: a base stretched by a fixed ``alpha``, so fixed frequencies, which
# its checkpoints label "dynamic" (transformers 5.2x's rotary module names it "ntk_alpha"; before
# that, 5.17's kept "dynamic" and recomputed them past ``max_position_embeddings``, which coda
# does not: it keeps them fixed, as the later module does)
NTK_ALPHA = "ntk_alpha"


def typed_rotary(rotary, config, layer_type):
    """The rotary module ``rotary`` as one layer type sees it (Gemma 3's: RoPE per layer type,
    its buffers ``<type>_inv_freq``, its ``rope_type`` a dict): an object with the
    ``rope_type``, ``inv_freq`` and ``attention_scaling`` of ``layer_type``'s RoPE; ``rotary``
    itself for a model with one RoPE (``layer_type`` then ignored)."""
    if not isinstance(rotary.rope_type, dict):
        return rotary
    if getattr(rotary, f"{layer_type}_inv_freq").device.type == "meta":  # (as
        with torch.device("cpu"):  # ``inverse_frequencies``: made afresh on the CPU)
            rotary = type(rotary)(config)
    return types.SimpleNamespace(
        rope_type=rotary.rope_type[layer_type],
        inv_freq=getattr(rotary, f"{layer_type}_inv_freq"),
        attention_scaling=getattr(rotary, f"{layer_type}_attention_scaling"),
    )


def check_config(config, rotary) -> None:
    act = activation_name(config)
    key = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
    rules = [
        (act in ACTIVATIONS, f"{key}={act!r}"),
        (not getattr(config, "mlp_bias", False), "mlp_bias=True"),
        (getattr(config, "pretraining_tp", 1) == 1, "pretraining_tp != 1"),
        (rope_type(rotary, config) in ROPE_TYPES, f"rope_type={rotary.rope_type!r}"),
        # Phi-3's and Seed-OSS's dropout on each residual branch (0 in Phi-3's released
        # configs; Seed-OSS's 0.1: set it to 0 to patch)
        (
            not getattr(config, "resid_pdrop", 0.0),
            f"resid_pdrop={getattr(config, 'resid_pdrop', 0)}",
        ),
        (
            not getattr(config, "residual_dropout", 0.0),
            f"residual_dropout={getattr(config, 'residual_dropout', 0)}",
        ),
    ]
    for ok, what in rules:
        if not ok:
            raise v.CodaInputError(f"apply_coda: {what} is not supported")


def rope_type(rotary, config) -> str:
    """A rotary module's RoPE type, "ntk_alpha" for Hunyuan's "dynamic" one with a fixed
    ``alpha`` (``NTK_ALPHA``)."""
    alpha = (getattr(config, "rope_parameters", None) or {}).get("alpha")
    return NTK_ALPHA if rotary.rope_type == "dynamic" and alpha else rotary.rope_type


def mrope_sections(rotary) -> list | None:
    """Each frequency's position row (0 time, 1 height, 2 width) of a multimodal rotary
    module, or None for another: read from the module's own ``recomposition_frequencies``
    (which merges three rows' angles into one table) applied to rows of 0, 1 and 2, so
    Qwen2-VL's chunks (chunk k of ``mrope_section`` takes row k % 3) and Qwen3-VL's
    interleaved order come out as the model computes them; GLM-4V's, whose table repeats each
    frequency for the two dimensions of its adjacent pair, read at one of the two. A RoPE on
    part of each head (GLM-4V's half) gives its unrotated pairs row 0 (frequency 0 there)."""
    recompose = getattr(rotary, "recomposition_frequencies", None)
    if recompose is None or getattr(rotary, "mrope_section", None) is None:
        return None
    half = rotary.inv_freq.numel()
    probe = torch.arange(3.0).view(3, 1, 1).repeat(1, 1, half)  # (a copy: Qwen3-VL's writes)
    rows = recompose(probe).reshape(-1)  # (2 half entries: a row for each dimension)
    halves = bool((rows[:half] == rows[half:]).all())  # (Qwen's: [freqs, freqs]; else
    rows = rows[:half] if halves else rows[0::2]  # GLM-4V's, each frequency twice in a row)
    config = rotary.config
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return [int(x) for x in rows] + [0] * (hd // 2 - half)


def inverse_frequencies(rotary, config) -> tuple:
    """The model's RoPE inverse frequencies (float64, CPU): its buffer (for LongRoPE, whose
    buffer holds the set its last call used, the short set it was made with), or for a model
    made on the meta device (no values yet; sharded before it is loaded, as FSDP2 recipes do)
    the buffer of the same rotary module made afresh from the config on the CPU. With them
    LongRoPE's (long set, original context length), computed as HF's rotary module computes
    them on its first long call; (None, None) for the other types."""
    if rotary.inv_freq.device.type == "meta":
        with torch.device("cpu"):
            rotary = type(rotary)(config)
    if rotary.rope_type != "longrope":
        return rotary.inv_freq.detach().to("cpu", torch.float64), (None, None)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    after = int(config.rope_parameters["original_max_position_embeddings"])
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=after + 1)
    short = rotary.original_inv_freq.detach().to("cpu", torch.float64)
    return short, (long.to(torch.float64), after)


def rope_arguments(rotary, config) -> tuple:
    """(inverse frequencies, LongRoPE's (long set, context) or (None, None), YaRN's or
    LongRoPE's constant c on cos and sin, else 1, the rotated dimensions of a head) of a
    rotary module, after the config's checks. A RoPE on part of each head
    (``partial_rotary_factor`` < 1: GLM's adjacent pairs, Phi-4-mini's rotate-half ones):
    its other pairs at frequency 0 (angle 0, the identity exactly), as coda's epilogue
    rotates whole heads (the layer's column order puts the rotated pairs first: ``coda.
    _hf_fused.Form``)."""
    check_config(config, rotary)
    inv_freq, long_rope = inverse_frequencies(rotary, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotated = 2 * inv_freq.numel()
    if rotated > head_dim:
        raise v.CodaInputError(
            f"apply_coda: a rotary embedding of {rotated} dimensions in heads of {head_dim}"
        )
    pad = (0, head_dim // 2 - inv_freq.numel())
    inv_freq = torch.nn.functional.pad(inv_freq, pad)
    if long_rope[0] is not None:
        long_rope = (torch.nn.functional.pad(long_rope[0], pad), long_rope[1])
    return inv_freq, long_rope, float(rotary.attention_scaling), rotated


def rope_pairs(hf_layer) -> str:
    """Which dimensions of a head the model's RoPE rotates together, read from its modeling
    module's own ``rotate_half``: "half" (i, i + hd / 2), Llama's and most families',
    "adjacent" (2i, 2i + 1), GLM's, or "half_negative", Llama's pairs turned by -theta
    (NanoChat's)."""
    module = sys.modules[type(hf_layer.self_attn).__module__]  # (GLM-4V's text one: ``_llm``)
    rotate = getattr(module, "rotate_half_llm", None) or getattr(module, "rotate_half", None)
    if rotate is None:
        return "half"
    got = rotate(torch.arange(1.0, 5.0)).tolist()
    if got == [-3.0, -4.0, 1.0, 2.0]:
        return "half"
    if got == [-2.0, 1.0, -4.0, 3.0]:
        return "adjacent"
    if got == [3.0, 4.0, -1.0, -2.0]:  # (minus Llama's: q cos - rot(q) sin, a turn by -theta)
        return "half_negative"
    raise v.CodaInputError(
        f"apply_coda: {type(hf_layer.self_attn).__module__}.rotate_half takes (1, 2, 3, 4) to "
        f"{got}: neither Llama's rotation of halves nor GLM's of adjacent pairs"
    )


def tag_mrope_rows(rotary, args, kwargs, output) -> None:
    """A multimodal rotary module's forward hook: its cos table carries the (3, batch, seq)
    position rows it was computed from (``coda_mrope_positions``), which the patched layers'
    kernel path reads; on the tensor the layers are handed, so a checkpoint's recompute
    reads the same rows."""
    position_ids = args[1] if len(args) > 1 else kwargs["position_ids"]
    output[0].coda_mrope_positions = position_ids.expand(3, -1, -1)
