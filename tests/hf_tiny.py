"""Tiny random Hugging Face configs and their model classes for the HF tests (no downloads):
``tiny_config(family)`` for every family ``apply_coda`` takes, ``model_class(config)``."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM

# Llama with a scaled RoPE (``rope_parameters``): the model's inverse frequencies, not the
# default ones, for the tests that patch such a model (meta-device load, the GPU protocol)
SCALED_ROPES = {
    "llama3-rope": dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
        rope_theta=500000.0,
    ),
    "linear-rope": dict(rope_type="linear", factor=4.0, rope_theta=10000.0),
    # cos and sin scaled by a constant too (its attention_scaling, 0.1 ln(4) + 1)
    "yarn-rope": dict(
        rope_type="yarn", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=64
    ),
    # Phi-3.5's: two sets of frequencies (``tiny_config`` fills in their per-frequency factors
    # for the config's head_dim), the long one for a call reaching position 64; cos and sin
    # scaled by sqrt(1 + ln 4 / ln 64)
    "longrope-rope": dict(
        rope_type="longrope", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=64
    ),
}


def with_longrope_factors(rope: dict, head_dim: int) -> dict:
    """``rope`` with LongRoPE's per-frequency factors for ``head_dim`` where it has none: short
    ones near 1, long ones growing to ~60 (a trained model's are of these sizes)."""
    if rope.get("rope_type") != "longrope" or "long_factor" in rope:
        return rope
    half = head_dim // 2
    short = [1.0 + 0.1 * i / half for i in range(half)]
    long = [1.0 + 60.0 * (i / half) ** 2 for i in range(half)]
    return {**rope, "short_factor": short, "long_factor": long}


# the mixture-of-experts families (their layers stay HF's: ``apply_coda(layers=False)``)
MOE = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe"}
MOE.update(granitemoe="GraniteMoe", granitemoeshared="GraniteMoeShared")
_ROUTER = dict(
    num_experts_per_tok=2,
    router_aux_loss_coef=0.5,  # (HF's 0.001 would hide a lost term under round-off)
    output_router_logits=True,
    experts_implementation="eager",  # (torch's grouped GEMM takes no float64)
)
MOE_KW = {
    "mixtral": dict(num_local_experts=4, **_ROUTER),
    "qwen2_moe": dict(
        num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=40, **_ROUTER
    ),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=32, head_dim=12, **_ROUTER),
}
# Granite's multipliers away from 1 (its released models' are; the residual one Granite 3's 0.22,
# not a power of two): logits / 4 among them
GRANITE_KW = dict(
    logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.22, attention_multiplier=0.2
)
MOE_KW["granitemoe"] = dict(num_local_experts=4, **_ROUTER, **GRANITE_KW)
MOE_KW["granitemoeshared"] = dict(shared_intermediate_size=40, **MOE_KW["granitemoe"])
# later families with the router term (session 69), by config class ("...Text": the causal
# LM's text config; its class drops the suffix): OLMoE, GPT-OSS (its attention sinks eager
# only), MiniMax-M2, ERNIE 4.5 MoE, Qwen3-Next and Qwen3.5 MoE (linear-attention layers: four
# layers, the fourth full attention)
MOE.update(olmoe="Olmoe", gpt_oss="GptOss", minimax_m2="MiniMaxM2", ernie4_5_moe="Ernie4_5_Moe")
MOE.update(qwen3_next="Qwen3Next", qwen3_5_moe="Qwen3_5MoeText")
# the linear-attention layers' heads small (their defaults, 16 / 32 heads of 128, made a
# float64 step of the tiny model take 7 s, most of it in the depthwise convolution)
LINEAR_ATTENTION = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8
)
_HYBRID = dict(num_hidden_layers=4, head_dim=12, shared_expert_intermediate_size=40)
_HYBRID.update(LINEAR_ATTENTION)
MOE_KW.update(
    olmoe=dict(num_experts=4, **_ROUTER),
    gpt_oss=dict(num_local_experts=4, head_dim=12, attn_implementation="eager", **_ROUTER),
    minimax_m2=dict(num_local_experts=4, head_dim=12, **_ROUTER),
    ernie4_5_moe=dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, **_ROUTER),
    qwen3_next=dict(num_experts=4, moe_intermediate_size=32, **_HYBRID, **_ROUTER),
    qwen3_5_moe=dict(num_experts=4, moe_intermediate_size=32, **_HYBRID, **_ROUTER),
)
# later still (session 77): Mellum (Qwen3-MoE's), Laguna
MOE.update(mellum="Mellum", laguna="Laguna")
MOE_KW.update(
    mellum=dict(num_experts=4, moe_intermediate_size=32, head_dim=12, **_ROUTER),
    laguna=dict(num_experts=4, moe_intermediate_size=32, head_dim=12, **_ROUTER),
)
# families whose loss alone coda takes with no router term in HF's forward (session 69), by
# config class as ``MOE``: DeepSeek-V3 (latent attention), GLM-4.5 (MoE), Llama 4 (text),
# GLM-4, Apertus, Arcee, EXAONE 4, Qwen3.5 (linear-attention layers), ERNIE 4.5 and
# Hunyuan (dense and MoE)
LOSS_ALONE = dict(deepseek_v3="DeepseekV3", glm4_moe="Glm4Moe", llama4="Llama4Text")
LOSS_ALONE.update(glm4="Glm4", apertus="Apertus", arcee="Arcee", exaone4="Exaone4")
LOSS_ALONE.update(qwen3_5="Qwen3_5Text", ernie4_5="Ernie4_5")
LOSS_ALONE.update(hunyuan_dense="HunYuanDenseV1", hunyuan_moe="HunYuanMoEV1")
LOSS_ALONE.update(solar_open="SolarOpen", gemma4="Gemma4Text")  # (session 77)
_GROUPED = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1)
_GROUPED.update(topk_group=1, first_k_dense_replace=1, experts_implementation="eager")
LOSS_ALONE_KW = dict(
    deepseek_v3=dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=12, **_GROUPED,
    ),
    glm4_moe=dict(head_dim=12, **_GROUPED),
    solar_open=dict(head_dim=12, **_GROUPED),
    # (the cap binding; the per-layer input embeddings small: at Gemma 4's default 262144
    # rows they took 10 s a build in float64)
    gemma4=dict(head_dim=12, final_logit_softcapping=3.0, vocab_size_per_layer_input=128,
                hidden_size_per_layer_input=8),
    llama4=dict(experts_implementation="eager"),
    qwen3_5=dict(num_hidden_layers=4, head_dim=12, **LINEAR_ATTENTION),
    hunyuan_dense=dict(head_dim=12),
    hunyuan_moe=dict(num_experts=4, moe_topk=2, head_dim=12, experts_implementation="eager"),
)  # fmt: skip


