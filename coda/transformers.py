"""Hugging Face models in one call: ``apply_coda(model)`` patches a transformers Llama, Mistral,
Qwen2 or Qwen3 model in place so its decoder layers run coda's kernel sequence and, in a training
step (labels given, autograd recording), ``model(input_ids, labels=...)`` returns the loss
through coda's LM-head loss, logits never stored (honoring the loss arguments HF's own loss
reads from the call: ``num_items_in_batch``, ``shift_labels``, ``ignore_index``); under
``torch.no_grad`` (an evaluation loop reading logits for its metrics) it returns HF's logits
and loss, and ``skip_logits=`` picks either for a call.

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
the meta device can be patched before it is loaded. Anything not supported (another
architecture, a config feature, an adapter or quantized linear in place of a projection,
``output_attentions``) raises ``CodaInputError`` naming it: nothing is silently left out.

Under a CUDA-graph capture (``coda.nn.GraphedStep``) transformers 5.17 cannot tell the
capture from a trace and hands SDPA its causal mask as a full (batch, 1, seq, seq) tensor in
place of ``is_causal``, which costs SDPA its causal block skipping: a captured 1B step ran
0.75x its eager one (benchmarks/NOTES.md, session 19). Where that mask is provably the plain
causal one (the caller gave no attention mask, positions, cache or cache positions, and the
layer has no sliding window), the patched model's sdpa layers pass no mask, as the eager step
does.

Supported: transformers 5.x ``LlamaForCausalLM`` / ``LlamaModel``, ``MistralForCausalLM`` /
``MistralModel``, ``Qwen2ForCausalLM`` / ``Qwen2Model`` and ``Qwen3ForCausalLM`` /
``Qwen3Model`` (silu MLP, no biases but Qwen2's on q, k and v and Llama's
``attention_bias=True`` ones on q, k, v and o, RoPE "default", "linear" or
"llama3": a fixed set of inverse frequencies, taken from the model; Qwen3's per-head QK-norm
and Qwen2's q, k, v biases run in the QKV GEMM's epilogue, ``coda.kernels.qk_norm`` and
``coda.kernels.gemm_rope``; Mistral's, Qwen2's and Qwen3's sliding windows, when configured,
keep the model's own masks and window).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from transformers.modeling_layers import GradientCheckpointingLayer

from coda import _validate as v
from coda.autograd import LM_HEAD_METHODS
from coda.env import host_cache
from coda.nn import DecoderLayer, Embedding, lm_head_loss
from coda.nn.layer import HF_KEYS

SUPPORTED = (
    "LlamaForCausalLM",
    "LlamaModel",
    "MistralForCausalLM",
    "MistralModel",
    "Qwen2ForCausalLM",
    "Qwen2Model",
    "Qwen3ForCausalLM",
    "Qwen3Model",
)
# RoPE types whose angles are positions times fixed inverse frequencies (the rotary module's
# ``inv_freq``), unscaled: "dynamic" changes them with the sequence length, "yarn" and
# "longrope" scale cos and sin too
ROPE_TYPES = ("default", "linear", "llama3")


def _check_config(config, rotary) -> None:
    rules = [
        (getattr(config, "hidden_act", "silu") == "silu", f"hidden_act={config.hidden_act!r}"),
        (not getattr(config, "mlp_bias", False), "mlp_bias=True"),
        (getattr(config, "pretraining_tp", 1) == 1, "pretraining_tp != 1"),
        (rotary.rope_type in ROPE_TYPES, f"rope_type={rotary.rope_type!r}"),
        (float(rotary.attention_scaling) == 1.0, "RoPE attention_scaling != 1"),
    ]
    for ok, what in rules:
        if not ok:
            raise v.CodaInputError(f"apply_coda: {what} is not supported")


class CodaLlamaDecoderLayer(DecoderLayer, GradientCheckpointingLayer):
    """A ``LlamaDecoderLayer`` (or Mistral's, Qwen2's, Qwen3's) replaced by coda's layer: same call
    signature and result, the weights in coda's layouts, HF's attention module kept (without
    its projections and norms) for the attention function's parameters (scaling, GQA groups,
    layer index, dropout, sliding window). A ``GradientCheckpointingLayer`` as HF's layers are,
    so ``model.gradient_checkpointing_enable()`` (the Trainer's ``gradient_checkpointing``)
    checkpoints it as it would the layer it replaced, before or after the patch."""

    hf_keys = True  # ``state_dict()`` in HF's keys and layouts (``coda_keys`` turns it off)

    def __init__(self, hf_layer, config, inv_freq, mask_hint):
        attn = hf_layer.self_attn
        where = f"layers.{attn.layer_idx}"
        _check_linears(hf_layer, where)
        qk_norm = hasattr(attn, "q_norm")
        qkv_bias, o_bias = _attention_biases(attn, where)
        if qk_norm and qkv_bias:
            raise v.CodaInputError(
                f"apply_coda: {where}: q, k, v biases with Qwen3's QK-norm (attention_bias=True)"
                " are not supported (qk_norm and qkv_bias together)"
            )
        p = next(hf_layer.parameters())
        super().__init__(
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.intermediate_size,
            head_dim=attn.head_dim,
            eps=config.rms_norm_eps,
            device=p.device,
            dtype=p.dtype,
            inv_freq=inv_freq,
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
        )
        if qk_norm and attn.q_norm.variance_epsilon != config.rms_norm_eps:
            raise v.CodaInputError("apply_coda: a QK-norm eps other than rms_norm_eps")
        self.load_hf_state_dict(hf_layer.state_dict())
        self._keep_frozen(hf_layer, where)
        names = ("q_proj", "k_proj", "v_proj", "o_proj") + (("q_norm", "k_norm") if qk_norm else ())
        for name in names:
            delattr(attn, name)  # the weights live in w_qkv / w_o / q_norm / k_norm now
        self.self_attn = attn
        self.mask_hint = mask_hint  # the model's one ``_MaskHint``, shared by its layers
        if getattr(hf_layer, "gradient_checkpointing", False):  # enabled before the patch
            self.gradient_checkpointing = True
            self._gradient_checkpointing_func = hf_layer._gradient_checkpointing_func
        self.register_state_dict_post_hook(_to_hf_keys)
        self.register_load_state_dict_pre_hook(_from_hf_keys)

    def extra_repr(self) -> str:  # (printed under HF's class name: say whose layer it is)
        return f"coda, {super().extra_repr()}"

    def _keep_frozen(self, hf_layer, where: str) -> None:
        """A frozen HF weight (``requires_grad=False``: partial fine-tuning) stays frozen in
        the coda weight it becomes; a coda weight fused from several HF ones (q, k, v into
        ``w_qkv``; gate and up into ``w_il``) cannot be partly frozen, and says so."""
        hf = dict(hf_layer.named_parameters())
        for name in self._hf_weights():
            keys = HF_KEYS[name]
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
            if isinstance(attention_mask, torch.Tensor):
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
        functions, eager = _hf_attention_functions()
        module = self.self_attn
        implementation = module.config._attn_implementation
        iface = functions.get_interface(implementation, eager)
        window = _sliding_window(module)
        if (
            self._plain_causal(attention_mask)
            and implementation == "sdpa"
            and window.get("sliding_window") is None
        ):
            attention_mask = None  # the plain causal mask: SDPA's is_causal, as eagerly

        def attention(q, k, v):
            if cache is not None:
                k, v = cache.update(k, v, module.layer_idx, kwargs=kwargs)  # as LlamaAttention
            out, _ = iface(
                module,
                q,
                k,
                v,
                attention_mask,
                dropout=0.0 if not module.training else module.attention_dropout,
                scaling=module.scaling,
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
        attention = self._hf_attention(attention_mask, cache, kwargs)
        return super().forward(hidden_states, position_ids, position_embeddings, attention)


def _check_linears(hf_layer, where: str) -> None:
    """Every projection of an HF layer is a plain ``nn.Linear`` (what coda fuses)."""
    modules = dict.fromkeys(k.rsplit(".", 1)[0] for keys in HF_KEYS.values() for k in keys)
    for name in (m for m in modules if m.endswith("_proj")):
        module = hf_layer.get_submodule(name)
        if type(module) is not torch.nn.Linear:
            raise v.CodaInputError(
                f"apply_coda: {where}.{name} is a {type(module).__name__}, not a plain "
                "torch.nn.Linear (adapters such as LoRA and quantized or fp8 linears are not "
                "supported)"
            )


def _attention_biases(attention, where: str) -> tuple[bool, bool]:
    """(whether the q, k and v projections have biases, whether o_proj has one): Qwen2's are
    on q, k and v, Llama's ``attention_bias=True`` puts them on all four; q, k and v have
    them all or none."""
    has = [getattr(attention, n).bias is not None for n in ("q_proj", "k_proj", "v_proj")]
    if len(set(has)) > 1:
        raise v.CodaInputError(
            f"apply_coda: {where}: biases on some of q_proj, k_proj and v_proj; supported on "
            "all three (Qwen2's; with o_proj's too, Llama's attention_bias=True) or none"
        )
    return has[0], attention.o_proj.bias is not None


def _sliding_window(attention) -> dict:
    """The ``sliding_window`` argument an HF attention module passes its attention function:
    its own (Qwen2, Qwen3: per layer, None on full-attention layers), the model's (Mistral), or none
    (Llama)."""
    if hasattr(attention, "sliding_window"):
        return {"sliding_window": attention.sliding_window}
    if hasattr(attention.config, "sliding_window"):
        return {"sliding_window": attention.config.sliding_window}
    return {}


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


def _inverse_frequencies(rotary, config) -> torch.Tensor:
    """The model's RoPE inverse frequencies (float64, CPU): its buffer, or for a model made on
    the meta device (no values yet; sharded before it is loaded, as FSDP2 recipes do) the
    buffer of the same rotary module made afresh from the config on the CPU."""
    if rotary.inv_freq.device.type == "meta":
        with torch.device("cpu"):
            rotary = type(rotary)(config)
    return rotary.inv_freq.detach().to("cpu", torch.float64)


@host_cache()
def _hf_attention_functions():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return ALL_ATTENTION_FUNCTIONS, eager_attention_forward


@contextlib.contextmanager
def coda_keys(model):
    """Within it, the patched layers' ``state_dict()`` uses coda's own parameter names and
    layouts (``w_qkv``, ``attention_norm``, ...) instead of HF's (``load_state_dict`` takes
    either, always). For ``torch.distributed.checkpoint`` (``get_model_state_dict``,
    ``set_model_state_dict``, ``dcp.save`` / ``dcp.load``: sharded FSDP2 checkpoints), which
    maps every state-dict key to a module attribute path and so cannot take HF's keys for
    fused weights; save and load such checkpoints inside it, and export with
    ``save_pretrained`` outside it."""
    layers = [m for m in model.modules() if isinstance(m, CodaLlamaDecoderLayer)]
    before = [m.hf_keys for m in layers]
    for m in layers:
        m.hf_keys = False
    try:
        yield model
    finally:
        for m, flag in zip(layers, before):
            m.hf_keys = flag


def _to_hf_keys(module, state_dict, prefix, local_metadata):
    if not module.hf_keys:
        return
    for name in module._parameters:  # coda's own parameters, under HF's keys instead
        state_dict.pop(prefix + name, None)
    state_dict.update(module.hf_state_dict(prefix))


def _from_hf_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    keys = [prefix + k for k in module.hf_shapes()]
    if not all(k in state_dict for k in keys):
        return  # already coda keys, or missing ones: load_state_dict reports them
    hf = {k: state_dict.pop(k) for k in keys}
    state_dict.update({prefix + n: t for n, t in module.params_from_hf(hf, prefix).items()})


class _MaskHint:
    """Shared by a patched model's layers: ``causal`` is True while a call whose attention
    mask is the plain causal one runs under a CUDA-graph capture (``_plain_causal``)."""

    __slots__ = ("causal",)

    def __init__(self):
        self.causal = False


MASK_ARGUMENTS = ("attention_mask", "position_ids", "past_key_values", "cache", "cache_position")


def _plain_causal(args: tuple, kwargs: dict) -> bool:
    """Whether the mask transformers builds for this call under a capture is the plain causal
    one: a capture, and nothing given that shapes the mask (``input_ids`` or ``inputs_embeds``
    and ``labels`` only, among the mask's inputs)."""
    return (
        len(args) <= 1  # (input_ids, attention_mask, position_ids, ...) by position
        and all(kwargs.get(k) is None for k in MASK_ARGUMENTS)
        and _capturing()
    )


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (never inside a torch.compile
    trace, whose graphs are captured later, from the traced code)."""
    return (
        not torch.compiler.is_compiling()
        and torch.cuda.is_initialized()  # (no CUDA call made yet: nothing is capturing)
        and torch.cuda.is_current_stream_capturing()
    )


class _PatchedForward:
    """``module.forward`` as ``apply_coda`` wraps it: ``make(original)`` called with
    ``module``, where ``original(self, *args, **kwargs)`` runs the forward the module had:
    its class's, taken unbound (so a deep copy of the patched model runs its own weights), or
    an instance-level forward someone else set before (kept as it is, bound to its module).
    An object rather than a bound closure so that the model pickles (``torch.save(model)``)
    as (module, make, former forward) and comes back patched; it shows the class forward's
    signature, name and docs, as tools read them (the Trainer keeps the dataset columns the
    forward's signature names: it would drop ``input_ids`` for ``(*args, **kwargs)``)."""

    def __init__(self, module, make, former=None):
        self.module, self.make, self.former = module, make, former
        if former is None:
            original = type(module).forward
        else:

            def original(self, *args, **kwargs):
                return former(*args, **kwargs)

        self._forward = make(original)
        functools.update_wrapper(self, type(module).forward)
        self.__signature__ = inspect.signature(type(module).forward.__get__(module))

    def __call__(self, *args, **kwargs):
        return self._forward(self.module, *args, **kwargs)

    def __reduce__(self):
        return _PatchedForward, (self.module, self.make, self.former)


def _wrap_forward(module, make) -> None:
    module.forward = _PatchedForward(module, make, module.__dict__.get("forward"))


def _base_forward(original):
    """The decoder stack's (``LlamaModel``'s) ``forward``, with its layers' ``_MaskHint`` set
    for the call."""

    def forward(self, *args, **kwargs):
        if kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)):
            raise v.CodaInputError(
                "apply_coda: output_attentions is not supported (patched layers call the "
                "attention function directly and keep no attention weights)"
            )
        hint = self.coda_mask_hint
        hint.causal = _plain_causal(args, kwargs)
        try:
            return original(self, *args, **kwargs)
        finally:
            hint.causal = False

    return forward


