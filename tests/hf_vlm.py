"""Tiny random Hugging Face vision-language models for the VLM tests (no downloads): a vision
encoder of two layers on 16 x 16 images (patches of 4), a 2-layer text model of width 48, a
vocabulary of 128 with its image tokens at 120-122, and a training batch with an image:
``tiny_vlm(kind)`` -> (model in float64, batch). ``KINDS``: kind -> whether its text model's
layers are coda's (a Llama, Mistral, Ministral 3, Qwen2, Gemma, Gemma 2 (PaliGemma 2's) or
Gemma 3; the Qwen-VL models' Qwen2 and Qwen3 layers and GLM-4V's GLM-4 layers with
multimodal RoPE) or its loss alone is (``layers=False``: Mllama's cross-attention, the MoE
and linear-attention text models).
``TEXT_ONLY``: the kinds whose image inputs are not built here (Llava-NeXT's and -OneVision's
tiled images, Mllama's tiles and cross-attention masks): their batch has no image."""

from __future__ import annotations

import torch
from hf_tiny import LINEAR_ATTENTION, TINY

KINDS = {
    "llava": True,
    "llava_next": True,
    "llava_onevision": True,
    "mistral3": True,
    "mistral3_ministral3": True,
    "internvl": True,
    "idefics3": True,
    "smolvlm": True,
    "gemma3": True,
    "paligemma": True,
    "paligemma2": True,
    "qwen2_vl": True,
    "qwen2_5_vl": True,
    "qwen3_vl": True,
    "mllama": False,
    "qwen3_vl_moe": True,
    "glm4v": True,
    "glm4v_moe": True,
    "qwen3_5": False,
    "qwen3_5_moe": False,
}
TEXT_ONLY = ("llava_next", "llava_onevision", "mllama")
# image tokens per image: Llava's and PaliGemma's 16 patches; the others merge 2 x 2 patches
IMAGE_TOKENS = {"llava": 16, "paligemma": 16, "paligemma2": 16}
IMAGE = 120  # the image placeholder token (121, 122: video and vision-start tokens)
_TEXT = {**TINY, "vocab_size": 128, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, image_size=16)
_MROPE = dict(rope_type="default", mrope_section=[2, 2, 2], rope_theta=1e4)
_EAGER = dict(experts_implementation="eager")  # (the MoE text models: torch's grouped GEMM
# takes no float64)
_QWEN_VISION = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)


def _config(kind: str):
    import transformers as tf

    siglip = dict(_VISION, num_attention_heads=2, patch_size=4)
    if kind in ("llava_next", "llava_onevision"):
        vision = dict(siglip, model_type="siglip_vision_model")
        text = dict(_TEXT, model_type="mistral" if kind == "llava_next" else "qwen2")
        config = tf.LlavaNextConfig if kind == "llava_next" else tf.LlavaOnevisionConfig
        return config(
            vision_config=vision, text_config=text, image_token_index=IMAGE,
            image_grid_pinpoints=[[16, 16]],
        )  # fmt: skip
    if kind == "internvl":
        vision = dict(_VISION, num_attention_heads=2, image_size=[16, 16], patch_size=[4, 4])
        text = dict(_TEXT, model_type="qwen2")
        return tf.InternVLConfig(vision_config=vision, text_config=text, image_token_id=IMAGE)
    if kind in ("idefics3", "smolvlm"):
        config = tf.Idefics3Config if kind == "idefics3" else tf.SmolVLMConfig
        text = dict(_TEXT, model_type="llama")
        return config(vision_config=siglip, text_config=text, image_token_id=IMAGE, scale_factor=2)
    if kind.startswith("paligemma"):  # (PaliGemma 2's text model is Gemma 2's: eager)
        gemma2 = dict(model_type="gemma2", final_logit_softcapping=None, sliding_window=8)
        text = dict(_TEXT, **(gemma2 if kind == "paligemma2" else {"model_type": "gemma"}))
        text = dict(text, head_dim=12)
        return tf.PaliGemmaConfig(
            vision_config=siglip, text_config=text, image_token_index=IMAGE, projection_dim=48
        )
    if kind == "mllama":
        vision = dict(
            _VISION, attention_heads=2, patch_size=4, num_global_layers=1, max_num_tiles=4,
            vision_output_dim=64, intermediate_layers_indices=[0],
        )  # fmt: skip
        text = dict(_TEXT, cross_attention_layers=[1])
        return tf.MllamaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE)
    if kind == "llava":
        vision = tf.CLIPVisionConfig(**_VISION, num_attention_heads=2, patch_size=4)
        return tf.LlavaConfig(
            vision_config=vision,
            text_config=tf.LlamaConfig(**_TEXT),
            image_token_index=IMAGE,
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
        )
    if kind.startswith("mistral3"):  # (Ministral 3's text model: YaRN, a 4-token temperature)
        text = dict(model_type="mistral", **_TEXT, head_dim=12, sliding_window=None)
        if kind == "mistral3_ministral3":
            rope = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, beta_fast=32.0, beta_slow=1.0)
            rope.update(original_max_position_embeddings=4, llama_4_scaling_beta=0.1)
            text.update(model_type="ministral3", rope_parameters=rope)
        return tf.Mistral3Config(
            text_config=text,
            vision_config=dict(
                model_type="pixtral", **_VISION, num_attention_heads=2, patch_size=4, head_dim=16
            ),
            image_token_index=IMAGE,
            spatial_merge_size=2,
            vision_feature_layer=-1,
        )
    if kind == "gemma3":
        return tf.Gemma3Config(
            text_config=dict(_TEXT, head_dim=12, sliding_window=8),
            vision_config=dict(_VISION, num_attention_heads=2, patch_size=4),
            mm_tokens_per_image=4,
            image_token_index=IMAGE,
            boi_token_index=121,
            eoi_token_index=122,
        )
    ids = dict(image_token_id=IMAGE, video_token_id=121, vision_start_token_id=122)
    if kind == "qwen2_vl":
        vision = dict(_QWEN_VISION, embed_dim=32, hidden_size=48, mlp_ratio=2)
        text = dict(_TEXT, rope_parameters=_MROPE)
        return tf.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    vision = dict(_QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=48)
    if kind == "qwen2_5_vl":
        vision.update(window_size=16, fullatt_block_indexes=[1])
        text = dict(_TEXT, rope_parameters=_MROPE)
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if kind.startswith("glm4v"):  # (GLM-4V's multimodal RoPE on half of each head)
        vision = dict(_QWEN_VISION, hidden_size=32, intermediate_size=64, out_hidden_size=48)
        rope = dict(_MROPE, mrope_section=[1, 1, 1], partial_rotary_factor=0.5)
        text = dict(_TEXT, rope_parameters=rope)
        ids = dict(ids, image_start_token_id=122, image_end_token_id=123)
        if kind == "glm4v":
            return tf.Glm4vConfig(text_config=text, vision_config=vision, **ids)
        text.update(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        text.update(first_k_dense_replace=1, n_shared_experts=1)
        return tf.Glm4vMoeConfig(text_config=text, vision_config=vision, **ids, **_EAGER)
    vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    text = dict(_TEXT, head_dim=12, rope_parameters=dict(_MROPE, mrope_interleaved=True))
    if kind.startswith("qwen3_5"):  # (linear-attention layers: four, the fourth full attention)
        text.update(num_hidden_layers=4, **LINEAR_ATTENTION)
        if kind == "qwen3_5":
            return tf.Qwen3_5Config(text_config=text, vision_config=vision, **ids)
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        text.update(shared_expert_intermediate_size=40)
        return tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **ids, **_EAGER)
    if kind == "qwen3_vl_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        return tf.Qwen3VLMoeConfig(text_config=text, vision_config=vision, **ids, **_EAGER)
    return tf.Qwen3VLConfig(text_config=text, vision_config=vision, **ids)


