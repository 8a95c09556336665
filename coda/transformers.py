"""Hugging Face models in one call: ``apply_coda(model)`` patches a transformers model of a
supported family (below) in place so its decoder layers run coda's kernels and, in a training
step (labels given, autograd recording), ``model(input_ids, labels=...)`` returns the loss
through coda's LM-head loss, logits never stored (honoring the loss arguments HF's own loss reads
from the call: ``num_items_in_batch``, ``shift_labels``, ``ignore_index``); under
``torch.no_grad`` (an evaluation loop reading logits for its metrics) it returns HF's logits and
loss, and ``skip_logits=`` picks either for a call.

The token embedding stays the model's module and parameter (tied to the LM head where the
model ties them); only its backward becomes coda's deterministic sorted scatter
(``coda.nn.Embedding``: the module's class, ``embedding=False`` leaves it as it is). What
stays the model's own besides: the attention function the config selects (sdpa,
flash, eager: called with the model's masks and KV cache, so padding, packed sequences and
generation behave as before), the RoPE tables the model computes (the reference path uses them
as given; the kernel path forms the same angles from ``position_ids`` and the model's inverse
frequencies, Llama 3's scaling included), and the state-dict layout: each patched layer stores
coda's paired layouts (``coda.layouts``) but ``state_dict()`` / ``load_state_dict()`` /
``save_pretrained`` speak HF's keys and shapes, exactly. Without labels the model returns
logits as before (generation works). A patched layer is an instance of the HF layer class it
replaced, under its name (``patched_class``), so ``output_hidden_states`` and whatever finds
layers by class or name (the Trainer's FSDP auto-wrap) see it. HF's activation checkpointing
and frozen weights (``requires_grad=False``) behave as on the unpatched model; a model made on
the meta device can be patched before it is loaded, and one placed over several GPUs by
accelerate (``device_map``) keeps each layer's hook on the coda layer that replaces it (its
weights offloaded: refused). Anything not supported (another
architecture, a config feature, an adapter or quantized linear in place of a projection,
``output_attentions``) raises ``CodaInputError`` naming it: nothing is silently left out.

Under a CUDA-graph capture (``coda.nn.GraphedStep``) transformers 5.17 cannot tell the
capture from a trace and hands SDPA its causal mask as a (batch, 1, seq, seq) tensor in place
of ``is_causal``, as it does under a torch.compile trace before torch 2.14: a captured 1B step
ran 0.75x its eager one (NOTES.md, session 19), a compiled HF Llama's attention 2.9x (run 298).
Where that mask is provably the plain causal one (the caller gave no attention mask,
positions, cache or cache positions; the layer has no sliding window), the patched model's
sdpa layers pass no mask, as the eager step does.

Supported (``SUPPORTED``; each family's form beside its name there, and in docs/HUGGINGFACE.md):
transformers 5.x ``...ForCausalLM`` / ``...Model`` of Llama, Mistral, Qwen2, Qwen3, Phi3, SmolLM3,
Ministral, Ministral 3, Cwm, SeedOss, Gemma, Gemma 2 and Gemma 3 text, VaultGemma, GLM and GLM-4,
EXAONE 4, ERNIE 4.5, OLMo 2 and OLMo 3, Granite, Hunyuan (dense), Arcee, Apertus, Helium and
HyperCLOVAX: Llama's layer with the options ``_hf_families.layer_options`` reads from the HF layer
(GeGLU; relu^2 or xIELU, its learned scalars, without a gate; norms scaling by 1 + w or by w in
fp32, norms after each sublayer with or without norms before, a QK-norm per head before or after
RoPE or over the whole q and k, branch multipliers; Ministral 3's attention temperature), no biases
but Qwen2's on q, k and v and Llama's ``attention_bias=True`` ones on q, k, v and o, RoPE "default",
"linear", "llama3", "yarn", "longrope" or Hunyuan's fixed NTK-alpha on whole heads or part of each
(GLM's adjacent pairs, Phi-4-mini's rotate-half ones: the others at frequency 0; SmolLM3's NoPE
layers and EXAONE 4's full ones at frequency 0 throughout): a fixed set of inverse frequencies taken
from the model (LongRoPE's two, the long one for a call whose largest position reaches the original
context, as HF's rotary module picks), YaRN's and LongRoPE's constant factor on cos and sin folded
into the attention's scale (and taken back off a partial RoPE's unrotated dimensions); Qwen3's
per-head QK-norm and Qwen2's q, k, v biases run in the QKV GEMM's epilogue
(``coda.kernels.qk_norm``, ``coda.kernels.gemm_rope``); fused projections (Phi-3's, GLM's) and other
weight names (GLM-4's, Apertus's, HyperCLOVAX's and VaultGemma's norms, Hunyuan's QK-norm) convert
exactly (``coda._hf_fused``); residual dropout must be 0 (Phi-3's and Seed-OSS's); sliding windows
keep the model's own masks and window; and those families' ``...ForSequenceClassification`` (reward
models), ``...ForTokenClassification`` and ``...ForQuestionAnswering`` (``TASK_HEADS``: the decoder
stack patched, the task head and its loss HF's). The mixture-of-experts families of ``MOE_LAYERS``
(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ERNIE 4.5 MoE, MiniMax-M2, Mellum, GLM-4.5, Hunyuan MoE,
Solar Open, Granite-MoE and Granite-MoE-Shared): each layer's attention sublayer coda's up to its
residual add, the norm before the experts the model's (on the kernel path coda's row passes of its
weight) and the experts its own modules (``ffn_sublayer``), the router's term added to coda's loss.
``apply_coda(model, layers=False)`` makes only the training call's loss coda's: for layers with
adapters, and for the models of ``LOSS_ONLY`` (each with why), their final norms' forms kept
(Gemma's 1 + w and OLMo's and GPT-OSS's weight in fp32, Granite's ``logits_scaling`` folded into
the gain, Gemma 2's soft-capped logits). Each final norm's form is held against the norm itself
before patching (``_hf_forward.check_final_norm``). Vision-language
models (``VISION_LANGUAGE``: Llava, Llava-NeXT, Llava-OneVision, Mistral 3, InternVL, Idefics3,
SmolVLM, Gemma 3, PaliGemma, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, GLM-4V, GLM-4.5V,
Mllama, Qwen3.5, Qwen3.5 MoE): the training call's loss
through coda's (the model's own forward runs, its images, masks and multimodal positions its own,
with its final norm and LM head skipped and its loss function coda's:
``_hf_forward.vision_language_forward``), and the text model's decoder layers where that text model
is a supported family's (Llama, Mistral, Ministral 3, Qwen2, Gemma) or a Qwen-VL model's or GLM-4V's
(Qwen2's, Qwen3's or GLM-4's layer with multimodal RoPE: ``mrope_sections``, the position rows
tagged on the rotary module's output, ``_tag_mrope_rows``; of Qwen3-VL-MoE's and GLM-4.5V's the
attention sublayers, as in ``MOE_LAYERS``); the others take ``layers=False``; the
vision encoder stays HF's."""

