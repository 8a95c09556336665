"""Hugging Face models as users train them: one step ``model(input_ids, labels=input_ids)
.loss.backward()`` at 4 x 4096 tokens, tokens/s and peak memory, for a Llama-3.2-1B-shaped
``LlamaForCausalLM``, a Qwen3-0.6B-shaped ``Qwen3ForCausalLM`` and a Qwen2.5-0.5B-shaped
``Qwen2ForCausalLM`` (random init, bf16, sdpa; on request, ``ON_REQUEST``, Llama-1B with
attention biases, a Phi-3-mini-shaped ``Phi3ForCausalLM``, a Gemma-3-1B-shaped
``Gemma3ForCausalLM`` and a Gemma-2-2B-shaped ``Gemma2ForCausalLM`` (its logits soft-capped;
their layers coda's since sessions 71-72), Qwen2.5-VL-3B's and Qwen3-VL-2B's text models in their
vision-language classes, text-only batches, an OLMo-2-1B-shaped ``Olmo2ForCausalLM`` and a
Phi-4-mini-shaped ``Phi3ForCausalLM``),
in one run: unpatched, under ``torch.compile`` (``model.model``; the logits and loss stay
eager, as users compile it), with Liger's instance patch (called as the others, and with
``use_cache=False``, which a patched model's training call implies), and patched by
``coda.transformers.apply_coda``, and patched with ``model.model`` then compiled (``_compiled``:
for the models whose loss alone coda takes, Inductor fusing HF's own layers around coda's
loss; session 70), and patched with HF's activation checkpointing on (what it
saves in memory and costs in time; ``_storing``: its first forward storing what only the
backward's rerun reads, as before session 64), and patched with the embedding's backward left as
torch's (``apply_coda(embedding=False)``). Every variant starts from the same weights. coda's and
Liger's rows also carry one step's per-kernel table and GPU idle time (after the timing).
With ``CODA_HF_AMP=1`` every variant is the fp32 model with its forward under bf16 autocast
(HF's Trainer with ``bf16=True``): rows ``hf/<shape>+amp/...``.

Each variant's peak memory is measured as if it were alone (``_common.PeakAlone``), then
every variant is timed in interleaved rounds (``_common.interleaved``), with the GPU's clock
and power over the round (``_common.clocked``: a step that runs at the power cap runs at a
lower clock, attention's kernels included). Liger's patch also
rebinds process-wide names (the model class's forward, RoPE), so ``LigerSwitch`` applies them
around Liger's own steps only.
"""

from __future__ import annotations

import copy

import torch

from benchmarks._common import (
    SKIPPED,
    PeakAlone,
    bench_long,
    bf16_autocast,
    clocked,
    interleaved,
    mixed_precision,
    out_of_time,
    progress,
    selected,
    where_time_goes,
)
from benchmarks._switches import storing_for_backward

LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    tie_word_embeddings=False,
)
SHAPES = {
    "llama-3.2-1B": ("llama", LLAMA_1B),
    "qwen3-0.6B": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
    # Llama-3.2-1B's shape with attention_bias=True (biases on q, k, v and o: F1's and F3's
    # bias epilogues), beside the plain one: what the biases cost coda's step
    "llama-3.2-1B-bias": ("llama", {**LLAMA_1B, "attention_bias": True}),
    "qwen2.5-0.5B": (  # Qwen2: biases on q, k and v
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    # Phi-3-mini-4k's shape (fused qkv_proj and gate_up_proj; its 2047-token sliding window;
    # V = 32064 is no multiple of 128, so coda's LM head runs "recompute" under "auto")
    "phi-3-mini": (
        "phi3",
        dict(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            sliding_window=2047,
            pad_token_id=32000,
            tie_word_embeddings=False,
        ),
    ),
    # Gemma-2B's shape (Gemma 1, ``GemmaForCausalLM``): coda's layers since session 71 (GeGLU
    # in the gate/up epilogue, the norms' 1 + w gains in fp32), its loss at V = 256000
    "gemma-2B": (
        "gemma",
        dict(
            vocab_size=256000,
            hidden_size=2048,
            intermediate_size=16384,
            num_hidden_layers=18,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=256,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma-3-1B's shape (``Gemma3ForCausalLM``): coda's layers since session 72 (GeGLU, the
    # norms after each sublayer, QK-norm with 1 + w, RoPE per layer type; the loss alone
    # before), the final norm's gain 1 + w kept in fp32; at its 262144-token vocabulary the
    # logits are what the unpatched step spends its memory on
    "gemma-3-1B": (
        "gemma3",
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma-2-2B's shape (``Gemma2ForCausalLM``): coda's layers since session 72 (the loss
    # alone before), its logits soft-capped at 30
    # (coda's ``softcap``, Liger's); eager attention for every variant (its attention's own
    # soft-cap, 50: transformers runs no sdpa for Gemma 2)
    "gemma-2-2B": (
        "gemma2",
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=4096,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
        ),
    ),
    # GLM-4-9B's layer shape (``Glm4ForCausalLM``: RoPE on half of each head, q, k, v biases,
    # four norms) at 12 of its 40 layers, so that every variant fits one card at 4 x 4096
    # tokens: coda's layers since session 73
    "glm-4-9B-12L": (
        "glm4",
        dict(
            vocab_size=151552,
            hidden_size=4096,
            intermediate_size=13696,
            num_hidden_layers=12,
            num_attention_heads=32,
            num_key_value_heads=2,
            head_dim=128,
            pad_token_id=151329,
        ),
    ),
    # OLMo-2-0425-1B's shape (``Olmo2ForCausalLM``: norms after each sublayer only, a QK-norm
    # over the whole q and k projections, every gain in fp32): coda's layers since session 74
    "olmo-2-1B": (
        "olmo2",
        dict(
            vocab_size=100352,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            pad_token_id=100277,
        ),
    ),
    # Phi-4-mini-instruct's shape (``Phi3ForCausalLM``: RoPE on 3/4 of each head under
    # LongRoPE, whose per-frequency factors ``build`` sets to 1: a step's time does not
    # depend on them; its scale c on cos and sin kept, from the two context lengths)
    "phi-4-mini": (
        "phi3",
        dict(
            vocab_size=200064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=24,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 4096,
                "partial_rotary_factor": 0.75,
            },
            tie_word_embeddings=True,
            pad_token_id=199999,
        ),
    ),
    # Granite-3.3-2B's shape (``GraniteForCausalLM``: Llama's layer with each sublayer's output
    # times ``residual_multiplier`` before its add, coda's F3 / F5 epilogues since session 75;
    # the attention's scale ``attention_multiplier``, the embedding's multiplier, the logits
    # divided by ``logits_scaling``), its 49155-token vocabulary padded to 49152 + 128 (as
    # ``resize_token_embeddings(..., pad_to_multiple_of=128)`` would: the kernels' TMA rows)
    "granite-3-2B": (
        "granite",
        dict(
            vocab_size=49280,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=40,
            num_attention_heads=32,
            num_key_value_heads=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            embedding_multiplier=12.0,
            logits_scaling=8.0,
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
    # a Hunyuan-7B-like shape at 12 layers (``HunYuanDenseV1ForCausalLM``: Llama's layer with a
    # per-head QK-norm of the rotated q and k, coda's since session 75; the NTK-alpha RoPE its
    # checkpoints label "dynamic"), the vocabulary a multiple of 128
    "hunyuan-7B-12L": (
        "hunyuan_v1_dense",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=12,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rope_parameters={
                "rope_type": "dynamic",
                "rope_theta": 10000.0,
                "alpha": 1000.0,
                "factor": 1.0,
            },
            tie_word_embeddings=False,
            pad_token_id=0,
        ),
    ),
    # Llama-3.2-1B's dimensions with Arcee's layer (``ArceeForCausalLM``: an MLP without a
    # gate, relu(x)^2, coda's since session 75), not a released Arcee model's shape
    "arcee-1B-shape": (
        "arcee",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
            pad_token_id=0,
        ),
    ),
    # Apertus-8B's dimensions (``ApertusForCausalLM``: Qwen3's QK-norm, an MLP without a gate,
    # xIELU with two learned scalars per layer, coda's since session 76) at 8 of its 32 layers
    "apertus-8B-8L": (
        "apertus",
        dict(
            vocab_size=131072,
            hidden_size=4096,
            intermediate_size=21504,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=False,
            pad_token_id=0,
        ),
    ),
    # Qwen2.5-VL-3B's text model (``Qwen2_5_VLForConditionalGeneration``, a 1-block vision
    # encoder that text-only batches leave idle): coda's layers (multimodal RoPE in the QKV
    # epilogue) and loss through the vision-language forward, V = 151936
    "qwen2.5-vl-3B": (
        "qwen2_5_vl",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=11008,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
    ),
    # Qwen3-VL-2B's text model (``Qwen3VLForConditionalGeneration``): Qwen3's layer, QK-norm
    # and multimodal RoPE (interleaved) in the QKV epilogue, as the one above
    "qwen3-vl-2B": (
        "qwen3_vl",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
}
# (not in a default run: named in CODA_HF_SHAPES)
ON_REQUEST = ("llama-3.2-1B-bias", "phi-3-mini", "gemma-3-1B", "gemma-2-2B", "qwen2.5-vl-3B")
ON_REQUEST += ("qwen3-vl-2B", "gemma-2B", "glm-4-9B-12L", "olmo-2-1B", "phi-4-mini")
ON_REQUEST += ("granite-3-2B", "hunyuan-7B-12L", "arcee-1B-shape", "apertus-8B-8L")
BATCH, SEQ = 4, 4096
# shapes stepped at fewer tokens: Gemma 2's eager attention keeps (B, H, S, S) scores, capped
# scores and probabilities for 26 layers, which at 4 x 4096 ran every variant out of an 80 GB
# card's memory (session 73)
TOKENS = {"gemma-2-2B": (2, 2048)}


def batch_of(shape_name: str) -> tuple[int, int]:
    """(batch, sequence) of a shape's step."""
    return TOKENS.get(shape_name, (BATCH, SEQ))


ON_REQUEST_PEERS = ("hf_coda_flex", "hf_liger_flex")  # (run only when CODA_HF_PEERS names them)
# the variants whose per-kernel tables pass 1 takes
PROFILED = ("hf_coda", "hf_coda_compiled", "hf_liger", "hf_liger_no_cache", *ON_REQUEST_PEERS)


# the vision-language families: (config class, multimodal RoPE sections as parts of
# head_dim / 2: Qwen2.5-VL's 16, 24, 24 of 64; Qwen3-VL's 24, 20, 20, interleaved)
VISION_LANGUAGE = {
    "qwen2_5_vl": ("Qwen2_5_VL", (16, 24, 24)),
    "qwen3_vl": ("Qwen3VL", (24, 20, 20)),
}


def _vision_language_config(family: str, shape: dict):
    """The ``family``'s vision-language config around the text ``shape``: its multimodal RoPE
    sections in the released proportions, one small vision block."""
    import transformers

    name, parts = VISION_LANGUAGE[family]
    half = (shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]) // 2
    sections = [half * p // 64 for p in parts[:2]]
    sections.append(half - sum(sections))
    rope = dict(rope_type="default", rope_theta=1e6, mrope_section=sections)
    text = {**shape, "max_position_embeddings": SEQ, "rope_parameters": rope}
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2)
    vision["out_hidden_size"] = shape["hidden_size"]
    if family == "qwen3_vl":
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    return getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, attn_implementation="sdpa",
        tie_word_embeddings=shape.get("tie_word_embeddings", False),
    )  # fmt: skip


def build(family: str, shape: dict, device, dtype):
    import transformers

    if family in VISION_LANGUAGE:
        torch.manual_seed(0)
        config = _vision_language_config(family, shape)
        model_cls = getattr(transformers, f"{VISION_LANGUAGE[family][0]}ForConditionalGeneration")
        return model_cls(config).to(device, dtype)

    names = {
        "llama": "Llama",
        "qwen2": "Qwen2",
        "qwen3": "Qwen3",
        "phi3": "Phi3",
        "gemma": "Gemma",
        "gemma2": "Gemma2",
        "glm4": "Glm4",
        "olmo2": "Olmo2",
        "granite": "Granite",
        "hunyuan_v1_dense": "HunYuanDenseV1",
        "arcee": "Arcee",
        "apertus": "Apertus",
    }
    name = {**names, "gemma3": "Gemma3Text"}[family]
    cfg_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")
    attention = "eager" if family == "gemma2" else "sdpa"  # (Gemma 2's: ``SHAPES``)
    shape = {"max_position_embeddings": SEQ, **_longrope_factors(shape)}
    config = cfg_cls(**shape, attn_implementation=attention)
    torch.manual_seed(0)
    return model_cls(config).to(device, dtype)


def _longrope_factors(shape: dict) -> dict:
    """``shape`` with LongRoPE's per-frequency factors where its RoPE names none: 1 for each
    rotated pair (``SHAPES``' Phi-4-mini)."""
    rope = shape.get("rope_parameters", {})
    if rope.get("rope_type") != "longrope" or "long_factor" in rope:
        return shape
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    pairs = int(head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
    ones = [1.0] * pairs
    return {**shape, "rope_parameters": {**rope, "short_factor": ones, "long_factor": ones}}


def _module_state(module) -> dict:
    """Every attribute of a modeling module and of the classes it defines, by (owner, name)."""
    state = {(module, k): v for k, v in vars(module).items()}
    for cls in [v for v in vars(module).values() if isinstance(v, type)]:
        if cls.__module__ == module.__name__:
            state.update({(cls, k): v for k, v in vars(cls).items()})
    return state


class LigerSwitch:
    """Liger's instance patch also rebinds process-wide names (the causal LM class's forward,
    the RoPE function of the modeling module), which would change every other variant timed
    after it. This applies the patch once, records what it rebound, puts the originals back,
    and ``wrap`` runs Liger's step with its bindings and every other step without them."""

    def __init__(self, module, apply):
        self.module, self.apply = module, apply  # apply(model=...): the patch

    @classmethod
    def of(cls, family: str) -> "LigerSwitch":
        import importlib

        import liger_kernel.transformers as lk

        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        patch = {"gemma3": "gemma3_text"}.get(family, family)  # (its text-only model's patch)
        return cls(module, getattr(lk, f"apply_liger_kernel_to_{patch}"))

    def patch(self, model):
        before = _module_state(self.module)
        self.apply(model=model)
        after = _module_state(self.module)
        self.theirs = {k: v for k, v in after.items() if before.get(k, self) is not v}
        self.ours = {k: before.get(k, self) for k in self.theirs}
        self._bind(self.ours)
        return model

    def _bind(self, state):
        for (owner, name), value in state.items():
            if value is self:  # a name the patch added
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    def wrap(self, step):
        def run():
            self._bind(self.theirs)
            try:
                step()
            finally:
                self._bind(self.ours)

        return run


def variants(family: str, base, liger: "LigerSwitch | None"):
    """(name, make) in run order; ``make`` returns a fresh model from ``base``'s weights."""
    import coda.transformers as ct
    from coda._hf_forward import text_model

    def coda_patch(m, **kw):  # (the loss alone where coda's layers do not apply: Gemma, VLMs)
        vlm = type(m).__name__ in ct.VISION_LANGUAGE
        text = type(text_model(m)).__name__ if vlm else None
        alone = type(m).__name__ in ct.LOSS_ONLY or text in ct.TEXT_LOSS_ONLY
        return ct.apply_coda(m, layers=not alone, **kw)

    def compiled(m):  # the decoder stack under torch.compile, as users compile an HF model
        m.model = torch.compile(m.model)
        return m

    def flex(m):  # HF's flex attention (Gemma 3's sliding windows as block-sparse masks)
        m.set_attn_implementation("flex_attention")
        return m

    def checkpointed():  # HF's activation checkpointing over the patched layers
        m = coda_patch(copy.deepcopy(base)).train()
        enable = getattr(m, "activation_checkpointing_enable", None)  # (5.24's name)
        (enable or m.gradient_checkpointing_enable)()
        return m

    out = [
        ("hf", lambda: copy.deepcopy(base)),
        ("hf_torch_compile", lambda: compiled(copy.deepcopy(base))),
        ("hf_coda", lambda: coda_patch(copy.deepcopy(base))),
        # the patch, then the stack compiled: for the loss-alone models (Gemma), Inductor's
        # fusion of HF's own layers around coda's loss (run 297); for the layers coda takes,
        # their uncompiled step (run 301, since the patched layers keep SDPA's causal flag)
        ("hf_coda_compiled", lambda: compiled(coda_patch(copy.deepcopy(base)))),
        ("hf_coda_checkpointed", checkpointed),
        # the same, its checkpoint's first forward storing what only the backward's rerun
        # reads (``storing_for_backward``), as before session 64
        ("hf_coda_checkpointed_storing", checkpointed),
        # the embedding's backward left as torch's (before session 29)
        ("hf_coda_torch_embedding", lambda: coda_patch(copy.deepcopy(base), embedding=False)),
    ]
    if liger is not None:
        out.append(("hf_liger", lambda: liger.patch(copy.deepcopy(base))))
        # the same, called with ``use_cache=False`` (README's tip), as coda's training call
        # runs by default: the like-for-like row
        out.append(("hf_liger_no_cache", lambda: liger.patch(copy.deepcopy(base))))
    # on request (named in CODA_HF_PEERS): the model switched to flex attention, then patched
    out.append(("hf_coda_flex", lambda: coda_patch(flex(copy.deepcopy(base)))))
    if liger is not None:
        out.append(("hf_liger_flex", lambda: liger.patch(flex(copy.deepcopy(base)))))
    # checked against every peer's name, Liger's too where it has no patch of this family (its
    # row already says so): a selection naming it still runs the others (run 316 lost a whole
    # suite to a family without one)
    liger_names = ("hf_liger", "hf_liger_no_cache", "hf_liger_flex")
    chosen = selected("CODA_HF_PEERS", {name for name, _ in out} | set(liger_names))
    default = [name for name, _ in out if name not in ON_REQUEST_PEERS]
    return [(name, make) for name, make in out if name in (chosen or default)]


def _step(model, ids, amp=False, **call):
    """One training step's call; with ``amp`` its forward under bf16 autocast, the backward
    outside it, as HF's Trainer runs a mixed-precision step."""

    def step():
        model.zero_grad(set_to_none=True)
        with bf16_autocast(ids.device.type, enabled=amp):
            loss = model(input_ids=ids, labels=ids, **call).loss
        loss.backward()

    return step


def training_step(shape_name: str, patch=None, layers: int | None = None, **call):
    """One training step (``_step``) of the bf16 HF model of ``SHAPES[shape_name]`` on the GPU
    at ``batch_of(shape_name)`` random tokens, built by ``build`` and patched in place by
    ``patch`` (e.g. ``coda.transformers.apply_coda``); ``layers`` overrides the depth;
    ``call``: the model call's keywords. What the probes time and profile."""
    family, shape = SHAPES[shape_name]
    if layers is not None:
        shape = {**shape, "num_hidden_layers": layers}
    model = build(family, shape, "cuda", torch.bfloat16)
    if patch is not None:
        model = patch(model)
    ids = torch.randint(0, shape["vocab_size"], batch_of(shape_name), device="cuda")
    return _step(model, ids, **call)


def step_peak(step, model, steps: int = 4) -> float:
    """Peak GiB of ``steps`` runs of ``step`` (the first ones compile) as if ``model`` were
    alone on the GPU (``PeakAlone``: the variants kept for interleaved timing not counted)."""
    model.zero_grad(set_to_none=True)
    with PeakAlone(model) as mem:
        for _ in range(steps):
            step()
    return mem.gib


def _one_held(held: dict):
    """``interleaved``'s timer: a variant's step timed, then its model's gradients dropped
    (``held``: step -> model), so the rounds hold one variant's gradients at a time (run 293
    ran out of memory at a 256k vocabulary with every variant's held)."""
    timer = clocked(bench_long)

    def run(step):
        try:
            return timer(step)
        finally:
            held[step].zero_grad(set_to_none=True)

    return run


def run() -> list[dict]:
    """Every shape but those run only on request (``ON_REQUEST``), or those named in
    ``CODA_HF_SHAPES`` (comma-separated keys of SHAPES)."""
    chosen = selected("CODA_HF_SHAPES", SHAPES)
    amp = mixed_precision("CODA_HF_AMP")
    rows = []
    for shape_name, (family, shape) in SHAPES.items():
        if shape_name not in (chosen or set(SHAPES) - set(ON_REQUEST)):
            continue
        name = shape_name + ("+amp" if amp else "")
        base = build(family, shape, "cuda", torch.float32 if amp else torch.bfloat16)
        ids = torch.randint(0, shape["vocab_size"], batch_of(shape_name), device="cuda")
        # pass 1, one variant at a time: its peak memory as if alone (``PeakAlone``) and its
        # kernel table; pass 2 times every variant in
        # interleaved rounds (``_common.interleaved``)
        steps, peaks, profiles, held = {}, {}, {}, {}
        try:
            liger = LigerSwitch.of(family)
        except (ImportError, AttributeError) as e:  # no liger-kernel here, or no patch of
            liger = None  # this family (Arcee's): the other variants still run, the row says
            rows.append(progress({"name": f"hf/{name}/hf_liger", "error": repr(e)[:300]}))
        for label, make in variants(family, base, liger):
            if out_of_time():
                rows.append({"name": f"hf/{name}/{label}", **SKIPPED})
                continue
            try:
                model = make()
                call = {"use_cache": False} if label.endswith("_no_cache") else {}
                step = _step(model, ids, amp, **call)
                step = liger.wrap(step) if label.startswith("hf_liger") else step
                step = storing_for_backward(step) if label.endswith("_storing") else step
                peaks[label] = step_peak(step, model)
                if label in PROFILED:
                    try:  # a failed profile must not cost the timing
                        profiles[label] = where_time_goes(step)
                    except Exception as e:
                        profiles[label] = {"profile_error": repr(e)[:300]}
                model.zero_grad(set_to_none=True)
                steps[label], held[step] = step, model
                alone = {"peak_gib": peaks[label], **profiles.get(label, {})}
                progress({"name": f"hf/{name}/{label}/alone", **alone})  # kept if the call is cut
            except Exception as e:  # recorded, never hidden (and kept if the suite raises)
                rows.append(progress({"name": f"hf/{name}/{label}", "error": repr(e)[:300]}))
            model = None
            torch.cuda.empty_cache()
        timed = {}
        if steps and not out_of_time():
            try:
                timed = interleaved(steps, timer=_one_held(held))
            except Exception as e:  # recorded, with each variant's peak alone; the next
                for label in steps:  # shape still runs
                    alone = {"peak_gib": peaks[label], **profiles.get(label, {})}
                    row = {"name": f"hf/{name}/{label}", **alone, "error": repr(e)[:300]}
                    rows.append(progress(row))
                steps = {}
        if steps and not timed:  # measured alone, then out of time before the rounds (run 153)
            for label in steps:
                alone = {"peak_gib": peaks[label], **profiles.get(label, {})}
                rows.append({"name": f"hf/{name}/{label}", **alone, **SKIPPED})
        times = {label: t["ms"] * 1e-3 for label, t in timed.items()}
        for label, t in timed.items():
            rows.append(
                progress(  # kept if the call is cut
                    {
                        "name": f"hf/{name}/{label}",
                        "tokens": ids.numel(),
                        **t,
                        "tokens_per_s": ids.numel() / (t["ms"] * 1e-3),
                        "peak_gib": peaks[label],
                        **profiles.get(label, {}),
                    }
                )
            )
        steps = timed = held = None
        peers = [
            t
            for k, t in times.items()
            if k in ("hf_torch_compile", "hf_liger", "hf_liger_no_cache", "hf_liger_flex")
        ]
        for r in rows:
            if peers and r["name"].startswith(f"hf/{name}/") and "ms" in r:
                r["speedup_vs_best_peer"] = min(peers) / (r["ms"] * 1e-3)
        del base
        torch.cuda.empty_cache()
    return rows
