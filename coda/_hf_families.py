"""Which transformers models ``coda.transformers.apply_coda`` takes, and how: the families
whose decoder layers become coda's (``SUPPORTED``, their task models ``TASK_HEADS``), those
whose training loss alone does (``LOSS_ONLY``, with why their layers are not coda's), the
vision-language models (``VISION_LANGUAGE``; ``TEXT_LOSS_ONLY``: their text models whose layers
are not coda's), and the rules a patched layer needs of the HF layer it replaces (its options,
``layer_options``; ``check_linears``, ``fused_projections``, ``attention_biases``,
``sliding_window``; the config's and its RoPE's: ``coda._hf_rope``). Kept apart from the
patch itself so that adding a family is a change to these tables and their tests."""

from __future__ import annotations

import sys

import torch

from coda import _validate as v
from coda._hf_forward import check_final_norm, norm_epsilon, norm_form
from coda._hf_fused import GLM4_NORMS
from coda.env import host_cache

SUPPORTED = (
    "LlamaForCausalLM",
    "LlamaModel",
    "MistralForCausalLM",
    "MistralModel",
    "Qwen2ForCausalLM",
    "Qwen2Model",
    "Qwen3ForCausalLM",
    "Qwen3Model",
    "Phi3ForCausalLM",
    "Phi3Model",
    "SmolLM3ForCausalLM",
    "SmolLM3Model",
    # Llama's layer with a per-layer sliding window (``layer_types``): Ministral-8B's, and
    # Meta's CWM (Llama 3's RoPE scaling)
    "MinistralForCausalLM",
    "MinistralModel",
    "CwmForCausalLM",
    "CwmModel",
    # Llama's layer with q, k, v biases (Qwen2's) and an optional o bias: Seed-OSS's
    "SeedOssForCausalLM",
    "SeedOssModel",
    # Llama's layer with GeGLU and norms scaling by 1 + w in fp32 (``layer_options``):
    # Gemma's (its scaled token embedding stays HF's)
    "GemmaForCausalLM",
    "GemmaModel",
    # Gemma's with a norm after each sublayer (``DecoderLayer(post_norms=True)``), sliding-
    # window layers and the attention's scale from ``query_pre_attn_scalar``: Gemma 2's (its
    # attention logits soft-capped by its attention function, HF's) and Gemma 3's (QK-norm
    # with 1 + w gains; RoPE per layer type, ``typed_rotary``)
    "Gemma2ForCausalLM",
    "Gemma2Model",
    "Gemma3ForCausalLM",
    "Gemma3TextModel",
    # Gemma 2's without the norms after the sublayers, its pre-MLP norm under Gemma 2's name
    # (``VAULTGEMMA_NORMS``): VaultGemma's
    "VaultGemmaForCausalLM",
    "VaultGemmaModel",
    # Llama's layer rotating adjacent pairs of part of each head (``rope_pairs``, its other
    # dimensions passed through: frequency 0), q, k, v biases and a fused gate_up_proj: GLM's;
    # with Gemma 2's four norms under other names (``_hf_fused.GLM4_NORMS``): GLM-4's
    "GlmForCausalLM",
    "GlmModel",
    "Glm4ForCausalLM",
    "Glm4Model",
    # norms after each sublayer only (``DecoderLayer(pre_norms=False)``), Qwen3's QK-norm, its
    # global layers without RoPE where it has sliding ones (``GLOBAL_NOPE_ATTENTION``): EXAONE 4's
    "Exaone4ForCausalLM",
    "Exaone4Model",
    # Llama's layer rotating adjacent pairs of whole heads (GLM's order): ERNIE 4.5's (dense)
    "Ernie4_5ForCausalLM",
    "Ernie4_5Model",
    # EXAONE 4's norms, a QK-norm over the whole q and k projections (``qk_norm="whole"``) and
    # every norm's gain applied in fp32 before its one rounding (``fp32_gains``): OLMo 2's and
    # OLMo 3's (its sliding-window layers, RoPE per layer type as Gemma 3's)
    "Olmo2ForCausalLM",
    "Olmo2Model",
    "Olmo3ForCausalLM",
    "Olmo3Model",
    # Llama's layer with each sublayer's output scaled before its residual add
    # (``residual_multiplier``: ``DecoderLayer(residual_scale=)``, in F3's and F5's epilogues)
    # and the attention's scale from ``attention_multiplier`` (the HF module's ``scaling``);
    # its embedding multiplier stays the model's, its ``logits_scaling`` is the loss's
    "GraniteForCausalLM",
    "GraniteModel",
    # Llama's layer with Qwen3's per-head QK-norm of the rotated q and k (under other names,
    # ``QK_NORMS``: ``DecoderLayer(qk_norm_after_rope=True)``) and its RoPE's fixed NTK-alpha
    # frequencies: Hunyuan's (dense)
    "HunYuanDenseV1ForCausalLM",
    "HunYuanDenseV1Model",
    # Llama's layer with an MLP without a gate, relu(x)^2 (``DecoderLayer(activation="relu2")``:
    # W_il is ``up_proj`` alone): Arcee's (AFM)
    "ArceeForCausalLM",
    "ArceeModel",
    # Llama's layer (Llama 3's RoPE) with Qwen3's QK-norm, its norms under other names
    # (``APERTUS_NORMS``) and an MLP without a gate, down(xielu(up(x))), whose two learned
    # scalars are the layer's ``mlp.act_fn`` (``DecoderLayer(activation="xielu")``): Apertus's
    "ApertusForCausalLM",
    "ApertusModel",
    # Llama's layer rotating adjacent pairs (GLM's order), its norms' gains applied in fp32
    # (OLMo's rounding, ``fp32_gains``): Helium's
    "HeliumForCausalLM",
    "HeliumModel",
    # Granite's layer (its multipliers) with, by default (``use_post_norm``), Gemma 2's four
    # norms under other names (``HYPERCLOVAX_NORMS``; "Peri-LN"), the residual multiplier then
    # folded into the post-norms' gains: HyperCLOVAX's
    "HyperCLOVAXForCausalLM",
    "HyperCLOVAXModel",
    # Llama's layer (YaRN RoPE) with q times Llama 4's attention temperature after RoPE, a
    # factor per position (``TEMPERED_ATTENTION``, in the attention call): Ministral 3's
    "Ministral3ForCausalLM",
    "Ministral3Model",
    # Arcee's MLP (relu^2, no gate) under CLIP's names (``FC_MLP``), weightless norms
    # (``DecoderLayer(norm_gains=False)``), Hunyuan's QK-norm of the rotated q and k, RoPE by
    # -theta (``rope_pairs`` "half_negative") and Gemma 2's soft-capped logits; its token
    # embeddings normed by its final norm's module (``_hf_forward.EMBEDDINGS_NORMED``):
    # NanoChat's
    "NanoChatForCausalLM",
    "NanoChatModel",
)
# mixture-of-experts families whose decoder layers are coda's up to the attention's residual
# add (``DecoderLayer(mlp=)``: ``coda.autograd_sublayer``), the norm before the experts and the
# experts themselves (router, shared expert) staying the model's own modules, called as its
# layer calls them: the decoder-layer classes whose forward is Llama's with a mixture of experts
# for ``mlp`` (a dense layer among them, Llama's MLP, is coda's whole; session 81)
_MOE_FAMILIES = ("Mixtral", "Qwen2Moe", "Qwen3Moe", "Olmoe", "Ernie4_5_Moe", "MiniMaxM2")
_MOE_FAMILIES += ("Mellum", "Glm4Moe", "HunYuanMoEV1", "SolarOpen")
MOE_LAYERS = tuple(f"{family}DecoderLayer" for family in _MOE_FAMILIES)
MOE_LAYERS += ("Qwen3VLMoeTextDecoderLayer", "Glm4vMoeTextDecoderLayer")  # (their VLMs' text)
# the MoE layers whose modules after the norm go by other names than ``mlp``, their outputs
# summed: Granite-MoE's experts (``block_sparse_moe``), Granite-MoE-Shared's with a shared MLP
# beside them (None in a config without one); each sublayer's output times Granite's
# residual multiplier before its add
EXPERTS = {
    "GraniteMoeDecoderLayer": ("block_sparse_moe",),
    "GraniteMoeSharedDecoderLayer": ("block_sparse_moe", "shared_mlp"),
}
MOE_LAYERS += tuple(EXPERTS)
_MOE_FAMILIES += ("GraniteMoe", "GraniteMoeShared")
_CLASSES = ("ForCausalLM", "Model")
SUPPORTED += tuple(f"{family}{kind}" for family in _MOE_FAMILIES for kind in _CLASSES)
# task models (reward models, classifiers, extractive QA) over a supported family's decoder
# stack: the stack is patched as its ``...Model`` is; the task head and its loss stay HF's
TASK_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
# models whose training loss alone coda takes (``apply_coda(model, layers=False)``), with why
# their decoder layers are not coda's. The mixture-of-experts models' loss is Llama's
# cross-entropy plus the router's load-balancing term, which coda's call adds as their forward
# does; Gemma's final norm scales by 1 + w in fp32, which coda's loss keeps in fp32
# (``coda._hf_forward.final_norm``), and its token embedding (scaled by sqrt(d) in its own
# class) stays HF's
# (Gemma's own layers are coda's since session 71: GeGLU and the 1 + w gains; Gemma 2's and
# 3's, which also norm each sublayer's output before its residual add, since session 72)
_MOE = "a mixture of experts"
LOSS_ONLY = {
    # (OLMo 2's and 3's layers are coda's since session 74)
    # later families (session 69): GPT-OSS's final norm rounds as OLMo's (its weight in fp32,
    # rounded once, ``_hf_forward.FP32_SCALED_NORMS``); Qwen3-Next's and
    # Qwen3.5's scale by 1 + w in fp32 as Gemma's (``_hf_forward.check_final_norm`` holds
    # each form against the norm itself)
    "GptOssForCausalLM": _MOE + " with attention sinks",
    "Qwen3NextForCausalLM": _MOE + " and linear-attention layers",
    "Qwen3_5MoeForCausalLM": _MOE + " and linear-attention layers",
    "DeepseekV3ForCausalLM": _MOE + " and multi-head latent attention",
    "Llama4ForCausalLM": _MOE,
    "LagunaForCausalLM": _MOE + " and a gated attention output",
    "Qwen3_5ForCausalLM": "linear-attention layers",
    # Gemma 4's text model: its layers take per-layer inputs (a second embedding), share KV
    # across layers and norm v; its final norm rounds as OLMo's, its logits soft-capped
    "Gemma4ForCausalLM": "per-layer inputs, KV shared across layers and a value norm",
}
# vision-language models (a vision encoder feeding a text model's token embeddings) whose
# training loss coda takes (``_hf_forward.vision_language_forward``), and whose text model's
# decoder layers it patches where that text model is a supported family's (Llava's and
# Llava-NeXT's Llama or Mistral, Mistral 3's Mistral, Llava-OneVision's and InternVL's Qwen2,
# Idefics3's and SmolVLM's Llama) or Qwen2-VL's (``MROPE_TEXT``); the others' text layers, with
# why, for ``layers=False``
VISION_LANGUAGE = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "InternVLForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "PaliGemmaForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Glm4vForConditionalGeneration",
    "Glm4vMoeForConditionalGeneration",
    "MllamaForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