from __future__ import annotations

import contextlib
import functools

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from coda import _hf_forward as hf_forward
from coda import _hf_fused
from coda import _validate as v
from coda._hf_families import (
    LOSS_ONLY,
    MROPE_TEXT,
    SOFTCAP_ATTENTION,
    SUPPORTED,
    TASK_HEADS,
    TEXT_LOSS_ONLY,
    VISION_LANGUAGE,
    attention_biases,
    attention_temperature,
    attention_weights,
    check_linears,
    check_mlp_biases,
    experts_modules,
    fused_projections,
    global_nope,
    hf_attention_functions,
    hf_renames,
    layer_options,
    layer_type,
    qk_norm_names,
    sliding_window,
)
from coda._hf_forward import MaskHint, base_forward, causal_lm_forward, wrap_forward, wrap_stack
from coda._hf_fused import from_hf_keys as _from_hf_keys  # (the names the hooks of layers
from coda._hf_fused import to_hf_keys as _to_hf_keys  # pickled before session 81 refer to)
from coda._hf_rope import mrope_sections, rope_arguments, rope_pairs, typed_rotary
from coda._hf_rope import tag_mrope_rows as _tag_mrope_rows  # (pickled models' name for it)
from coda.autograd import LM_HEAD_METHODS
from coda.nn import DecoderLayer
from coda.nn.activation import XIELU


