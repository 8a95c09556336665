"""``apply_coda`` on tiny random Hugging Face Phi-3 models (Llama's layer with the q, k, v
projections fused into one ``qkv_proj`` and gate and up into one ``gate_up_proj``), on the CPU
in float64 (coda's reference path, and with ``coda_path`` the kernel path through the tile
interpreter): logits, loss, every gradient in HF's fused layout, padding and packed sequences,
generation, a sliding window, the state dict both ways (``coda._hf_fused``), frozen fused
weights, Phi-4-mini's partial rotary embedding (rotate-half pairs on 3/4 of each head, with
LongRoPE); and what is refused (residual dropout, an adapter on a fused projection). The same
kernels run as for Llama: only the weights' layout conversion is Phi-3's."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from hf_tiny import SCALED_ROPES  # noqa: E402
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


@pytest.mark.parametrize("rope", ["default", "longrope"])
def test_phi4_mini_partial_rotary_matches_unpatched_float64(rope, coda_path):
    """Phi-4-mini's RoPE: rotate-half pairs on the first 3/4 of each head
    (``partial_rotary_factor`` 0.75 at head_dim 16: 6 pairs rotated, 2 passed through), alone
    and with LongRoPE as Phi-4-mini configures it (a call past position 64 takes its long
    set): coda's q and k columns put the rotated pairs first (``_hf_fused.pair_order``), the
    others rotated at frequency 0, the identity."""
    rp = dict(rope_type="default", rope_theta=1e4)
    rp = rp if rope == "default" else dict(SCALED_ROPES["longrope-rope"])
    kw = dict(hidden_size=64, partial_rotary_factor=0.75, rope_parameters=rp)
    cfg = tiny_config("phi3", **kw, **coda_path)
    ref, patched = pair(cfg)
    layer = patched.model.layers[0]
    assert layer.hf_form.rotated == 12 and layer.hf_form.adjacent == (4, 2, 16)
    assert layer._inv_freq[:6].min() > 0 and not layer._inv_freq[6:].any()
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    if rope == "longrope":  # a call past the original context: the long set
        ids = torch.randint(0, cfg.vocab_size, (1, 70))
        assert_same_step(ref, patched, input_ids=ids, labels=ids)


def test_pair_order_maps_each_form_exactly():
    """``_hf_fused.pair_order``: GLM's adjacent pairs as they are; a partial rotate-half RoPE's
    pairs (i, i + r / 2) first, then its unrotated dimensions; the row conversions both ways
    are each other's inverse, and coda's order reads each pair's two dimensions."""
    assert _hf_fused.pair_order(8).tolist() == list(range(8))
    assert _hf_fused.pair_order(8, 4).tolist() == [0, 2, 1, 3, 4, 5, 6, 7]
    form = _hf_fused.Form(adjacent=(2, 1, 8), rotated=4)
    w = {"self_attn.q_proj.weight": torch.randn(16, 3), "self_attn.k_proj.bias": torch.randn(8)}
    there = _hf_fused.to_model(w, "", form)
    back = _hf_fused.from_model(there, {}, "", form)
    assert all(torch.equal(back[k], w[k]) for k in w)
    # coda's order is Llama's rows by ``head_perm`` and the model's by ``pair_order``: equal
    from coda.reference.rope import head_perm

    q = w["self_attn.q_proj.weight"].view(2, 8, 3)
    coda_q = q[:, head_perm(8)]
    assert torch.equal(there["self_attn.q_proj.weight"].view(2, 8, 3)[:, form_order(form)], coda_q)


def form_order(form):
    return _hf_fused.pair_order(form.adjacent[2], form.rotated)


def test_what_phi3_configs_coda_refuses_are_named():
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