TEXT_LOSS_ONLY = {
    "MllamaTextModel": "cross-attention layers to the image",
    "Qwen3_5TextModel": LOSS_ONLY["Qwen3_5ForCausalLM"],
    "Qwen3_5MoeTextModel": LOSS_ONLY["Qwen3_5MoeForCausalLM"],
}
# text models whose layers are Qwen2's (Qwen2-VL, Qwen2.5-VL) or Qwen3's (Qwen3-VL) with
# multimodal RoPE: coda's layer with ``mrope_sections``
MROPE_TEXT = ("Qwen2VLTextModel", "Qwen2_5_VLTextModel", "Qwen3VLTextModel", "Glm4vTextModel")
# (and their mixture-of-experts text models', ``MOE_LAYERS``: Qwen3-VL-MoE's, GLM-4.5V's)
MROPE_TEXT += ("Qwen3VLMoeTextModel", "Glm4vMoeTextModel")
# an HF attention module's QK-norm modules (q's, k's): Qwen3's (before RoPE); Hunyuan's (after)
QK_NORMS = (("q_norm", "k_norm"), ("query_layernorm", "key_layernorm"))
# HF attention modules that norm the rotated q and k under Qwen3's names: NanoChat's
ROTATED_QK_NORM_ATTENTION = ("NanoChatAttention",)
# the MLP's keys of a model naming its projections as CLIP does (fc1 up, fc2 down: NanoChat's)
FC_MLP = {"mlp.up_proj.weight": "mlp.fc1.weight", "mlp.down_proj.weight": "mlp.fc2.weight"}


