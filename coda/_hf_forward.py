"""The forwards ``coda.transformers.apply_coda`` wraps: the causal LM's and the
vision-language model's (a training call's loss through coda's LM-head loss, logits never
formed; HF's own forward otherwise) and the
decoder stack's (its layers' causal-mask hint under a CUDA-graph capture), installed per
instance as picklable ``_PatchedForward`` objects. What each does and why: the docstrings
below and ``coda.transformers``'s."""

from __future__ import annotations

import copy
import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from coda import _validate as v
from coda.nn import Embedding, lm_head_loss
from coda.reference.rmsnorm import final_norm_ref


class MaskHint:
    """What a patched decoder stack's call tells its layers and its final norm (one per
    stack, ``coda_mask_hint``): ``causal`` is True while a call whose attention mask is the
    plain causal one runs under a CUDA-graph capture or a torch.compile trace
    (``_plain_causal``); ``norm_skip`` counts the final norm's calls down to the one that
    passes its input through (``final_norm_forward``: a training call whose loss applies that
    norm); ``layers`` is True where the stack's layers are coda's. Set by ``base_forward`` for
    the call's length. Defaults at class level: a hint pickled before a field existed loads
    with it."""

    causal = False
    norm_skip = 0
    layers = False


MASK_ARGUMENTS = ("attention_mask", "position_ids", "past_key_values", "cache", "cache_position")


