"""``apply_coda`` on tiny random Hugging Face Qwen2 models (Llama's layer with biases on the
q, k and v projections) and Llama models with ``attention_bias=True`` (biases on q, k, v and
o), on the CPU in float64 (coda's reference path, and with ``coda_path`` the kernel path
through the tile interpreter): logits, loss, every gradient (the biases' included, in HF's
layout), padding and packed sequences, a sliding window, generation, the state dict
(``save_pretrained``: in ``test_transformers.py``); and what is refused (biases on some of
q, k, v only; with Qwen3's QK-norm). The biases are
drawn at unit scale (HF makes them 0); the layer tests draw them larger
(``test_kernel_path_cpu.py``; on the GPU ``test_transformers_gpu.py``), as trained Qwen2
checkpoints' k biases run."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from test_transformers import (  # noqa: E402
    TOL,
    assert_behaves_as_unpatched,
    assert_same_step,
    model_class,
    pair,
    tiny_config,
)

import coda  # noqa: E402
import coda.transformers as ct  # noqa: E402


def test_patched_qwen2_matches_unpatched_float64(coda_path):
    cfg = tiny_config("qwen2", tie_word_embeddings=True, **coda_path)  # as Qwen2.5-0.5B
    ref, patched = pair(cfg)
    assert all(layer.qkv_bias and not layer.qk_norm for layer in patched.model.layers)
    bias = ref.model.layers[0].self_attn.k_proj.bias.detach()
    assert float(bias.abs().max()) > 1  # (as ``pair`` draws them)
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    grads = ct.hf_gradients(patched)  # (the last step's: the biases' in HF's keys)
    assert all(f"model.layers.1.self_attn.{p}_proj.bias" in grads for p in "qkv")


def test_patched_llama_with_attention_bias_matches_unpatched_float64(coda_path, tmp_path):
    """Llama's ``attention_bias=True``: q, k, v biases in F1's epilogue, o_proj's in F3's
    (its gradient dx1's column sums); a saved patched model loads into an unpatched one."""
    cfg = tiny_config(attention_bias=True, **coda_path)
    ref, patched = pair(cfg, seed=3)
    assert all(layer.qkv_bias and layer.o_bias for layer in patched.model.layers)
    assert float(ref.model.layers[0].self_attn.o_proj.bias.detach().abs().max()) > 1
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    grads = ct.hf_gradients(patched)
    assert all(f"model.layers.{i}.self_attn.o_proj.bias" in grads for i in (0, 1))
    patched.save_pretrained(tmp_path)
    loaded = model_class(cfg).from_pretrained(tmp_path, torch_dtype=torch.float64)
    for name, p in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name


def test_patched_qwen2_sliding_window_as_unpatched():
    cfg = tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ref, patched = pair(cfg, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        assert rel_err(patched(ids).logits, ref(ids).logits) < TOL
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


def test_a_frozen_bias_stays_frozen_and_a_partly_frozen_one_is_named():
    cfg = tiny_config("qwen2")
    ref, patched = pair(cfg, seed=2)
    for layer in ref.model.layers:
        for p in ("q", "k", "v"):
            getattr(layer.self_attn, f"{p}_proj").bias.requires_grad_(False)
    for layer in patched.model.layers:  # (patched after the fact: its one fused weight)
        layer.bias_qkv.requires_grad_(False)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)  # (the same weights get none)
    fresh = model_class(cfg)(cfg)
    fresh.model.layers[1].self_attn.k_proj.bias.requires_grad_(False)
    with pytest.raises(coda.CodaInputError, match=r"layers.1: .*k_proj.bias.* cannot be partly"):
        ct.apply_coda(fresh)


def test_biases_on_some_of_q_k_v_and_with_qk_norm_are_named():
    cfg = tiny_config("qwen2")
    model = model_class(cfg)(cfg)
    model.model.layers[1].self_attn.v_proj.bias = None
    with pytest.raises(coda.CodaInputError, match="layers.1: biases on some of q_proj, k_proj"):
        ct.apply_coda(model)
    with pytest.raises(coda.CodaInputError, match="qk_norm and qkv_bias together"):
        coda.nn.DecoderLayer(48, 4, 2, 80, qk_norm=True, qkv_bias=True)
    qwen3 = tiny_config("qwen3", attention_bias=True)  # (biases with Qwen3's QK-norm)
    with pytest.raises(coda.CodaInputError, match="layers.0: q, k, v biases with Qwen3's QK"):
        ct.apply_coda(model_class(qwen3)(qwen3))


def test_an_o_proj_bias_alone_is_patched():
    """A bias on o_proj alone (a layer may carry one without q, k, v biases) runs in F3."""
    cfg = tiny_config(attention_bias=True)
    ref, _ = pair(cfg, seed=5)
    for layer in ref.model.layers:
        for p in ("q", "k", "v"):
            setattr(layer.self_attn, f"{p}_proj", torch.nn.Linear(48, 48 if p == "q" else 24,
                    bias=False, dtype=torch.float64))  # fmt: skip
    patched = ct.apply_coda(copy.deepcopy(ref))
    assert all(not ly.qkv_bias and ly.o_bias for ly in patched.model.layers)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