# the MLP activations a patched layer takes (HF's ``hidden_act`` -> coda's ``activation``)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "relu2": "relu2", "xielu": "xielu"}
# HF attention modules whose forward hands their attention function ``softcap``, the
# attention logits' soft cap (``attn_logit_softcapping``); Gemma 3's has the attribute but
# passes no cap
SOFTCAP_ATTENTION = ("Gemma2Attention", "VaultGemmaAttention")
# HF attention modules that multiply q after RoPE by Llama 4's attention temperature,
# 1 + beta log(1 + floor(position / context)) (``attention_temperature``): Ministral 3's
TEMPERED_ATTENTION = ("Ministral3Attention",)
# HF attention modules whose full-attention layers rotate nothing where the model has sliding
# ones (EXAONE 4's "global NoPE": its forward skips RoPE there), as SmolLM3's NoPE layers
GLOBAL_NOPE_ATTENTION = ("Exaone4Attention",)
# the norms of a layer with a norm after each sublayer (Gemma 2's and 3's): its pre-MLP norm is
# ``pre_feedforward_layernorm``, and ``post_attention_layernorm`` norms the attention's output
POST_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
# other families' names for those norms ({Llama's or Gemma 2's key: the family's}: HF's keys,
# ``hf_renames``): Apertus's two; HyperCLOVAX's four (without ``use_post_norm`` the two after
# the sublayers are identities, and the layer is Granite's); VaultGemma's pre-MLP norm, under
# Gemma 2's name in a layer without Gemma 2's post-norms (GLM-4's four: ``_hf_fused.GLM4_NORMS``)
APERTUS_NORMS = {
    "input_layernorm.weight": "attention_layernorm.weight",
    "post_attention_layernorm.weight": "feedforward_layernorm.weight",
}
HYPERCLOVAX_NORMS = {
    "post_attention_layernorm.weight": "post_norm1.weight",
    "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight": "post_norm2.weight",
}
VAULTGEMMA_NORMS = {"post_attention_layernorm.weight": "pre_feedforward_layernorm.weight"}
# every module name a supported layer's norm goes by (``layer_options`` checks each it has)
_RENAMED = (GLM4_NORMS, APERTUS_NORMS, HYPERCLOVAX_NORMS, VAULTGEMMA_NORMS)
LAYER_NORMS = tuple(
    dict.fromkeys(
        ("input_layernorm", "post_attention_layernorm", *POST_NORMS)
        + tuple(key.split(".")[0] for table in _RENAMED for key in table.values())
    )
)