# later dense families whose layers are coda's (session 76), by config class as ``MOE``:
# Helium (adjacent RoPE pairs, fp32 gains), HyperCLOVAX (Granite's multipliers and, with
# ``use_post_norm``, Gemma 2's four norms), VaultGemma (Gemma 2's without its post-norms; its
# attention eager: soft-capped logits, and its final logits soft-capped at 3, binding here)
DENSE = dict(helium="Helium", hyperclovax="HyperCLOVAX", vaultgemma="VaultGemma")
DENSE.update(nanochat="NanoChat")  # (session 77: weightless norms, RoPE by -theta)
DENSE_KW = dict(
    helium=dict(head_dim=12),  # (its o_proj is hidden x hidden: n_heads head_dim = hidden)
    hyperclovax=dict(head_dim=12, logits_scaling=0.3, embedding_multiplier=2.0,
                     attention_multiplier=0.2),
    vaultgemma=dict(head_dim=12, attn_implementation="eager", attn_logit_softcapping=0.02,
                    final_logit_softcapping=3.0, query_pre_attn_scalar=20, sliding_window=6,
                    layer_types=["sliding_attention", "full_attention"]),
    nanochat=dict(head_dim=12, final_logit_softcapping=3.0),
)  # fmt: skip


# the Gemma families (their layers stay HF's: ``apply_coda(layers=False)``), by config class
GEMMA = {"gemma": "Gemma", "gemma2": "Gemma2", "gemma3": "Gemma3Text"}