class CodaLlamaDecoderLayer(DecoderLayer, GradientCheckpointingLayer):
    """A ``LlamaDecoderLayer`` (or Mistral's, Qwen2's, Qwen3's) replaced by coda's layer: same call
    signature and result, the weights in coda's layouts, HF's attention module kept (without
    its projections and norms) for the attention function's parameters (scaling, GQA groups,
    layer index, dropout, sliding window). A ``GradientCheckpointingLayer`` as HF's layers are,
    so ``model.gradient_checkpointing_enable()`` (the Trainer's ``gradient_checkpointing``)
    checkpoints it as it would the layer it replaced, before or after the patch."""

    hf_keys = True  # ``state_dict()`` in HF's keys and layouts (``coda_keys`` turns it off)
    # set per layer when made; these defaults serve layers pickled before sessions 64, 65,
    # 73 and 74 (``fused`` True then: Phi-3's two fused projections, before ``hf_form``)
    fused, use_rope, rope_scale, hf_form, rotated_dims = False, True, 1.0, None, None
    turns_back = False  # (NanoChat's RoPE, by -theta: ``rope_pairs`` "half_negative")

    def __init__(
        self, hf_layer, config, inv_freq, mask_hint, rope_scale=1.0, long_rope=(None,) * 2,
        mrope=None, rotated=None,
    ):  # fmt: skip
        attn = hf_layer.self_attn
        where = f"layers.{attn.layer_idx}"
        check_linears(hf_layer, where)
        qk_norm = qk_norm_names(attn)  # (Qwen3's names, or Hunyuan's)
        fused = fused_projections(hf_layer, where)
        taken = attention_weights(attn, fused, qk_norm, where)  # (checked before any change)
        check_mlp_biases(hf_layer, where)
        qkv_bias, o_bias = attention_biases(attn, where)
        if qk_norm and qkv_bias:
            raise v.CodaInputError(
                f"apply_coda: {where}: q, k, v biases with Qwen3's QK-norm (attention_bias=True)"
                " are not supported (qk_norm and qkv_bias together)"
            )
        experts = experts_modules(hf_layer)  # (a mixture of experts: the model's own, after
        p = next(hf_layer.parameters())  # its own norm; ``ffn_sublayer``)
        # SmolLM3's NoPE layers (``use_rope`` 0) and EXAONE 4's global ones: RoPE at angle 0,
        # the identity, exactly
        use_rope = bool(getattr(attn, "use_rope", True)) and not global_nope(attn)
        inv_freq = inv_freq if use_rope else torch.zeros_like(inv_freq)
        long_inv_freq, long_after = long_rope if use_rope else (None, None)
        pairs = rope_pairs(hf_layer)
        if pairs == "half_negative":  # (NanoChat's turn by -theta: the frequencies negated)
            inv_freq = -inv_freq
            long_inv_freq = None if long_inv_freq is None else -long_inv_freq
        super().__init__(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            0 if experts else config.intermediate_size,
            head_dim=attn.head_dim,
            eps=config.rms_norm_eps,
            device=p.device,
            dtype=p.dtype,
            inv_freq=inv_freq,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            long_inv_freq=long_inv_freq,
            long_after=long_after,
            mrope_sections=mrope,
            mlp=getattr(hf_layer, experts[0]) if experts else None,
            **layer_options(hf_layer, config),  # (GeGLU, the norms' forms, QK-norm's span)
        )
        if experts:  # (under the model's names: its state-dict keys)
            self.post_attention_layernorm = hf_layer.post_attention_layernorm
            self.hf_experts = experts
            if experts != ("mlp",):
                del self.mlp
                for name in experts:
                    setattr(self, name, getattr(hf_layer, name))
        # its state dict's form beyond Llama's keys (``coda._hf_fused``): Phi-3's and GLM's
        # fused projections, GLM-4's norm names, GLM's q and k rows in adjacent-pair order,
        # Phi-4-mini's rotate-half pairs of part of each head
        heads = (config.num_attention_heads, config.num_key_value_heads, attn.head_dim)
        adjacent = pairs == "adjacent"
        partial = 0 if adjacent or rotated in (None, attn.head_dim) else rotated
        self.hf_form = _hf_fused.Form(
            fused,
            hf_renames(hf_layer),  # (GLM-4's norms, Hunyuan's QK-norm)
            heads if adjacent or partial else None,
            partial,
        )
        self.use_rope, self.turns_back = use_rope, pairs == "half_negative"
        # YaRN's constant factor on cos and sin, folded into the attention's scale (a NoPE
        # layer rotates nothing, so scales nothing)
        self.rope_scale = float(rope_scale) if use_rope else 1.0
        self.rotated_dims = rotated  # (a partial RoPE's: fewer than head_dim)
        self.load_hf_state_dict(hf_layer.state_dict())
        self._keep_frozen(hf_layer, where)
        if self.activation == "xielu":  # (Apertus's learned numbers: HF's module's, copied)
            self.mlp["act_fn"] = XIELU.adopt(hf_layer.mlp.act_fn)
        for name in taken:
            delattr(attn, name)  # the weights live in w_qkv / w_o / q_norm / k_norm now
        self.self_attn = attn
        self.mask_hint = mask_hint  # the model's one ``MaskHint``, shared by its layers
        if getattr(hf_layer, "gradient_checkpointing", False):  # enabled before the patch
            self.gradient_checkpointing = True
            self._gradient_checkpointing_func = hf_layer._gradient_checkpointing_func
        self.register_state_dict_post_hook(_to_hf_keys)
        self.register_load_state_dict_pre_hook(_from_hf_keys)

    def extra_repr(self) -> str:  # (printed under HF's class name: say whose layer it is)
        return f"coda, {super().extra_repr()}"

    hf_experts = ("mlp",)

    def ffn_sublayer(self, x1, kernel_path=False):  # (the norm, then the model's experts)
        norm = self.post_attention_layernorm  # (its form and eps the layer's: ``layer_options``)
        h = self.rows_norm(x1, norm.weight) if kernel_path and norm.weight is not None else norm(x1)
        y, *more = [m(h) for m in (getattr(self, n) for n in self.hf_experts) if m is not None]
        for extra in more:  # (Granite-MoE-Shared's shared MLP, added as its layer adds it)
            y = y + extra
        return y

    # HF's keys are Llama's but for the layer's form (``hf_form``), converted exactly
    def _form(self) -> _hf_fused.Form:
        if self.hf_form is not None:
            return self.hf_form
        return _hf_fused.Form(tuple(_hf_fused.FUSED) if self.fused else ())  # (pickled)

    def hf_state_dict(self, prefix: str = "", grad: bool = False) -> dict:
        out, form = super().hf_state_dict(prefix, grad), self._form()
        return _hf_fused.to_model(out, prefix, form) if form else out

    def hf_shapes(self, prefix: str = "") -> dict:
        shapes, form = self._llama_shapes(prefix), self._form()
        return _hf_fused.shapes_to_model(shapes, prefix, form) if form else shapes

    def params_from_hf(self, sd: dict, prefix: str = "") -> dict:
        form = self._form()
        if form:  # (checked in HF's keys first: an error names the key given)
            v.check_state_dict(sd, self.hf_shapes(prefix))
            sd = _hf_fused.from_model(sd, self._llama_shapes(prefix), prefix, form)
        return super().params_from_hf(sd, prefix)

    def _keep_frozen(self, hf_layer, where: str) -> None:
        """A frozen HF weight (``requires_grad=False``: partial fine-tuning) stays frozen in
        the coda weight it becomes; a coda weight fused from several HF ones (q, k, v into
        ``w_qkv``; gate and up into ``w_il``) cannot be partly frozen, and says so."""
        hf = dict(hf_layer.named_parameters())
        for name in self._hf_weights():
            keys = self._hf_keys()[name]
            keys = _hf_fused.model_keys(keys, self._form())
            flags = {hf[k].requires_grad for k in keys}
            if len(flags) > 1:
                raise v.CodaInputError(
                    f"apply_coda: {where}: {', '.join(keys)} become one coda weight ({name}) "
                    "and cannot be partly frozen: set requires_grad alike on all of them"
                )
            getattr(self, name).requires_grad_(flags.pop())

    def _plain_causal(self, attention_mask) -> bool:
        """Whether ``attention_mask`` is the plain causal one made under a capture: the model's
        hint says so while its forward runs, and the verdict rides on the mask tensor itself
        for an activation-checkpointing recompute, which runs in the backward with the same
        mask after the forward has returned."""
        if self.mask_hint.causal:
            if isinstance(attention_mask, torch.Tensor) and not torch.compiler.is_compiling():
                attention_mask.coda_plain_causal = True
            return True
        return (
            isinstance(attention_mask, torch.Tensor)
            and not torch.compiler.is_compiling()
            and getattr(attention_mask, "coda_plain_causal", False)
        )

    def _hf_attention(self, attention_mask, cache, kwargs):
        """The model's configured attention function (read from its config on every call, so
        ``set_attn_implementation`` after patching is honored) as coda's attention callable."""
        module = self.self_attn
        functions, eager = hf_attention_functions(type(module))
        implementation = module.config._attn_implementation
        iface = functions.get_interface(implementation, eager)
        window = sliding_window(module)
        if type(module).__name__ in SOFTCAP_ATTENTION:  # (Gemma 2's: as its forward calls)
            window["softcap"] = module.attn_logit_softcapping
        if (
            self._plain_causal(attention_mask)
            and implementation == "sdpa"
            and window.get("sliding_window") is None
        ):
            attention_mask = None  # the plain causal mask: SDPA's is_causal, as eagerly

        # c^2 folds into the scale (below) for every dimension of q . k, but c scales only the
        # rotated ones: a partial RoPE's others (last in coda's order) take 1 / c^2 back on q
        rotated = self.rotated_dims or module.head_dim
        unscaled = self.rope_scale != 1.0 and rotated < module.head_dim
        tempered = attention_temperature(module)  # (Ministral 3's q times a temperature)

        def attention(q, k, v):
            if unscaled:
                q = torch.cat([q[..., :rotated], q[..., rotated:] / self.rope_scale**2], dim=-1)
            q = q if tempered is None else tempered(kwargs["position_ids"], q)
            if cache is not None:
                k, v = cache.update(k, v, module.layer_idx, kwargs=kwargs)  # as LlamaAttention
            out, _ = iface(
                module,
                q,
                k,
                v,
                attention_mask,
                dropout=0.0 if not module.training else module.attention_dropout,
                scaling=module.scaling * self.rope_scale**2,  # (HF's, but for YaRN's c^2)
                **window,
                **kwargs,
            )
            return out.transpose(1, 2)  # HF returns (batch, seq, heads, hd)

        return attention

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=False,
        position_embeddings=None,
        **kwargs,
    ):
        # the KV cache is ``past_key_values`` up to transformers 5.2x, ``cache`` after
        cache = past_key_values if past_key_values is not None else kwargs.pop("cache", None)
        # the attention function gets what HF's layer hands it: flash attention finds packed
        # documents (padding-free batches) from ``position_ids`` alone
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
        attention = self._hf_attention(attention_mask, cache, kwargs)
        positions = position_ids
        if self._mrope is not None:  # (the rows HF's rotary module took: ``_tag_mrope_rows``)
            cos = position_embeddings[0] if position_embeddings is not None else None
            positions = getattr(cos, "coda_mrope_positions", None)
            if positions is None:
                raise v.CodaInputError(
                    "apply_coda: a multimodal-RoPE layer called without its model's position "
                    "embeddings (the text model's rotary module tags them with their positions)"
                )
        partial = (
            position_embeddings is not None and position_embeddings[0].shape[-1] < self.head_dim
        )
        if self.turns_back and position_embeddings is not None:  # HF's tables turn by theta,
            cos, sin = position_embeddings  # its rotate_half by -theta: sin(-theta) = -sin
            position_embeddings = (cos, -sin)
        if not self.use_rope or self.rope_scale != 1.0 or partial:  # both paths then rotate by
            # the layer's own frequencies (zero in a NoPE layer and past a partial RoPE's pairs,
            # GLM's), unscaled (YaRN's c: above)
            position_embeddings = None
        return super().forward(hidden_states, positions, position_embeddings, attention)