def _plain_causal(args: tuple, kwargs: dict) -> bool:
    """Whether the mask transformers builds for this call under a capture or a trace is the
    plain causal one: a capture or a torch.compile trace (where transformers before torch 2.14
    builds a tensor mask too: ``_ignore_causal_mask_sdpa`` declines the skip while tracing),
    and nothing given that shapes the mask (``input_ids`` or ``inputs_embeds`` and ``labels``
    only, among the mask's inputs). A trace decides it from the call's arguments alone, which
    dynamo guards on: a later call with a mask input recompiles."""
    return (
        len(args) <= 1  # (input_ids, attention_mask, position_ids, ...) by position
        and all(kwargs.get(k) is None for k in MASK_ARGUMENTS)
        and (torch.compiler.is_compiling() or _capturing())
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


def wrap_forward(module, make) -> None:
    module.forward = _PatchedForward(module, make, module.__dict__.get("forward"))


def wrap_stack(base, layers: bool = False) -> MaskHint:
    """Wraps a decoder stack's ``forward`` (``base_forward``) and its final norm's
    (``final_norm_forward``) once, sharing one ``MaskHint``; ``layers``: its layers are (being
    made) coda's, as are those that share the hint already (a model pickled before the hint
    had ``layers``). Returns the hint."""
    hint = getattr(base, "coda_mask_hint", None)
    if hint is None:
        hint = base.coda_mask_hint = MaskHint()
        wrap_forward(base, base_forward)
    if getattr(base.norm, "coda_mask_hint", None) is None:
        base.norm.coda_mask_hint = hint
        wrap_forward(base.norm, final_norm_forward)
    if layers or any(getattr(m, "mask_hint", None) is hint for m in base.layers):
        hint.layers = True
    return hint


def base_forward(original):
    """The decoder stack's (``LlamaModel``'s) ``forward``, with its ``MaskHint`` set for the
    call. ``coda_final_norm=False`` (the causal LM's training call, whose loss applies the
    final norm): the stack's last call of that norm passes its input through, NanoChat's
    second (its first norms the token embeddings: ``EMBEDDINGS_NORMED``). A flag for the
    call's length rather than a module swapped in and out: the module tree never changes, and
    a graph break inside the stack (a mixture of experts' data-dependent shapes) does not meet
    a ``try`` block in the caller's frame, which Dynamo cannot resume in."""

    def forward(self, *args, coda_final_norm=True, **kwargs):
        hint = self.coda_mask_hint
        attentions = getattr(self.config, "output_attentions", False)
        if hint.layers and kwargs.get("output_attentions", attentions):
            raise v.CodaInputError(
                "apply_coda: output_attentions is not supported (patched layers call the "
                "attention function directly and keep no attention weights)"
            )
        hint.causal = _plain_causal(args, kwargs)
        normed = type(self).__name__ in EMBEDDINGS_NORMED
        hint.norm_skip = 0 if coda_final_norm else 2 if normed else 1
        try:
            return original(self, *args, **kwargs)
        finally:
            hint.causal, hint.norm_skip = False, 0

    return forward


def final_norm_forward(original):
    """The final norm's ``forward``: the call ``MaskHint.norm_skip`` counts down to passes
    its input through; every other call (outside a training call, the loss's own, a user's)
    is the norm's."""

    def forward(self, x, *args, **kwargs):
        hint = self.coda_mask_hint
        n = hint.norm_skip
        if n:
            hint.norm_skip = n - 1
            if n == 1:
                return x
        return original(self, x, *args, **kwargs)

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


def causal_lm_forward(original):
    """The causal LM's ``forward``: with labels, while autograd records (a training step), the
    loss through coda's LM-head loss (the final norm inside it), no logits and, where that
    changes nothing else (``_cache_is_only_a_cost``), no KV cache, in HF's output type;
    otherwise the model's own forward (logits, and with labels its loss: generation, and
    evaluation loops that compute metrics from the logits under ``torch.no_grad``).
    ``skip_logits`` (True or False) overrides that choice for a call. A mixture-of-experts
    model (``router_aux_loss_coef``: Mixtral, Qwen2-MoE, Qwen3-MoE) adds its router's
    load-balancing loss to coda's as its own forward adds it (``_router_loss``)."""

    def forward(self, *args, labels=None, skip_logits=None, **kwargs):
        if labels is None:
            return original(self, *args, **kwargs)
        if not (torch.is_grad_enabled() if skip_logits is None else skip_logits):
            return original(self, *args, labels=labels, **kwargs)
        if len(args) > 5:  # (the model's own leading positional parameters)
            raise v.CodaInputError("apply_coda: pass the arguments after inputs_embeds by name")
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

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
        shift = _shifted(labels, shift, ignore_index)
        kwargs.pop("logits_to_keep", None)  # no logits are formed
        if _cache_is_only_a_cost(args, kwargs):
            kwargs["use_cache"] = False
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))
        moe = hasattr(self, "router_aux_loss_coef")
        if moe:  # (as HF's MoE forward: the call's choice, else the config's)
            router = kwargs.get("output_router_logits")
            kwargs["output_router_logits"] = (
                self.config.output_router_logits if router is None else router
            )
        _check_head(self.lm_head)
        norm = self.model.norm
        if getattr(norm, "coda_mask_hint", None) is None:  # (a model pickled before session 84)
            wrap_stack(self.model)
        # the final norm runs inside coda's loss (``base_forward``)
        out = self.model(*args, return_dict=True, coda_final_norm=False, **kwargs)
        hidden = out.hidden_states
        if hidden and hidden[-1] is out.last_hidden_state:  # HF's last one is after the norm
            hidden = (*hidden[:-1], norm(out.last_hidden_state))
        name = type(self).__name__  # (another family's config may carry these)
        scaling = logits_divisor(self.config, name)
        cap = self.config.final_logit_softcapping if name in LOGITS_SOFTCAPPED else None
        rows = out.last_hidden_state
        loss = _coda_loss(
            self, self.lm_head, norm, rows, shift, n_items, ignore_index, scaling, cap
        )
        extra = {}
        if moe:
            mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
            aux = _router_loss(self, out, mask) if kwargs["output_router_logits"] else None
            if aux is not None:
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
            extra = {"aux_loss": aux, "router_logits": out.router_logits}
        output = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
        # the KV cache field is ``past_key_values`` up to transformers 5.2x and ``cache`` after
        # (reading or passing the old name there logs a deprecation on every first call)
        fields = output.__dataclass_fields__
        cache_field = "cache" if "cache" in fields else "past_key_values"
        result = output(
            loss=loss,
            logits=None,
            hidden_states=hidden,
            attentions=out.attentions,
            **{cache_field: getattr(out, cache_field, None)},
            **extra,
        )
        return result if return_dict else result.to_tuple()

    return forward