# every tiny model's text dimensions (the VLM tests' text models too: ``hf_vlm``)
TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def tiny_config(family: str = "llama", **kw):
    """A tiny random config: ``family`` "llama" (LlamaConfig), "llama-bias" (Llama with
    ``attention_bias=True``: q, k, v and o biases), "qwen3" (Qwen3Config, with its per-head
    QK-norm), "qwen2" (Qwen2Config: q, k, v biases), "mistral", "phi3" (Phi3Config: fused
    qkv_proj and gate_up_proj; "phi4-mini": with RoPE on 3/4 of each head and LongRoPE),
    "smollm3" (SmolLM3Config: every second layer without RoPE here), "ministral" and "cwm"
    (Llama's layer, a 4-token window on the first of two), "ministral3" (YaRN and Llama 4's
    attention temperature), "seed_oss" (q, k, v biases, its
    dropouts off), the mixture-of-experts "mixtral", "qwen2_moe", "qwen3_moe" (``MOE``: four
    experts, two a token, the router term on at a visible weight) or "gemma", "gemma2", "gemma3"
    (``GEMMA``; Gemma 2's logit soft-capping off unless given), "granite" (``GRANITE_KW``: its
    multipliers, logits / 4), the Granite MoE families "granitemoe", "granitemoeshared", and
    "olmo2", "olmo3" (OLMo 3 with a 4-token window on its sliding layers), and ``DENSE``'s
    "helium", "hyperclovax", "vaultgemma", "nanochat"."""
    from transformers import Qwen3Config

    base = {**TINY, "attn_implementation": "sdpa"}
    if family == "qwen3":
        return Qwen3Config(**{**base, "head_dim": 16, **kw})
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**{**base, **kw})
    if family == "mistral":  # (its default window is 4096: no window unless one is given)
        from transformers import MistralConfig

        return MistralConfig(**{**base, "head_dim": 12, "sliding_window": None, **kw})
    if family in ("phi3", "phi4-mini"):  # (its default token ids lie outside the tiny vocabulary)
        from transformers import Phi3Config

        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if family == "phi4-mini":  # (Phi-4-mini's RoPE: on 3/4 of each head, LongRoPE)
            rope = dict(SCALED_ROPES["longrope-rope"])
            kw = {"hidden_size": 64, "partial_rotary_factor": 0.75, "rope_parameters": rope, **kw}
        return Phi3Config(**_longrope_filled({**base, **ids, **kw}))
    if family in ("glm", "glm4"):  # (a fused gate_up_proj, q, k, v biases, RoPE on half of
        # each head's adjacent pairs: head_dim 12 rotates three pairs, passes three through)
        import transformers

        config = transformers.GlmConfig if family == "glm" else transformers.Glm4Config
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return config(**{**base, **ids, "head_dim": 12, **kw})
    if family in MOE or family in LOSS_ALONE or family in DENSE:
        import transformers

        name, extra = (MOE, MOE_KW) if family in MOE else (LOSS_ALONE, LOSS_ALONE_KW)
        name, extra = (DENSE, DENSE_KW) if family in DENSE else (name, extra)
        config = getattr(transformers, f"{name[family]}Config")
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        return config(**{**base, **ids, **extra.get(family, {}), **kw})
    if family in ("olmo2", "olmo3"):
        import transformers

        config = getattr(transformers, f"{family.capitalize()}Config")
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        window = {"sliding_window": 4} if family == "olmo3" else {}  # (its default layer types)
        return config(**{**base, **ids, **window, **kw})
    if family == "granite":
        from transformers import GraniteConfig

        return GraniteConfig(**{**base, **GRANITE_KW, **kw})
    if family in GEMMA:
        import transformers

        config = getattr(transformers, f"{GEMMA[family]}Config")
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        # (Gemma 2 runs eager attention only: its attention logits are soft-capped too)
        cap = dict(final_logit_softcapping=None, attn_implementation="eager")
        cap = cap if family == "gemma2" else {}
        return config(**{**base, **ids, "head_dim": 12, **cap, **kw})
    if family == "seed_oss":  # (q, k, v biases; its dropouts, 0.1 by default, off)
        from transformers import SeedOssConfig

        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
        drop = dict(residual_dropout=0.0, attention_dropout=0.0)
        return SeedOssConfig(**{**base, **ids, **drop, **kw})
    if family == "ministral3":  # (YaRN, and Llama 4's attention temperature past 4 tokens)
        from transformers import Ministral3Config

        rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0)
        rope.update(beta_slow=1.0, original_max_position_embeddings=4, llama_4_scaling_beta=0.1)
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=12)
        return Ministral3Config(**{**base, **ids, "rope_parameters": rope, **kw})
    if family in ("ministral", "cwm"):  # (a 4-token window on the first layer only)
        import transformers

        config = transformers.MinistralConfig if family == "ministral" else transformers.CwmConfig
        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=12, sliding_window=4)
        types = dict(layer_types=["sliding_attention", "full_attention"])
        return config(**{**base, **ids, **types, **kw})
    if family == "smollm3":
        from transformers import SmolLM3Config

        ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, no_rope_layer_interval=2)
        return SmolLM3Config(**{**base, **ids, **kw})
    if family == "llama-bias":
        kw = {"attention_bias": True, **kw}
    return LlamaConfig(**_longrope_filled({**base, **kw}))


