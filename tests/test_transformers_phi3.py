"""``apply_coda`` on tiny random Hugging Face Phi-3 models (Llama's layer with the q, k, v
projections fused into one ``qkv_proj`` and gate and up into one ``gate_up_proj``), on the CPU
in float64 (coda's reference path, and with ``coda_path`` the kernel path through the tile
interpreter): logits, loss, every gradient in HF's fused layout, padding and packed sequences,
generation, a sliding window, the state dict both ways (``coda._hf_fused``), frozen fused
weights; and what is refused (a partial rotary embedding, residual dropout, an adapter on a
fused projection). The same kernels run as for Llama: only the weights' layout conversion
is Phi-3's."""

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
from coda import _hf_fused  # noqa: E402


def test_patched_phi3_matches_unpatched_float64(coda_path):
    cfg = tiny_config("phi3", **coda_path)
    ref, patched = pair(cfg)
    assert all(layer.hf_form.fused == tuple(_hf_fused.FUSED) for layer in patched.model.layers)
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    grads = ct.hf_gradients(patched)  # in HF's fused keys and shapes
    want = {n: p.shape for n, p in ref.named_parameters()}
    assert {n: g.shape for n, g in grads.items()} == want


def test_patched_phi3_sliding_window_as_unpatched():
    cfg = tiny_config("phi3", sliding_window=4)
    ref, patched = pair(cfg, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        assert rel_err(patched(ids).logits, ref(ids).logits) < TOL
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


def test_fused_keys_convert_exactly_both_ways():
    """A Phi-3 layer's state dict splits into Llama's keys by rows and fuses back bit for
    bit; shapes fuse as the tensors do; a coda weight's fused key replaces its parts."""
    cfg = tiny_config("phi3")
    ref, patched = pair(cfg, seed=1)
    layer = patched.model.layers[1]
    hf = {k: t for k, t in ref.model.layers[1].state_dict().items()}
    llama = _hf_fused.split(hf, layer._llama_shapes())
    assert "self_attn.q_proj.weight" in llama and "self_attn.qkv_proj.weight" not in llama
    assert {k: tuple(t.shape) for k, t in llama.items()} == layer._llama_shapes()
    back = _hf_fused.fuse(llama)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], hf[k]) for k in hf)
    assert _hf_fused.fuse_shapes(layer._llama_shapes()) == {
        k: tuple(t.shape) for k, t in hf.items()
    }
    assert layer.hf_shapes("p.") == {f"p.{k}": tuple(t.shape) for k, t in hf.items()}
    keys = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
    assert _hf_fused.fused_keys(keys) == ("mlp.gate_up_proj.weight",)
    assert _hf_fused.fused_keys(("mlp.down_proj.weight",)) == ("mlp.down_proj.weight",)
    with pytest.raises(coda.CodaInputError, match="self_attn.qkv_proj.weight"):
        layer.load_state_dict({**hf, "self_attn.qkv_proj.weight": hf["mlp.down_proj.weight"]})


def test_a_frozen_fused_weight_stays_frozen(coda_path):
    """Freezing Phi-3's fused qkv_proj (one HF weight, one coda weight) before the patch
    freezes coda's w_qkv; the step's gradients are the unpatched model's, the same weights
    getting none."""
    cfg = tiny_config("phi3", **coda_path)
    ref, _ = pair(cfg, seed=2)
    for layer in ref.model.layers:
        layer.self_attn.qkv_proj.weight.requires_grad_(False)
    patched = ct.apply_coda(copy.deepcopy(ref))
    assert not any(layer.w_qkv.requires_grad for layer in patched.model.layers)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


def test_what_phi3_configs_coda_refuses_are_named():
    partial = tiny_config("phi3", partial_rotary_factor=0.75)  # (Phi-4-mini's)
    with pytest.raises(coda.CodaInputError, match="partial rotary.*partial_rotary_factor < 1"):
        ct.apply_coda(model_class(partial)(partial))
    dropout = tiny_config("phi3", resid_pdrop=0.1)
    with pytest.raises(coda.CodaInputError, match="resid_pdrop=0.1 is not supported"):
        ct.apply_coda(model_class(dropout)(dropout))
    cfg = tiny_config("phi3")
    model = model_class(cfg)(cfg)
    qkv = model.model.layers[1].self_attn.qkv_proj
    model.model.layers[1].self_attn.qkv_proj = torch.nn.Sequential(qkv)  # (an adapter's place)
    with pytest.raises(coda.CodaInputError, match=r"layers\.1\.self_attn\.qkv_proj is a Seq"):
        ct.apply_coda(model)
    model = model_class(cfg)(cfg)
    model.model.layers[0].mlp.gate_up_proj.bias = torch.nn.Parameter(torch.zeros(160))
    with pytest.raises(coda.CodaInputError, match="layers.0: biases on fused projections"):
        ct.apply_coda(model)