@functools.cache
def patched_class(hf_class: type) -> type:
    """The class of a layer that replaced an ``hf_class`` layer: coda's layer first (its
    ``forward`` and state-dict hooks), then ``hf_class``, under ``hf_class``'s name. So what
    finds decoder layers by class or by class name finds patched ones too: transformers'
    ``output_hidden_states`` hooks (``isinstance`` on the layer class), the Trainer's and
    accelerate's FSDP auto-wrap (a ``_no_split_modules`` name looked up on the modules). One
    class per ``hf_class``; made at run time, it is no module attribute that pickle could
    name, so a pickled patched layer names ``hf_class`` instead (``torch.save(model)``)."""
    return type(
        hf_class.__name__,
        (CodaLlamaDecoderLayer, hf_class),
        {
            "__module__": __name__,
            "__doc__": f"coda's layer in place of a {hf_class.__name__}.",
            "__reduce_ex__": _reduce_patched_layer,
            "coda_hf_class": hf_class,
        },
    )


def _reduce_patched_layer(layer, protocol):
    if type(layer) is not patched_class(layer.coda_hf_class):  # (a subclass: FSDP2's)
        return super(CodaLlamaDecoderLayer, layer).__reduce_ex__(protocol)
    return _new_patched_layer, (layer.coda_hf_class,), layer.__dict__