def _longrope_filled(kw: dict) -> dict:
    if "rope_parameters" in kw:  # (factors for the rotated dimensions: Phi-4-mini rotates 3/4)
        head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
        rotated = int(head_dim * kw.get("partial_rotary_factor", 1.0))
        kw["rope_parameters"] = with_longrope_factors(kw["rope_parameters"], rotated)
    return kw


def padded_batch(vocab: int, right: bool = False) -> dict:
    """A training call's keywords for the loss-alone tests: (2, 11) seeded tokens, the second
    row padded by 3 on the left (or the ``right``), its labels -100 there."""
    import torch

    ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, slice(-3, None) if right else slice(0, 3)] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def model_class(config):
    import transformers
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    for name in (*MOE.values(), *LOSS_ALONE.values(), *DENSE.values()):
        if type(config) is getattr(transformers, f"{name}Config"):
            return getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")
    if type(config) is transformers.GraniteConfig:
        return transformers.GraniteForCausalLM
    for name in ("Olmo2", "Olmo3"):
        if type(config) is getattr(transformers, f"{name}Config"):
            return getattr(transformers, f"{name}ForCausalLM")
    for name in ("Ministral", "Ministral3", "Cwm", "SeedOss", "Glm"):
        if type(config) is getattr(transformers, f"{name}Config"):
            return getattr(transformers, f"{name}ForCausalLM")
    for name in GEMMA.values():
        if type(config) is getattr(transformers, f"{name}Config"):
            return getattr(transformers, f"{name.removesuffix('Text')}ForCausalLM")
    if isinstance(config, MistralConfig):
        return MistralForCausalLM
    if isinstance(config, Phi3Config):
        return Phi3ForCausalLM
    if isinstance(config, SmolLM3Config):
        return SmolLM3ForCausalLM
    if isinstance(config, Qwen2Config):
        return Qwen2ForCausalLM
    return Qwen3ForCausalLM if isinstance(config, Qwen3Config) else LlamaForCausalLM