def _cache_is_only_a_cost(args: tuple, kwargs: dict) -> bool:
    """Whether a training call can run without the KV cache transformers' default config
    fills in every forward (two copies of each layer's keys and values, never read in a
    training step: 2.1 ms of a 1B step, 6.4 ms of Qwen3-0.6B's, benchmarks/NOTES.md session
    22) and give exactly the unpatched model's result: the call names no cache setting and
    gives no position ids. With position ids and no attention mask, transformers looks for
    packed documents (positions restarting) only when there is no cache, and then masks
    attention at their boundaries: the cache decides the result there, so it stays."""
    if len(args) > 2:  # (input_ids, attention_mask, position_ids, ... by position)
        return False
    asked = ("use_cache", "past_key_values", "cache", "position_ids")
    return all(kwargs.get(k) is None for k in asked)


def _causal_lm_forward(original):
    """The causal LM's ``forward``: with labels, while autograd records (a training step), the
    loss through coda's LM-head loss (the final norm inside it), no logits and, where that
    changes nothing else (``_cache_is_only_a_cost``), no KV cache, in HF's output type;
    otherwise the model's own forward (logits, and with labels its loss: generation, and
    evaluation loops that compute metrics from the logits under ``torch.no_grad``).
    ``skip_logits`` (True or False) overrides that choice for a call."""

    def forward(self, *args, labels=None, skip_logits=None, **kwargs):
        if labels is None:
            return original(self, *args, **kwargs)
        if not (torch.is_grad_enabled() if skip_logits is None else skip_logits):
            return original(self, *args, labels=labels, **kwargs)
        if len(args) > 5:  # (the model's own leading positional parameters)
            raise v.CodaInputError("apply_coda: pass the arguments after inputs_embeds by name")
        from transformers.modeling_outputs import CausalLMOutputWithPast

        # the loss arguments HF's ForCausalLMLoss reads from the call's keywords
        n_items = kwargs.pop("num_items_in_batch", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        shift = kwargs.pop("shift_labels", None)
        ids, embeds = args[0] if args else kwargs.get("input_ids"), kwargs.get("inputs_embeds")
        rows = ids.shape if ids is not None else None if embeds is None else embeds.shape[:-1]
        if rows is not None:  # named as the caller passed them (else the loss names target)
            v.check_target_tensor(labels, rows, "labels")
            if shift is not None:
                v.check_target_tensor(shift, rows, "shift_labels")
        if shift is None:  # as HF's ForCausalLMLoss: tokens < n predict n
            shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        kwargs.pop("logits_to_keep", None)  # no logits are formed
        if _cache_is_only_a_cost(args, kwargs):
            kwargs["use_cache"] = False
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        norm = self.model.norm
        self.model.norm = torch.nn.Identity()  # the final norm runs inside coda's loss
        try:
            out = self.model(*args, return_dict=True, **kwargs)
        finally:
            self.model.norm = norm
        hidden = out.hidden_states
        if hidden and hidden[-1] is out.last_hidden_state:  # HF's last one is after the norm
            hidden = (*hidden[:-1], norm(out.last_hidden_state))
        loss = lm_head_loss(
            out.last_hidden_state,
            norm.weight,
            self.lm_head.weight.t(),
            shift.to(out.last_hidden_state.device),
            eps=norm.variance_epsilon,
            ignore_index=ignore_index,
            reduction="mean" if n_items is None else "sum",
            method=self.coda_method,
        )
        if n_items is not None:
            loss = loss / n_items
        # the KV cache field is ``past_key_values`` up to transformers 5.2x and ``cache`` after
        # (reading or passing the old name there logs a deprecation on every first call)
        fields = CausalLMOutputWithPast.__dataclass_fields__
        cache_field = "cache" if "cache" in fields else "past_key_values"
        result = CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            hidden_states=hidden,
            attentions=out.attentions,
            **{cache_field: getattr(out, cache_field, None)},
        )
        return result if return_dict else result.to_tuple()

    return forward