def _shifted(labels, shift_labels, ignore_index: int):
    """The targets: ``shift_labels`` as given, else as HF's ForCausalLMLoss: tokens < n
    predict n."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def _coda_loss(
    model, head, norm, rows, shift, n_items, ignore_index: int, scaling=1.0, softcap=None
):
    """coda's LM-head loss of the pre-norm ``rows`` (the final ``norm`` and the LM ``head``
    inside it, by ``model.coda_method``; the logits soft-capped by ``softcap`` where it is
    given), reduced as HF's ForCausalLMLoss reduces it: the mean over the counted targets,
    or the sum over ``n_items`` (``num_items_in_batch``) where that is given. On the head's
    device: a model placed over several GPUs (``device_map``) may hold the last layer's rows
    and the final norm elsewhere, and accelerate's hooks would move them there."""
    device = head.weight.device
    rows = rows.to(device)
    gain, eps = final_norm(norm, rows, scaling)
    loss = lm_head_loss(
        rows,
        gain.to(device),
        head.weight.t(),
        shift.to(rows.device),
        eps=eps,
        ignore_index=ignore_index,
        reduction="mean" if n_items is None else "sum",
        method=model.coda_method,
        softcap=softcap,
    )
    return loss if n_items is None else loss / n_items


class _Rows(torch.nn.Module):
    """Stands in for a module that the training call skips: passes its input through, and
    keeps it (``rows``)."""

    def forward(self, x):
        self.rows = x
        return x


def text_model(model):
    """A vision-language model's text model (``language_model``; Idefics3's and SmolVLM's
    ``text_model``)."""
    inner = model.model
    return inner.language_model if hasattr(inner, "language_model") else inner.text_model


def vision_language_forward(original):
    """A vision-language model's ``forward`` (``...ForConditionalGeneration``: a vision
    encoder, and a text model whose last hidden state goes through its final norm, the model's
    LM head and ``self.loss_function``): in a training call (as ``causal_lm_forward``
    decides) the model's own forward runs with the final norm and the LM head passing their
    input through and its loss function replaced by coda's LM-head loss of those rows (the
    final norm inside it), so the images, the masks, the positions (Qwen2-VL's multimodal
    RoPE), the loss arguments and the output type are the model's own, and no logits are
    formed (``logits`` None in the output)."""

    def forward(self, *args, labels=None, skip_logits=None, **kwargs):
        if labels is None:
            return original(self, *args, **kwargs)
        if not (torch.is_grad_enabled() if skip_logits is None else skip_logits):
            return original(self, *args, labels=labels, **kwargs)
        text, head = text_model(self), self.lm_head
        _check_head(head)
        norm = text.norm
        kwargs.pop("logits_to_keep", None)  # no logits are formed
        if _cache_is_only_a_cost(args, kwargs):
            kwargs["use_cache"] = False
        return_dict = kwargs.pop("return_dict", getattr(self.config, "return_dict", True))

        def loss_function(
            logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
            shift_labels=None, **_,
        ):  # fmt: skip
            shift = _shifted(labels, shift_labels, ignore_index)
            return _coda_loss(self, head, norm, logits, shift, num_items_in_batch, ignore_index)

        own = self.__dict__.get("_loss_function")  # (one the user set: kept)
        rows = _Rows()
        text.norm, self.lm_head, self.loss_function = rows, _Rows(), loss_function
        try:
            out = original(self, *args, labels=labels, return_dict=True, **kwargs)
        finally:
            text.norm, self.lm_head = norm, head
            if own is None:
                del self._loss_function
            else:
                self._loss_function = own
        fields = {name: getattr(out, name) for name in out.__dataclass_fields__}
        hidden = fields.get("hidden_states")
        if hidden and hidden[-1] is rows.rows:  # HF's last one is after the norm
            fields["hidden_states"] = (*hidden[:-1], norm(rows.rows))
        result = type(out)(**{**fields, "logits": None})
        return result if return_dict else result.to_tuple()

    return forward


