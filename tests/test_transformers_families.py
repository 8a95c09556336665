"""``apply_coda`` on the families whose decoder layer is Llama's with a per-layer sliding window
(``layer_types``): Ministral (Ministral-8B) and CWM (Meta's Code World Model, Llama 3's RoPE
scaling), or with q, k, v biases: Seed-OSS, or with GeGLU and 1 + w norms: Gemma, or GLM's,
EXAONE 4's, ERNIE 4.5's, OLMo's, Granite's, Hunyuan's and Arcee's layers, tiny and random,
on the CPU in float64 on coda's reference path and its kernel path (the tile interpreter):
logits, a training step with padding and with packed documents, greedy generation and the
state dict as the unpatched model's; the window matters (the first layer's is 4 tokens
against 13), and Ministral 3's (q times Llama 4's attention temperature after RoPE)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from hf_tiny import SCALED_ROPES  # noqa: E402
from test_transformers import (  # noqa: E402
    assert_behaves_as_unpatched,
    assert_same_step,
    model_class,
    pair,
    tiny_config,
)

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402
from coda import _validate as v  # noqa: E402


@pytest.mark.parametrize("family", ["ministral", "cwm"])
def test_patched_model_behaves_as_unpatched_float64(family, coda_path):
    cfg = tiny_config(family, **coda_path)
    ref, patched = pair(cfg)
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in patched.model.layers)
    assert [layer.self_attn.sliding_window for layer in patched.model.layers] == [4, None]
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def test_gemma_layers_behave_as_unpatched_float64(coda_path):
    """Gemma (1): Llama's layer with GeGLU and norms scaling by 1 + w in fp32, its token
    embedding scaled by sqrt(d) (HF's, kept): coda's layers with ``activation="gelu_tanh"``
    and ``norm_offset=1.0``, behaving as the unpatched model (norm weights away from 0, so a
    lost offset or weight would show)."""
    cfg = tiny_config("gemma", **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {(layer.activation, layer.norm_offset) for layer in layers} == {("gelu_tanh", 1.0)}
    assert type(patched.model.embed_tokens) is type(ref.model.embed_tokens)  # (scaled: HF's)
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def test_an_mlp_activation_coda_lacks_is_refused_named():
    cfg = tiny_config("llama", hidden_act="relu")
    with pytest.raises(v.CodaInputError, match="hidden_act='relu' is not supported"):
        ct.apply_coda(model_class(cfg)(cfg))


def test_ministral3_layers_behave_as_unpatched_float64(coda_path):
    """Ministral 3: Llama's layer under YaRN whose attention multiplies q after RoPE by Llama
    4's temperature 1 + beta log(1 + floor(position / context)) (here a context of 4 tokens,
    so 13 positions take four values), in coda's attention call
    (``_hf_families.attention_temperature``): as the unpatched model, padded and packed (the
    temperature follows each document's own positions) and in generation."""
    cfg = tiny_config("ministral3", **coda_path)
    ref, patched = pair(cfg)
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in patched.model.layers)
    assert patched.model.layers[0].rope_scale != 1.0  # (YaRN's c: in the attention's scale)
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