def apply_coda(model, *, method: str = "auto", embedding: bool = True):
    """Patch a transformers Llama, Mistral, Qwen2 or Qwen3 model (``SUPPORTED``) in place;
    returns it.

    ``method``: the LM-head loss program (``coda.nn.LMHeadLoss``): "auto" (the default: CE-S,
    "scaled_exp", the fastest on the H200, where the vocabulary is a multiple of 128, else
    "recompute"), "scaled_exp", "recompute" (least memory) or "chunked". Each decoder layer
    becomes a ``CodaLlamaDecoderLayer``. ``embedding``: the token embedding (a plain
    ``nn.Embedding``) becomes a ``coda.nn.Embedding`` in place, the same module and parameter
    (``coda.nn.Embedding.adopt``)."""
    name = type(model).__name__
    if name not in SUPPORTED:
        raise v.CodaInputError(f"apply_coda: {name} is not supported ({', '.join(SUPPORTED)})")
    v.check_choice("method", method, LM_HEAD_METHODS)
    base = model.model if name.endswith("ForCausalLM") else model
    config = model.config
    _check_config(config, base.rotary_emb)
    inv_freq = _inverse_frequencies(base.rotary_emb, config)
    if getattr(base, "coda_mask_hint", None) is None:  # (not patched before)
        base.coda_mask_hint = _MaskHint()
        _wrap_forward(base, _base_forward)
    replaced = False
    for i, layer in enumerate(base.layers):
        if not isinstance(layer, CodaLlamaDecoderLayer):
            ours = CodaLlamaDecoderLayer(layer, config, inv_freq, base.coda_mask_hint)
            ours.__class__ = patched_class(type(layer))  # (made first: HF's __init__ not run)
            base.layers[i] = ours
            replaced = True
    if replaced:  # transformers hooks the layers for ``output_hidden_states`` once, at the
        # first call asking for them: the patched layers are new modules, to be hooked anew
        base.__dict__.pop("_output_capturing_hooks_installed", None)
    if embedding:  # left as it is where coda's backward does not cover it
        Embedding.adopt(base.embed_tokens)
    if name.endswith("ForCausalLM") and not getattr(model, "coda_method", None):
        _wrap_forward(model, _causal_lm_forward)
    model.coda_method = method
    return model


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