def experts_modules(hf_layer) -> tuple:
    """The names of the HF layer's modules that stay its own after its norm, their outputs
    summed: a mixture of experts in a layer of ``MOE_LAYERS`` (``mlp``, or ``EXPERTS``' names);
    () where coda's MLP replaces them (Llama's MLP: a ``down_proj`` of its own)."""
    kind = type(hf_layer).__name__
    if kind not in MOE_LAYERS:
        return ()
    return EXPERTS.get(kind) or (() if hasattr(hf_layer.mlp, "down_proj") else ("mlp",))


def experts_module(hf_layer) -> bool:
    """Whether the HF layer's MLP stays its own module (``experts_modules``)."""
    return bool(experts_modules(hf_layer))


def has_norm(hf_layer, name: str) -> bool:
    """Whether the HF layer has a norm (a module with an epsilon, with or without a weight:
    not an identity in its place) under ``name``."""
    return norm_epsilon(getattr(hf_layer, name, None)) is not None


def activation_name(config) -> str:
    """The MLP's activation as HF's config names it: ``hidden_activation`` (Gemma 2's and
    3's MLPs read it), else ``hidden_act``."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def layer_options(hf_layer, config) -> dict:
    """``DecoderLayer``'s options for an HF layer: its MLP's ``activation`` (relu2: no gate),
    its norms' ``norm_offset`` (1 for norms scaling by 1 + w in fp32, Gemma's; 0 for Llama's
    and OLMo's, whose weight scales in fp32 too: ``fp32_gains``), its QK-norm's span
    (``qk_norm``: per head, or OLMo's over the whole projections, by its weight's length) and
    place (before RoPE, or Hunyuan's after: ``qk_norm_after_rope``, by its modules' names),
    whether it norms each sublayer's output (``post_norms``: Gemma 2's, 3's and GLM-4's four
    norms; EXAONE 4's two, without norms before the sublayers: ``pre_norms`` False), each
    sublayer output's multiplier before its residual add (``residual_scale``: Granite's), each
    norm's rounding (QK-norm's too) held against coda's form of it bitwise
    (``_hf_forward.check_final_norm``), every one with the config's epsilon."""
    # (EXAONE 4's: none before either sublayer; Apertus's under its own name)
    pre = hasattr(hf_layer, "input_layernorm") or hasattr(hf_layer, "attention_layernorm")
    post = any(has_norm(hf_layer, n) for n in ("post_feedforward_layernorm", "post_mlp_layernorm"))
    post = post or has_norm(hf_layer, "post_norm2")  # (HyperCLOVAX's, with ``use_post_norm``)
    norms = [getattr(hf_layer, n) for n in LAYER_NORMS if has_norm(hf_layer, n)]
    norms += [getattr(hf_layer.self_attn, n) for n in qk_norm_names(hf_layer.self_attn)]
    weightless = {getattr(norm, "weight", None) is None for norm in norms}
    if len(weightless) > 1:
        raise v.CodaInputError("apply_coda: a layer with some norms weighted and some weightless")
    forms = set()
    for norm in norms:
        check_final_norm(norm)
        forms.add(norm_form(norm))
        if norm_epsilon(norm) != config.rms_norm_eps:
            raise v.CodaInputError(
                f"apply_coda: a layer norm's eps {norm_epsilon(norm)} other than the config's "
                f"rms_norm_eps {config.rms_norm_eps}"
            )
    if forms - {"llama", "gemma", "fp32"} or len(forms) > 1:
        raise v.CodaInputError(f"apply_coda: layer norms of the forms {sorted(forms)}")
    residual = float(getattr(hf_layer, "residual_multiplier", 1.0))  # (Granite's)
    if residual != 1.0 and getattr(hf_layer.self_attn.o_proj, "bias", None) is not None:
        raise v.CodaInputError(
            f"apply_coda: layers.{hf_layer.self_attn.layer_idx}: residual_multiplier "
            f"{residual} with an O-projection bias (attention_bias=True) is not supported"
        )
    experts = experts_module(hf_layer)  # (then no MLP of coda's: no activation of its own)
    return {
        "activation": "silu" if experts else ACTIVATIONS[activation_name(config)],
        "norm_offset": 1.0 if "gemma" in forms else 0.0,
        "fp32_gains": "fp32" in forms,
        "qk_norm": qk_norm_span(hf_layer.self_attn),
        "post_norms": post,
        "pre_norms": pre,
        "residual_scale": residual,
        "qk_norm_after_rope": qk_norm_after_rope(hf_layer.self_attn),
        "norm_gains": weightless != {True},  # (NanoChat's weightless norms)
    }