@pytest.mark.parametrize("out_bias", [False, True], ids=["qkv_bias", "qkv_and_o_bias"])
def test_seed_oss_behaves_as_unpatched_float64(out_bias, coda_path):
    """Seed-OSS: Llama's layer with q, k, v biases (Qwen2's, in the QKV GEMM's epilogue) and,
    with ``attention_out_bias``, the O projection's (in F3's); its residual dropout (0.1 in
    its config's defaults) must be 0 to be patched, and is refused, named, otherwise."""
    cfg = tiny_config("seed_oss", attention_out_bias=out_bias, **coda_path)
    ref, patched = pair(cfg)
    layer = patched.model.layers[0]
    assert layer.qkv_bias and layer.o_bias == out_bias
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    dropping = tiny_config("seed_oss", residual_dropout=0.1)
    with pytest.raises(v.CodaInputError, match=r"residual_dropout=0\.1 is not supported"):
        ct.apply_coda(model_class(dropping)(dropping))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma2_and_gemma3_layers_behave_as_unpatched_float64(family, coda_path):
    """Gemma 2 and Gemma 3 (text): Gemma's layer with a norm after each sublayer
    (``post_norms``), a 6-token window on the first of two layers, the attention's scale from
    ``query_pre_attn_scalar``; Gemma 2's attention logits soft-capped (by HF's attention
    function: eager), Gemma 3's QK-norm with 1 + w gains and RoPE per layer type (bases 10^4 on
    the sliding layer, 10^6 on the full one): coda's layers behave as the unpatched model."""
    kw = dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    kw |= dict(query_pre_attn_scalar=20)  # (not head_dim: a scale taken from head_dim would show)
    if family == "gemma2":
        kw |= dict(attn_logit_softcapping=0.02)  # (the tiny model's logits reach it: it binds)
    cfg = tiny_config(family, **kw, **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {(la.activation, la.norm_offset, la.post_norms) for la in layers} == {
        ("gelu_tanh", 1.0, True)
    }
    assert [la.qk_norm for la in layers] == [family == "gemma3"] * 2
    assert [layer.self_attn.sliding_window for layer in layers] == [6, None]
    if family == "gemma3":  # each layer rotates by its own type's frequencies
        assert layers[0]._inv_freq[1] != layers[1]._inv_freq[1]
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    assert_behaves_as_unpatched(ref, patched, ids, right_padding=family == "gemma2")


@pytest.mark.parametrize("family", ["glm", "glm4"])
def test_glm_layers_behave_as_unpatched_float64(family, coda_path):
    """GLM and GLM-4: Llama's layer rotating adjacent pairs (2i, 2i + 1) of the first half of
    each head (head_dim 12: three pairs rotated, three passed through at frequency 0), with
    q, k, v biases and a fused gate_up_proj; GLM-4's with four norms under its own names
    (``post_self_attn_layernorm`` after the attention, ``post_attention_layernorm`` before the
    MLP). Their q and k rows are already in coda's adjacent-pair order: no permutation."""
    cfg = tiny_config(family, **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {(la.qkv_bias, la.post_norms) for la in layers} == {(True, family == "glm4")}
    hf = ref.model.layers[0].self_attn
    q_rows = hf.q_proj.weight.shape[0]
    assert torch.equal(layers[0].w_qkv[:, :q_rows], hf.q_proj.weight.t())
    assert layers[0]._inv_freq[:3].min() > 0 and not layers[0]._inv_freq[3:].any()
    if family == "glm4":
        assert torch.equal(layers[0].ffn_norm, ref.model.layers[0].post_attention_layernorm.weight)
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def test_glm_partial_rope_with_yarn_scaling_trains_as_unpatched(coda_path):
    """GLM's RoPE on half of each head under YaRN, whose constant c scales cos and sin: coda
    folds c^2 into the attention's scale, which must not reach the unrotated dimensions (q
    takes 1 / c^2 back on them; before session 74 they took c^2 too)."""
    rope = dict(SCALED_ROPES["yarn-rope"], partial_rotary_factor=0.5)
    cfg = tiny_config("glm", rope_parameters=rope, max_position_embeddings=256, **coda_path)
    ref, patched = pair(cfg)
    assert patched.model.layers[0].rope_scale > 1 and patched.model.layers[0].rotated_dims == 6
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


def test_exaone4_layers_behave_as_unpatched_float64(coda_path):
    """EXAONE 4: norms after each sublayer and none before (``DecoderLayer(pre_norms=False)``),
    Qwen3's per-head QK-norm, a 4-token window on its sliding layer and no RoPE on its full
    one (its "global NoPE": coda's layer rotates by zero frequencies there, as SmolLM3's)."""
    types = ["sliding_attention", "full_attention"]
    cfg = tiny_config("exaone4", sliding_window=4, layer_types=types, **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {(la.pre_norms, la.post_norms, la.qk_norm) for la in layers} == {(False, True, True)}
    assert [la.use_rope for la in layers] == [True, False]
    assert [la.self_attn.sliding_window for la in layers] == [4, 4]  # (HF's own attribute)
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


@pytest.mark.parametrize("family", ["olmo2", "olmo3"])
def test_olmo_layers_behave_as_unpatched_float64(family, coda_path):
    """OLMo 2 and OLMo 3: EXAONE 4's norms (after each sublayer, none before), a QK-norm over
    the whole q and k projections (weights of n_heads and n_kv_heads head_dim, each head's part
    in coda's adjacent-pair order: ``qk_norm="whole"``), every norm's weight applied in fp32
    before its one rounding (``fp32_gains``); OLMo 3's sliding layers (a 4-token window) and its
    RoPE per layer type."""
    types = {"layer_types": ["sliding_attention", "full_attention"]} if family == "olmo3" else {}
    cfg = tiny_config(family, **types, **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    forms = {(la.pre_norms, la.post_norms, la.qk_norm_span, la.fp32_gains) for la in layers}
    assert forms == {(False, True, "whole", True)}
    hf = ref.model.layers[0].self_attn
    assert layers[0].q_norm.shape == hf.q_norm.weight.shape == (cfg.num_attention_heads * 12,)
    if family == "olmo3":
        assert [la.self_attn.sliding_window for la in layers] == [4, None]
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def test_granite_layers_behave_as_unpatched_float64(coda_path):
    """Granite (dense): Llama's layer with each sublayer's output times ``residual_multiplier``
    before its residual add (``DecoderLayer(residual_scale=)``: F3's and F5's epilogues on the
    kernel path) and the attention's scale ``attention_multiplier``; its embedding multiplier
    and its ``logits_scaling`` (the loss's) as the model has them. Multipliers not powers of
    two (Granite 3's 0.22 among them), so a lost or doubled one shows."""
    cfg = tiny_config("granite", residual_multiplier=0.22, attention_multiplier=0.3, **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {la.residual_scale for la in layers} == {0.22}
    assert {la.self_attn.scaling for la in layers} == {0.3}
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    # its attention_bias=True (biases on q, k, v and o): the O projection's bias with the
    # multiplier is refused, named, nothing patched
    biased = tiny_config("granite", attention_bias=True)
    model = model_class(biased)(biased)
    with pytest.raises(v.CodaInputError, match=r"layers.0: residual_multiplier 0.22 with an O-"):
        ct.apply_coda(model)
    assert type(model.model.layers[0]).__module__.startswith("transformers.")


@pytest.mark.parametrize("rope", ["default", "ntk_alpha"])
def test_hunyuan_dense_layers_behave_as_unpatched_float64(rope, coda_path):
    """Hunyuan (dense): Llama's layer with a per-head QK-norm of the rotated q and k
    (``query_layernorm`` / ``key_layernorm``: ``DecoderLayer(qk_norm_after_rope=True)``: F1's
    norm at unit gains, then the gains, as a rotation keeps each head's sum of squares),
    with the default RoPE and with its checkpoints' "dynamic" RoPE of a fixed ``alpha``
    (fixed NTK-alpha frequencies); head_dim 12 runs F1's row pass, 32 its epilogue."""
    ntk = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0}
    for hd in (12, 32):
        kw = {"rope_parameters": ntk} if rope == "ntk_alpha" else {}
        cfg = tiny_config("hunyuan_dense", head_dim=hd, **kw, **coda_path)
        ref, patched = pair(cfg)  # (every norm's gain away from 1: ``pair``)
        layers = patched.model.layers
        assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
        assert {(la.qk_norm_span, la.qk_norm_after_rope) for la in layers} == {("head", True)}
        hf = ref.model.layers[0].self_attn
        want = ref.model.rotary_emb.inv_freq.double()
        assert torch.allclose(layers[0]._inv_freq[: want.numel()], want, rtol=1e-6)
        assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
        assert set(patched.model.layers[0].state_dict()) >= {"self_attn.query_layernorm.weight"}
        assert hf.query_layernorm.weight.shape == (hd,)


def test_arcee_layers_behave_as_unpatched_float64(coda_path):
    """Arcee (AFM): Llama's layer with an MLP without a gate, down(relu(up(x))^2)
    (``DecoderLayer(activation="relu2")``, W_il = ``up_proj`` alone: relu^2 in F4's
    epilogue, its slope in B4's)."""
    cfg = tiny_config("arcee", **coda_path)
    assert cfg.hidden_act == "relu2"
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {la.activation for la in layers} == {"relu2"}
    assert layers[0].w_il.shape == (cfg.hidden_size, cfg.intermediate_size)
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def test_apertus_layers_behave_as_unpatched_float64(coda_path):
    """Apertus: Llama's layer (Llama 3's RoPE) with Qwen3's QK-norm, its two norms under their
    own names, and an MLP without a gate, down(xielu(up(x))), whose two learned scalars per
    layer (``mlp.act_fn.alpha_p``, ``alpha_n``: set apart here, so that a swap would show)
    become the layer's own ``mlp.act_fn`` (``DecoderLayer(activation="xielu")``: xIELU in F4's
    epilogue, its slope and the scalars' gradients in B4's); their gradients are HF's too."""
    cfg = tiny_config("apertus", head_dim=12, **coda_path)
    assert cfg.hidden_act == "xielu"
    torch.manual_seed(1)
    ref = model_class(cfg)(cfg).double()
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            layer.mlp.act_fn.alpha_p.fill_(0.3 + 0.2 * i)
            layer.mlp.act_fn.alpha_n.fill_(-0.9 + 0.5 * i)
    ref, patched = pair(cfg, model=ref)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {(la.activation, la.qk_norm_span) for la in layers} == {("xielu", "head")}
    assert layers[0].w_il.shape == (cfg.hidden_size, cfg.intermediate_size)
    keys = set(layers[1].state_dict())
    assert {"mlp.act_fn.alpha_n", "mlp.act_fn.eps", "feedforward_layernorm.weight"} <= keys
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


@pytest.mark.parametrize("post_norm", [True, False], ids=["peri_ln", "granite"])
def test_hyperclovax_layers_behave_as_unpatched_float64(post_norm, coda_path):
    """HyperCLOVAX: Granite's layer (embedding and attention multipliers; its logits
    multiplied by ``logits_scaling``, where Granite divides: 0.3 here, in the loss's final-norm
    gain) with, by default (``use_post_norm``, "Peri-LN"), Gemma 2's four norms under other
    names (``_hf_families.HYPERCLOVAX_NORMS``; without it the two after the sublayers are
    identities); its residual multiplier (0.22 here, as muP's) in F3's and F5's epilogues
    without the post-norms, folded into the post-norms' gains with them."""
    kw = {"use_post_norm": post_norm, "residual_multiplier": 0.22}
    cfg = tiny_config("hyperclovax", **kw, **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert {(la.post_norms, la.residual_scale) for la in layers} == {(post_norm, 0.22)}
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def test_helium_and_vaultgemma_layers_behave_as_unpatched_float64(coda_path):
    """Helium: Llama's layer rotating adjacent pairs (GLM's order), its norms' gains in fp32
    (``fp32_gains``, its final norm ``_hf_forward.FP32_SCALED_NORMS``). VaultGemma: Gemma 2's
    layer without its two post-norms, its pre-MLP norm under Gemma 2's name
    (``VAULTGEMMA_NORMS``), the attention logits soft-capped (0.02: binding), a 6-token
    window on its first layer, its final logits soft-capped (3: binding) in coda's loss."""
    for family in ("helium", "vaultgemma"):
        cfg = tiny_config(family, **coda_path)
        ref, patched = pair(cfg)
        layers = patched.model.layers
        assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
        forms = {(la.fp32_gains, la.activation, la.post_norms) for la in layers}
        assert forms == {
            (True, "silu", False) if family == "helium" else (False, "gelu_tanh", False)
        }
        ids = torch.randint(0, cfg.vocab_size, (2, 13))
        assert_behaves_as_unpatched(ref, patched, ids, right_padding=family == "vaultgemma")


def test_nanochat_layers_behave_as_unpatched_float64(coda_path):
    """NanoChat: Arcee's MLP (relu^2, no gate) under CLIP's names (``fc1``, ``fc2``), every
    norm weightless (``DecoderLayer(norm_gains=False)``: gains a constant 1, no parameter, no
    key), QK-norm of the rotated q and k under Qwen3's names, RoPE by -theta (its rotate_half
    is minus Llama's: the layer's frequencies negated, HF's sin tables too), the token
    embeddings normed by the final norm's module before the layers (kept in coda's training
    call, the final norm inside coda's loss), the logits soft-capped (3: binding); head_dim 12
    runs F1's row pass, 32 its epilogue. HF's weightless norm computes in fp32 whatever the
    model's dtype (``x.float()``): the float64 models agree to its rounding, inside ``TOL``."""
    for hd in (12, 32):
        cfg = tiny_config("nanochat", head_dim=hd, **coda_path)
        ref, patched = pair(cfg)
        layers = patched.model.layers
        assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
        forms = {(la.activation, la.qk_norm_span, la.qk_norm_after_rope) for la in layers}
        assert forms == {("relu2", "head", True)}
        assert {(la.norm_gains, la.turns_back) for la in layers} == {(False, True)}
        assert all((la._inv_freq < 0).all() for la in layers)
        assert not any("norm" in n for n, _ in patched.named_parameters())
        assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_nanochat_loss_alone_behaves_as_unpatched_float64(kernel, monkeypatch):
    """NanoChat with ``layers=False`` (its layers HF's, as with adapters in them): coda's loss
    with its weightless final norm (a gain of 1) and its soft cap, the embeddings' norm, the
    same module, kept before the layers: the loss and every gradient, padded, as unpatched."""
    if kernel:
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    cfg = tiny_config("nanochat", vocab_size=128)
    ref, _ = pair(cfg)
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    assert type(patched.model.layers[0]).__module__.startswith("transformers.")
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    assert_same_step(ref, patched, input_ids=ids, attention_mask=mask, labels=labels)
    assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")


def test_ernie4_5_layers_behave_as_unpatched_float64(coda_path):
    """ERNIE 4.5 (dense): Llama's layer rotating adjacent pairs (2i, 2i + 1) of whole heads
    (GLM's order, read from its ``rotate_half``: its q and k rows kept as they are), tied
    embeddings; its ``use_bias=True`` puts biases on the MLP's projections too, which coda's
    layer lacks: refused, named (no config flag ``mlp_bias`` says so)."""
    cfg = tiny_config("ernie4_5", head_dim=12, **coda_path)
    ref, patched = pair(cfg)
    layers = patched.model.layers
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    hf = ref.model.layers[0].self_attn
    assert torch.equal(layers[0].w_qkv[:, : hf.q_proj.weight.shape[0]], hf.q_proj.weight.t())
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    biased = tiny_config("ernie4_5", head_dim=12, use_bias=True)
    with pytest.raises(v.CodaInputError, match=r"biases on the MLP's projections \(gate_proj"):
        ct.apply_coda(model_class(biased)(biased))