# final norms that scale by 1 + weight, formed in fp32 (a bf16 1 + w would round w to 2^-8)
# and applied before the one rounding of the output: Gemma's, Gemma 2's and Gemma 3's, and
# Qwen3-Next's and Qwen3.5's
GEMMA_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm")
GEMMA_NORMS += ("Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "VaultGemmaRMSNorm")
# final norms that scale by their weight in fp32, rounding the output once (Llama's rounds the
# normed rows, then the product): OLMo 2's and OLMo 3's, GPT-OSS's, Helium's, Gemma 4's; their
# gain is given in fp32
FP32_SCALED_NORMS = ("Olmo2RMSNorm", "Olmo3RMSNorm", "GptOssRMSNorm", "HeliumRMSNorm")
FP32_SCALED_NORMS += ("Gemma4RMSNorm",)
# causal LMs whose forward divides the logits by their config's ``logits_scaling``: Granite's;
# and those whose forward multiplies them by it (muP's other convention): HyperCLOVAX's
LOGITS_SCALED = ("GraniteForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")
LOGITS_MULTIPLIED = ("HyperCLOVAXForCausalLM",)


def logits_divisor(config, name: str) -> float:
    """What the causal LM ``name`` divides its logits by (``final_norm``'s
    ``logits_scaling``): its config's ``logits_scaling`` (``LOGITS_SCALED``), its reciprocal
    (``LOGITS_MULTIPLIED``), or 1."""
    if name in LOGITS_SCALED:
        return float(config.logits_scaling)
    return 1.0 / float(config.logits_scaling) if name in LOGITS_MULTIPLIED else 1.0


# causal LMs whose forward soft-caps the logits by their config's ``final_logit_softcapping``
# (c tanh(l / c), where it is set): Gemma 2's, Gemma 3's, VaultGemma's, NanoChat's, Gemma 4's
LOGITS_SOFTCAPPED = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "VaultGemmaForCausalLM")
LOGITS_SOFTCAPPED += ("NanoChatForCausalLM", "Gemma4ForCausalLM")
# decoder stacks that norm their token embeddings with their final norm's module, one module
# called twice a forward, before the layers and after them: NanoChat's (``base_forward``)
EMBEDDINGS_NORMED = ("NanoChatModel",)


def norm_form(norm) -> str:
    """How the model's final RMSNorm applies its weight, as coda's loss must: "gemma" (1 +
    weight, in fp32), "fp32" (the weight in fp32, OLMo's), "llama" (Llama's, and every other
    RMSNorm's with an epsilon: ``variance_epsilon``, or ``eps`` as Llama 4's in transformers
    5.17; ``check_final_norm`` holds the verdict against the norm); another norm class is
    refused, named (``apply_coda`` asks before patching, so the training call cannot meet
    one)."""
    name = type(norm).__name__
    if name in GEMMA_NORMS:
        return "gemma"
    if name in FP32_SCALED_NORMS:
        return "fp32"
    if name.endswith("RMSNorm") and norm_epsilon(norm) is not None:
        return "llama"
    raise v.CodaInputError(f"apply_coda: a final norm {name} is not supported")


def norm_epsilon(norm):
    """A norm's epsilon, by either of the names HF's RMSNorms give it (or None)."""
    return getattr(norm, "variance_epsilon", getattr(norm, "eps", None))


def check_final_norm(norm) -> None:
    """``norm_form``'s verdict held against the norm itself: a bf16 copy of it, given a gain
    with mantissa bits to round, must compute coda's final norm (``final_norm_ref`` of
    ``final_norm``'s gain) bitwise, or the model is refused, named. The forms differ only in
    where they round, which no float64 test sees: this is what keeps a family whose norm
    rounds as another's (GPT-OSS's as OLMo's, with a Llama-like ``variance_epsilon``) from
    training on the wrong rounding. A norm on the meta device (a model to be loaded) is
    taken by its class alone; a weightless one (NanoChat's) is held to a gain of 1."""
    form = norm_form(norm)
    weight = getattr(norm, "weight", None)
    if weight is not None and weight.is_meta:
        return
    d = 64 if weight is None else weight.shape[0]  # (a weightless norm takes any width)
    device = "cpu" if weight is None else weight.device
    steps = torch.arange(3 * d, dtype=torch.float32, device=device)
    with torch.no_grad():
        probe = copy.deepcopy(norm).to(torch.bfloat16)
        if weight is not None:
            probe.weight.copy_(0.5 + 0.37 * torch.sin(steps[:d] * 0.7))
        x = (3.0 * torch.sin(steps * 1.3)).view(3, d).to(torch.bfloat16)
        gain, eps = final_norm(probe, x)
        same = torch.equal(probe(x), final_norm_ref(x, gain, eps))
    if not same:
        raise v.CodaInputError(
            f"apply_coda: the final norm {type(norm).__name__} does not compute coda's "
            f"{form!r} form (its rounding differs); its loss cannot be coda's"
        )