def _new_patched_layer(hf_class: type):
    return object.__new__(patched_class(hf_class))


@contextlib.contextmanager
def coda_keys(model):
    """Within it, the patched layers' ``state_dict()`` uses coda's own parameter names and
    layouts (``w_qkv``, ``attention_norm``, ...) instead of HF's (``load_state_dict`` takes
    either, always). For ``torch.distributed.checkpoint`` (``get_model_state_dict``,
    ``set_model_state_dict``, ``dcp.save`` / ``dcp.load``: sharded FSDP2 checkpoints), which
    maps every state-dict key to a module attribute path and so cannot take HF's keys for
    fused weights; save and load such checkpoints inside it, and export with
    ``save_pretrained`` outside it."""
    before = {m: m.hf_keys for m in model.modules() if isinstance(m, CodaLlamaDecoderLayer)}
    for m in before:
        m.hf_keys = False
    try:
        yield model
    finally:
        for m, flag in before.items():
            m.hf_keys = flag


# the names a patched model pickled before session 64 (``torch.save(model)``) refers to, from
# when the wrapped forwards lived here
_PatchedForward, _MaskHint = hf_forward._PatchedForward, MaskHint
_base_forward, _causal_lm_forward = base_forward, causal_lm_forward


def apply_coda(model, *, method: str = "auto", embedding: bool = True, layers: bool = True):
    """Patch a transformers Llama, Mistral, Qwen2, Qwen3, Phi-3, SmolLM3, Ministral, CWM,
    Seed-OSS, Gemma, Gemma 2 or Gemma 3 (text) model
    (``SUPPORTED``, and their task models of ``TASK_HEADS``) in place; returns it.

    ``method``: the LM-head loss program (``coda.nn.LMHeadLoss``): "auto" (the default: CE-S,
    "scaled_exp", the fastest on the H200, where the vocabulary is a multiple of 128, else
    "recompute"), "scaled_exp", "recompute" (least memory) or "chunked". Each decoder layer
    becomes a ``CodaLlamaDecoderLayer``. ``embedding``: the token embedding (a plain
    ``nn.Embedding``) becomes a ``coda.nn.Embedding`` in place, the same module and parameter
    (``coda.nn.Embedding.adopt``). ``layers=False``: the decoder layers stay the model's own
    modules, unchecked and unpatched (adapters such as PEFT's LoRA in them, applied before or
    after, train as they would), and only the training call's loss (final norm, LM head,
    cross-entropy: no logits) and the embedding's backward are coda's; so it is for the
    models of ``LOSS_ONLY`` (mixture-of-experts models, their router's load-balancing loss
    added as their forward adds it; Granite's, their ``logits_scaling`` folded into the final
    norm's gain; OLMo's), which take only ``layers=False``; and for the vision-language
    models of ``VISION_LANGUAGE`` whose text model is not a supported family's (Mllama's,
    the MoE ones). (Gemma's final norm's gain 1 + w stays in fp32 either way.) A PEFT
    model (one with ``get_base_model()``) has the transformers model it wraps patched, and
    is returned."""
    name = type(model).__name__
    if name in VISION_LANGUAGE:
        _apply_vision_language(model, name, method, embedding, layers)
        return model
    stack = _task_model_stack(model, name)
    if stack is not None:  # a task head over a supported stack: the stack patched, the head HF's
        apply_coda(stack, method=method, embedding=embedding, layers=layers)
        return model
    known = name in SUPPORTED or name in LOSS_ONLY
    if not known and callable(getattr(model, "get_base_model", None)):
        # a PEFT model: the transformers model it wraps is patched, the wrapper returned
        apply_coda(model.get_base_model(), method=method, embedding=embedding, layers=layers)
        return model
    if name in LOSS_ONLY and layers:
        raise v.CodaInputError(
            f"apply_coda: {name}'s decoder layers ({LOSS_ONLY[name]}) are not coda's: "
            "apply_coda(model, layers=False) makes its training loss coda's (torch.compile on "
            "model.model then fuses HF's layers: docs/HUGGINGFACE.md)"
        )
    if not known:
        raise v.CodaInputError(
            f"apply_coda: {name} is not supported ({', '.join(SUPPORTED)}; the loss alone, "
            f"layers=False: {', '.join(LOSS_ONLY)}; vision-language: "
            f"{', '.join(VISION_LANGUAGE)})"
        )
    v.check_choice("method", method, LM_HEAD_METHODS)
    causal = name.endswith("ForCausalLM")
    if causal:  # (a decoder stack alone, or under a task head, has no logits to cap)
        _check_softcapping(model.config, method if name in hf_forward.LOGITS_SOFTCAPPED else None)
    base = model.model if causal else model
    _patch_stack(
        model, base, model.config, causal_lm_forward if causal else None, method, embedding, layers
    )
    return model


