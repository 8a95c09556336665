"""Parameter names that training code reads. Name-based rules treat coda's norm gains and
biases as a model's norms and biases: the HF Trainer's weight-decay rule (no decay on a
parameter whose name says norm or bias) excludes the same tensors from decay in a model
patched by ``apply_coda`` as in the unpatched one (Qwen2's and Llama's attention biases
included), and in coda's own ``CausalLM`` every norm gain. State dicts saved before the gains
and biases were renamed (``g1``, ``g2``, ``gf``; ``b_qkv``, ``b_o``) still load."""

from __future__ import annotations

import pytest
import torch

import coda.nn as cnn

SHAPE = dict(vocab=96, d=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128, dtype=torch.float64)


def _decayed(model) -> set:
    """The parameters the HF Trainer would give weight decay (its own rule, called as is)."""
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "llama-bias", "phi3"])
def test_the_trainer_decays_the_same_tensors_patched_or_not(family):
    pytest.importorskip("transformers")
    from test_transformers import pair, tiny_config

    ref, patched = pair(tiny_config(family))
    norms_ref = {n for n, p in ref.named_parameters() if n not in _decayed(ref)}
    norms_patched = {n for n, p in patched.named_parameters() if n not in _decayed(patched)}
    assert norms_ref and all("norm" in n or "bias" in n for n in norms_ref)
    # every norm gain and bias, and nothing else, is left undecayed in both: the same tensors
    assert {n for n, p in ref.named_parameters() if p.dim() == 1} == norms_ref
    assert {n for n, p in patched.named_parameters() if p.dim() == 1} == norms_patched
    count = sum(p.numel() for n, p in ref.named_parameters() if n in norms_ref)
    assert sum(p.numel() for n, p in patched.named_parameters() if n in norms_patched) == count


def test_the_trainer_does_not_decay_coda_norms():
    pytest.importorskip("transformers")
    model = cnn.CausalLM(**SHAPE)
    decayed = _decayed(model)
    for name, p in model.named_parameters():
        assert (name in decayed) == (p.dim() == 2), name


def test_layer_biases_saved_under_their_former_names_load():
    """``b_qkv`` and ``b_o`` (sessions 62-63, before the Trainer's no-decay rule was found to
    miss them) load as ``bias_qkv`` and ``bias_o``."""
    torch.manual_seed(1)
    layer = cnn.DecoderLayer(64, 4, 2, 128, dtype=torch.float64, qkv_bias=True, o_bias=True)
    with torch.no_grad():
        layer.bias_qkv.normal_()
        layer.bias_o.normal_()
    old = {
        {"bias_qkv": "b_qkv", "bias_o": "b_o"}.get(k, k): t for k, t in layer.state_dict().items()
    }
    assert "b_qkv" in old and "b_o" in old
    fresh = cnn.DecoderLayer(64, 4, 2, 128, dtype=torch.float64, qkv_bias=True, o_bias=True)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.bias_qkv, layer.bias_qkv) and torch.equal(fresh.bias_o, layer.bias_o)


def test_state_dicts_saved_under_the_former_names_load():
    torch.manual_seed(0)
    model = cnn.CausalLM(**SHAPE)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    former = {"attention_norm": "g1", "ffn_norm": "g2", "final_norm": "gf"}
    old = {}
    for key, t in model.state_dict().items():
        *path, name = key.split(".")
        old[".".join([*path, former.get(name, name)])] = t
    assert "layers.1.g2" in old and "head.gf" in old
    fresh = cnn.CausalLM(**SHAPE)
    fresh.load_state_dict(old)  # strict: every key found, none left over
    for key, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], t), key
    with pytest.raises(RuntimeError, match="Unexpected key"):  # both names: reported
        fresh.load_state_dict({**old, "layers.0.attention_norm": old["layers.0.g1"]})