def qk_norm_after_rope(attn) -> bool:
    """Whether an HF attention module norms q and k after RoPE: Hunyuan's (by its QK-norm's
    names, ``QK_NORMS``), NanoChat's (``ROTATED_QK_NORM_ATTENTION``)."""
    names = qk_norm_names(attn)
    rotated = type(attn).__name__ in ROTATED_QK_NORM_ATTENTION
    return names == QK_NORMS[1] or (bool(names) and rotated)


def attention_temperature(attn):
    """A function of (position_ids, q) giving q times Llama 4's attention temperature as the
    HF attention module ``attn`` applies it after RoPE (its config's ``llama_4_scaling_beta``
    and ``original_max_position_embeddings``; the same ops, so the same roundings), or None
    for a module without one (``TEMPERED_ATTENTION``)."""
    if type(attn).__name__ not in TEMPERED_ATTENTION:
        return None
    rope = attn.config.rope_parameters
    beta, context = rope.get("llama_4_scaling_beta"), rope.get("original_max_position_embeddings")

    def tempered(position_ids, q):
        if position_ids is None:  # (HF's model always hands its layers positions)
            position_ids = torch.arange(q.shape[2], device=q.device)[None]
        scale = 1 + beta * torch.log(1 + torch.floor(position_ids / context))
        return q * scale[:, None, :, None].to(q.dtype)

    return tempered