def final_norm(norm, rows, logits_scaling: float = 1.0) -> tuple:
    """The model's final RMSNorm of ``rows`` as coda's loss takes it: (gain, eps), by
    ``norm_form``: the weight (Llama's; for a weightless norm, NanoChat's, 1 in the rows'
    dtype), 1 + weight in fp32 (Gemma's, which coda's loss keeps in fp32:
    ``coda.reference.final_norm_ref``, HF's rounding) or the weight in fp32 (OLMo's, the same
    rounding). ``logits_scaling`` (Granite's: its logits are divided by it) divides the gain,
    in fp32: (r h g / s) W = (r h g) W / s."""
    form = norm_form(norm)
    weight = getattr(norm, "weight", None)
    if weight is None:
        weight = torch.ones(rows.shape[-1], dtype=rows.dtype, device=rows.device)
    if form == "gemma":
        gain, eps = 1.0 + weight.float(), norm.eps
    else:
        gain = weight.float() if form == "fp32" else weight
        eps = norm_epsilon(norm)
    return (gain if logits_scaling == 1.0 else gain.float() / logits_scaling), eps


def _router_loss(model, out, attention_mask):
    """A mixture-of-experts model's load-balancing loss over the call's router logits: its
    modeling module's ``load_balancing_loss_func`` (the first along its class's bases that
    has one), with the arguments its forward passes."""
    for cls in type(model).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            experts = (model.num_experts, model.num_experts_per_tok)
            return fn(out.router_logits, *experts, attention_mask)
    raise v.CodaInputError(f"apply_coda: {type(model).__name__} has no load_balancing_loss_func")


def _check_head(head) -> None:
    """coda's loss reads the LM head's weight alone: a head that adds anything to it (a LoRA
    adapter wrapped around it, say for new tokens; a bias) would be silently left out, so it
    is refused, named, at the call."""
    if type(head) is not torch.nn.Linear or head.bias is not None:
        what = type(head).__name__ if type(head) is not torch.nn.Linear else "Linear with a bias"
        raise v.CodaInputError(
            f"apply_coda: lm_head is a {what}, not a plain torch.nn.Linear without bias "
            "(coda's loss reads its weight alone; an adapter on it would be left out)"
        )


def check_accelerate_hook(layer, where: str) -> None:
    """accelerate's hook on an HF layer (``_hf_hook``: what ``device_map`` dispatch installs,
    moving the layer's inputs to its device; ``rehook`` keeps it) refused where it offloads
    the layer's weights ("cpu" or "disk" in the device map): it reloads them by HF's
    parameter names, which a patched layer's weights, in coda's layouts, do not have."""
    hook = getattr(layer, "_hf_hook", None)
    if any(getattr(h, "offload", False) for h in getattr(hook, "hooks", (hook,))):
        raise v.CodaInputError(
            f"{where}: its weights are offloaded by accelerate (a device_map placing it on "
            f"'cpu' or 'disk'); a coda layer keeps its weights, in coda's layouts, on its GPU"
        )


def rehook(patched, hook) -> None:
    """accelerate's ``hook`` (or None) installed on ``patched``, the coda layer that replaces
    the module it was on: with a model placed on several GPUs (``device_map``) the layer's
    inputs still move to its device."""
    if hook is not None:
        from accelerate.hooks import add_hook_to_module

        add_hook_to_module(patched, hook)


def adopt_embedding(embed) -> None:
    """``coda.nn.Embedding.adopt`` of a model's token embedding (in place). Where accelerate
    hooked it first (``_hf_hook``), the hook's saved forward is the former class's, bound:
    it becomes coda's, so that a hooked call runs coda's forward."""
    former = type(embed)
    saved = embed.__dict__.get("_old_forward")
    if Embedding.adopt(embed) and getattr(saved, "__func__", None) is former.forward:
        embed._old_forward = type(embed).forward.__get__(embed)