def _model_class(kind: str):
    import transformers as tf

    names = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}
    names.update(qwen3_vl_moe="Qwen3VLMoe", glm4v="Glm4v", glm4v_moe="Glm4vMoe")
    names.update(llava_next="LlavaNext", llava_onevision="LlavaOnevision", internvl="InternVL")
    names.update(smolvlm="SmolVLM", paligemma="PaliGemma", paligemma2="PaliGemma")
    names.update(qwen3_5="Qwen3_5")
    names.update(qwen3_5_moe="Qwen3_5Moe", mistral3_ministral3="Mistral3")
    name = names.get(kind, kind.capitalize())
    return getattr(tf, f"{name}ForConditionalGeneration")


def tiny_vlm(kind: str, seed: int = 0):
    """(float64 model, a training batch): two rows of 28 tokens (one for the Qwen-VL models,
    whose images come as one flat patch list) with an image's tokens from position 3
    (``IMAGE_TOKENS``; none for ``TEXT_ONLY``'s kinds), their labels
    -100 as a fine-tuning recipe masks them, the other tokens' labels the tokens; every norm
    weight moved off its initial value (a lost gain would show)."""
    torch.manual_seed(seed)
    model = _model_class(kind)(_config(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    model = model.double()
    g = torch.Generator().manual_seed(seed + 1)
    patches = kind.startswith(("qwen", "glm4v"))  # (images as one flat patch list)
    rows = 1 if patches else 2
    ids = torch.randint(3, 100, (rows, 28), generator=g)
    image = slice(3, 3 + IMAGE_TOKENS.get(kind, 4))
    if kind not in TEXT_ONLY:
        ids[:, image] = IMAGE
    batch = dict(input_ids=ids, labels=ids.masked_fill(ids == IMAGE, -100))
    pixels = torch.randn(rows, 3, 16, 16, dtype=torch.float64, generator=g)
    if patches:  # 16 patches of 3 x 2 x 4 x 4, merged 2 x 2: 4 tokens
        ids[0, 2] = 122  # (the vision-start token before the image; GLM-4V's end after it)
        ids[0, 7] = 123 if kind.startswith("glm4v") else ids[0, 7]
        batch.update(
            pixel_values=torch.randn(16, 96, dtype=torch.float64, generator=g),
            image_grid_thw=torch.tensor([[1, 4, 4]]),
            mm_token_type_ids=(ids == IMAGE).long(),
        )
    elif kind.startswith("mistral3"):
        batch.update(pixel_values=pixels[:1], image_sizes=torch.tensor([[16, 16]]))
        batch["input_ids"][1, image] = 5  # (one image: the second row's text only)
        batch["labels"][1, image] = 5
    elif kind in ("idefics3", "smolvlm"):  # (images per row: one)
        batch["pixel_values"] = pixels[:, None]
    elif kind not in TEXT_ONLY:
        batch["pixel_values"] = pixels
        if kind == "gemma3":  # (HF's training mask: image tokens attend both ways)
            batch["token_type_ids"] = (ids == IMAGE).long()
        if kind.startswith("paligemma"):  # (its prefix, image and prompt, attends both ways)
            batch["token_type_ids"] = (torch.arange(28) >= 22).long().expand(rows, -1)
    return model, batch