def _patch_stack(model, base, config, forward, method, embedding, layers) -> None:
    """What both kinds of model share: their decoder stack ``base``'s layers (``layers``),
    its token embedding's backward (``embedding``; left as it is where coda's does not cover
    it), and with ``forward`` (the model's training call, wrapped once) the loss, whose final
    norm is checked now (a norm coda's loss does not take: refused here, not at the call)."""
    if forward is not None:
        hf_forward.check_final_norm(base.norm)
    if layers:
        _patch_layers(base, config)
    if forward is not None:  # (the training call's loss applies the final norm: ``base_forward``)
        wrap_stack(base)
    if embedding:
        hf_forward.adopt_embedding(base.embed_tokens)
    if forward is not None and not getattr(model, "coda_method", None):
        wrap_forward(model, forward)
    model.coda_method = method


def _check_softcapping(config, method: str | None = None) -> None:
    """A model's ``final_logit_softcapping`` (Gemma 2's: c tanh(logits / c) before the loss):
    taken by coda's loss (``softcap``) where ``method`` is given (a model whose forward
    applies it, ``_hf_forward.LOGITS_SOFTCAPPED``), else refused."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return
    if method is None:
        raise v.CodaInputError(
            f"apply_coda: final_logit_softcapping={cap} (the logits soft-capped before the "
            "loss) is not supported for this model"
        )
    try:
        v.check_softcap(cap, 0.0, method)
    except v.CodaInputError as e:
        raise v.CodaInputError(f"apply_coda: final_logit_softcapping={cap}: {e}") from None


def _apply_vision_language(model, name: str, method: str, embedding: bool, layers: bool):
    """``apply_coda`` for a model of ``VISION_LANGUAGE``: its text model's decoder layers
    (where that text model is a supported family's), the training call's loss and the token
    embedding's backward; the vision encoder and the projector stay HF's."""
    text = hf_forward.text_model(model)
    kind = type(text).__name__
    if layers and (kind in TEXT_LOSS_ONLY or kind not in SUPPORTED and kind not in MROPE_TEXT):
        why = TEXT_LOSS_ONLY.get(kind, "not a supported family's")
        raise v.CodaInputError(
            f"apply_coda: {name}'s text model {kind}: its decoder layers ({why}) are not "
            "coda's: apply_coda(model, layers=False) makes its training loss coda's"
        )
    v.check_choice("method", method, LM_HEAD_METHODS)
    _check_softcapping(model.config.get_text_config())
    forward = hf_forward.vision_language_forward
    _patch_stack(model, text, text.config, forward, method, embedding, layers)


def _task_model_stack(model, name: str):
    """The decoder stack of a task model of a supported family (``LlamaForSequenceClassification``,
    ..., ``TASK_HEADS``): its ``base_model_prefix`` attribute (``model``; ``transformer`` for
    some QA models), else None."""
    for head in TASK_HEADS:
        if name.endswith(head) and name.removesuffix(head) + "Model" in SUPPORTED:
            return getattr(model, model.base_model_prefix)
    return None


def _patch_layers(base, config) -> None:
    """``apply_coda``'s layers: every decoder layer of ``base`` (an HF decoder stack) that is
    not one yet becomes a ``CodaLlamaDecoderLayer``, after the config's checks (for each layer
    type's RoPE where it has one per type: Gemma 3's)."""
    per_type = isinstance(base.rotary_emb.rope_type, dict)  # (Gemma 3's RoPE per layer type)
    kinds = set(config.layer_types) if per_type else {None}
    # layer type (None: the model's one RoPE) -> its RoPE's arguments, checked before any change
    ropes = {k: rope_arguments(typed_rotary(base.rotary_emb, config, k), config) for k in kinds}
    wrap_stack(base, layers=True)
    mrope = mrope_sections(base.rotary_emb)
    if mrope is not None and not getattr(base.rotary_emb, "coda_tags_rows", False):
        base.rotary_emb.register_forward_hook(_tag_mrope_rows, with_kwargs=True)
        base.rotary_emb.coda_tags_rows = True
    for layer in base.layers:  # (what a layer's patch would refuse, before any layer changes)
        if not isinstance(layer, CodaLlamaDecoderLayer):
            where, attn = f"layers.{layer.self_attn.layer_idx}", layer.self_attn
            check_linears(layer, where)
            hf_forward.check_accelerate_hook(layer, where)  # (an offloaded layer: refused)
            attention_weights(attn, fused_projections(layer, where), qk_norm_names(attn), where)
    replaced = False
    for i, layer in enumerate(base.layers):
        if not isinstance(layer, CodaLlamaDecoderLayer):
            kind = layer_type(layer, config) if per_type else None
            inv_freq, long_rope, rope_scale, rotated = ropes[kind]
            ours = CodaLlamaDecoderLayer(
                layer, config, inv_freq, base.coda_mask_hint, rope_scale, long_rope, mrope, rotated
            )
            ours.__class__ = patched_class(type(layer))  # (made first: HF's __init__ not run)
            base.layers[i] = ours
            hf_forward.rehook(ours, getattr(layer, "_hf_hook", None))
            replaced = True
    if replaced:  # transformers hooks the layers for ``output_hidden_states`` once, at the
        # first call asking for them: the patched layers are new modules, to be hooked anew
        base.__dict__.pop("_output_capturing_hooks_installed", None)


def hf_gradients(model) -> dict:
    """Every parameter's gradient under its HF state-dict key and layout (patched layers'
    gradients converted from coda's layouts exactly): compare with an unpatched model's."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, CodaLlamaDecoderLayer):
            out.update(mod.hf_state_dict(f"{name}.", grad=True))
    for name, p in model.named_parameters():
        if not isinstance(_owner(model, name), CodaLlamaDecoderLayer) and p.grad is not None:
            out[name] = p.grad
    return out


def _owner(model, param_name: str):
    return model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