def qk_norm_names(attn) -> tuple:
    """The (q's, k's) QK-norm module names of an HF attention module (``QK_NORMS``), or ()."""
    return next((names for names in QK_NORMS if hasattr(attn, names[0])), ())


def hf_renames(hf_layer) -> dict:
    """An HF layer's state-dict keys other than Llama's (Qwen3's, Gemma 2's) for the same
    weights: GLM-4's norms (``_hf_fused.GLM4_NORMS``), Apertus's (``APERTUS_NORMS``),
    HyperCLOVAX's (``HYPERCLOVAX_NORMS``), VaultGemma's (``VAULTGEMMA_NORMS``), NanoChat's
    MLP (``FC_MLP``), Hunyuan's QK-norm."""
    out = dict(GLM4_NORMS) if hasattr(hf_layer, "post_mlp_layernorm") else {}
    out.update(APERTUS_NORMS if hasattr(hf_layer, "attention_layernorm") else {})
    out.update(HYPERCLOVAX_NORMS if has_norm(hf_layer, "post_norm2") else {})
    vault = has_norm(hf_layer, "pre_feedforward_layernorm") and not has_norm(
        hf_layer, "post_feedforward_layernorm"
    )
    out.update(VAULTGEMMA_NORMS if vault else {})
    out.update(FC_MLP if hasattr(getattr(hf_layer, "mlp", None), "fc1") else {})
    names = qk_norm_names(hf_layer.self_attn)
    if names and names != QK_NORMS[0]:
        out.update({f"self_attn.{a}.weight": f"self_attn.{b}.weight" for a, b in zip(*QK_NORMS)})
    return out


def qk_norm_span(attn):
    """An HF attention module's QK-norm as ``DecoderLayer(qk_norm=)`` takes it: False (none),
    "head" (a weight of head_dim: Qwen3's, one per head) or "whole" (a weight of all the
    heads': OLMo's, over the whole q and k projections)."""
    names = qk_norm_names(attn)
    if not names:
        return False
    if getattr(getattr(attn, names[0]), "weight", None) is None:  # weightless (NanoChat's):
        return "head"  # applied to q and k as heads, (batch, heads, seq, head_dim)
    hd = attn.head_dim
    q, k = (getattr(attn, n).weight.shape[0] for n in names)
    if (q, k) == (hd, hd):
        return "head"
    if q % hd or k % hd:  # (whole heads: the exact lengths are checked as the weights load)
        raise v.CodaInputError(
            f"apply_coda: a QK-norm of weights ({q},), ({k},) at head_dim {hd}: neither per "
            "head nor over the whole q and k projections"
        )
    return "whole"


def layer_type(hf_layer, config):
    """The layer's type in ``config.layer_types`` (Gemma 2's and 3's sliding or full
    attention), or None for a config without them."""
    types_ = getattr(config, "layer_types", None)
    return None if types_ is None else types_[hf_layer.self_attn.layer_idx]


def check_linears(hf_layer, where: str) -> None:
    """Every projection (``*_proj``) of an HF layer is a plain ``nn.Linear`` (what coda
    fuses; a mixture of experts stays the model's, adapters and all: its attention's alone)."""
    experts = experts_module(hf_layer)
    for name, module in hf_layer.named_modules():
        if experts and not name.startswith("self_attn."):
            continue
        projection = name.endswith("_proj") or name in ("mlp.fc1", "mlp.fc2")  # (``FC_MLP``)
        if projection and type(module) is not torch.nn.Linear:
            cls = type(module)  # (PEFT's LoRA linear is also called Linear: say whose)
            what = cls.__name__ if cls.__name__ != "Linear" else f"{cls.__module__}.Linear"
            raise v.CodaInputError(
                f"apply_coda: {where}.{name} is a {what}, not a plain "
                "torch.nn.Linear (adapters such as LoRA and quantized or fp8 linears are not "
                "supported in patched layers; apply_coda(model, layers=False) keeps the "
                "layers as they are and makes only the loss coda's)"
            )


