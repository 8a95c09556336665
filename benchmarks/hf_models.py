"""The Hugging Face models ``bench_hf`` steps: each shape's family and config (``SHAPES``,
random init; the released models' widths, depths cut where one card could not hold every
variant), the tokens a step takes, and ``build``, which makes the model in a dtype on a
device (vision-language families in their own classes, a small vision tower). Split from
``bench_hf.py`` (session 78), which times them; the probes and tests that build these models
import them from either."""

from __future__ import annotations

import os

import torch

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
    # Qwen3-30B-A3B's dimensions at 8 of its 48 layers (``Qwen3MoeForCausalLM``: Qwen3's
    # attention, QK-norm per head, 128 experts of 768, 8 a token; HF's grouped-GEMM experts):
    # coda's attention sublayers since session 81, the experts HF's
    "qwen3-30B-A3B-8L": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
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
ON_REQUEST += ("qwen3-30B-A3B-8L",)
BATCH, SEQ = 4, 4096
# shapes stepped at fewer tokens: Gemma 2's eager attention keeps (B, H, S, S) scores, capped
# scores and probabilities for 26 layers, which at 4 x 4096 ran every variant out of an 80 GB
# card's memory (session 73); and the unpatched Apertus-8B and Hunyuan-7B shapes, whose fp32
# logits over 131072 / 128256 columns at 4 x 4096 tokens ran out of it (run 319)
TOKENS = {"gemma-2-2B": (2, 2048), "apertus-8B-8L": (2, 4096), "hunyuan-7B-12L": (2, 4096)}
TOKENS["qwen3-30B-A3B-8L"] = (2, 4096)  # (the unpatched model's logits: out of memory at 4 x 4096)


def batch_of(shape_name: str) -> tuple[int, int]:
    """(batch, sequence) of a shape's step: ``CODA_HF_TOKENS`` ("BxS", e.g. "4x4096") where
    set, for every shape of the run, else the shape's own."""
    given = os.environ.get("CODA_HF_TOKENS", "")
    if given:
        batch, _, seq = given.partition("x")
        if not (batch.isdigit() and seq.isdigit() and int(batch) > 0 and int(seq) > 0):
            raise ValueError(f"CODA_HF_TOKENS: {given!r} is not BATCHxSEQ (e.g. 4x4096)")
        return int(batch), int(seq)
    return TOKENS.get(shape_name, (BATCH, SEQ))


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
        "qwen3_moe": "Qwen3Moe",
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