def fused_projections(hf_layer, where: str) -> tuple:
    """The layer's fused projections, as their state-dict keys (``_hf_fused.FUSED``): Phi-3's
    ``qkv_proj`` and ``gate_up_proj``, GLM's ``gate_up_proj`` alone, none (Llama's), each
    without a bias."""
    fused = []
    mlp = () if experts_module(hf_layer) else ((hf_layer.mlp, "gate_up_proj"),)
    for owner, name in ((hf_layer.self_attn, "qkv_proj"), *mlp):
        module = getattr(owner, name, None)
        if module is None:
            continue
        if module.bias is not None:
            raise v.CodaInputError(
                f"apply_coda: {where}: biases on fused projections ({name} has one)"
            )
        fused.append(f"{'self_attn' if owner is hf_layer.self_attn else 'mlp'}.{name}.weight")
    return tuple(fused)


def check_mlp_biases(hf_layer, where: str) -> None:
    """The MLP's projections have no biases, whatever the config calls them (ERNIE 4.5's
    ``use_bias``; Llama's ``mlp_bias`` is refused with the config); a mixture of experts (the
    model's module) may have them."""
    if experts_module(hf_layer):
        return
    biased = [n for n, m in hf_layer.mlp.named_children() if getattr(m, "bias", None) is not None]
    if biased:
        raise v.CodaInputError(
            f"apply_coda: {where}: biases on the MLP's projections ({', '.join(biased)}) are "
            "not supported"
        )


def attention_biases(attention, where: str) -> tuple[bool, bool]:
    """(whether the q, k and v projections have biases, whether o_proj has one): Qwen2's are
    on q, k and v, Llama's ``attention_bias=True`` puts them on all four; q, k and v have
    them all or none (Phi-3's fused qkv_proj: none, ``fused_projections``)."""
    names = ("qkv_proj",) if hasattr(attention, "qkv_proj") else ("q_proj", "k_proj", "v_proj")
    has = [getattr(attention, n).bias is not None for n in names]
    if len(set(has)) > 1:
        raise v.CodaInputError(
            f"apply_coda: {where}: biases on some of q_proj, k_proj and v_proj; supported on "
            "all three (Qwen2's; with o_proj's too, Llama's attention_bias=True) or none"
        )
    return has[0], attention.o_proj.bias is not None


def attention_weights(attention, fused: tuple, qk_norm: tuple, where: str) -> tuple:
    """The HF attention module's weight modules a patched layer takes over (its projections,
    split or fused (``fused_projections``), and its QK-norm's ``qk_norm`` modules), checked to
    be all its parameters: a weight it has beyond them (Laguna's output gate ``g_proj``,
    GPT-OSS's attention sinks) would be lost, so it is refused, named."""
    fused_qkv = "self_attn.qkv_proj.weight" in fused
    names = (*(("qkv_proj",) if fused_qkv else ("q_proj", "k_proj", "v_proj")), "o_proj", *qk_norm)
    left = [n for n, _ in attention.named_parameters() if n.split(".")[0] not in names]
    if left:
        raise v.CodaInputError(
            f"apply_coda: {where}.self_attn has weights coda's layer would not apply "
            f"({', '.join(left)}): not supported"
        )
    return names


def global_nope(attention) -> bool:
    """Whether an HF attention module's layer rotates nothing: a full-attention layer of a
    model with sliding ones, in a family whose forward skips RoPE there
    (``GLOBAL_NOPE_ATTENTION``, EXAONE 4's)."""
    return (
        type(attention).__name__ in GLOBAL_NOPE_ATTENTION
        and attention.sliding_window is not None
        and not attention.is_sliding
    )


def sliding_window(attention) -> dict:
    """The ``sliding_window`` argument an HF attention module passes its attention function:
    its own (Qwen2, Qwen3: per layer, None on full-attention layers; EXAONE 4's the model's on
    its sliding layers, ``is_sliding``), the model's (Mistral), or none (Llama)."""
    if getattr(attention, "is_sliding", True) is False:
        return {"sliding_window": None}
    if hasattr(attention, "sliding_window"):
        return {"sliding_window": attention.sliding_window}
    if hasattr(attention.config, "sliding_window"):
        return {"sliding_window": attention.config.sliding_window}
    return {}


@host_cache()
def hf_attention_functions(attention_class: type):
    """transformers' attention functions and the eager one ``attention_class``'s forward
    falls back on: its own modeling module's (Gemma 2's soft-caps the logits), else Llama's
    (``host_cache``: cached per class in eager calls, run as it is inside a trace)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    own = getattr(sys.modules.get(attention_class.__module__), "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS, own or eager_attention_forward
