"""Adapters and ``apply_coda``: a projection that is not a plain ``nn.Linear`` (a LoRA adapter,
a quantized linear) is refused in patched layers, named, with the way that works:
``apply_coda(model, layers=False)``, which leaves the decoder layers (and their adapters) the
model's own and makes only the training call's loss coda's; a PEFT model is taken through
its ``get_base_model()``; an adapter on ``lm_head`` is refused at the call. CPU, float64, both
paths where coda's loss runs; LoRA emulated by a module of its shape, and, where PEFT is
installed (it is not a dev dependency), by PEFT itself."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from test_transformers import (  # noqa: E402
    TOL,
    _step,
    assert_same_step,
    model_class,
    pair,
    tiny_config,
)

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402
from coda import _validate as v  # noqa: E402


def test_adapters_and_other_linears_are_refused():
    """A projection that is not a plain ``nn.Linear`` (a LoRA adapter around one, a quantized
    or fp8 linear) would lose what it adds if its weight were fused: ``apply_coda`` refuses it,
    naming the module and its type."""

    class Adapter(nn.Module):  # LoRA's shape: the base layer plus a low-rank update
        def __init__(self, base):
            super().__init__()
            self.base_layer = base
            self.down = nn.Linear(base.in_features, 2, bias=False)
            self.up = nn.Linear(2, base.out_features, bias=False)

        def forward(self, x):
            return self.base_layer(x) + self.up(self.down(x))

    for where in ("self_attn.v_proj", "mlp.down_proj"):
        cfg = tiny_config()
        model = model_class(cfg)(cfg)
        owner, name = where.rsplit(".", 1)
        parent = model.model.layers[1].get_submodule(owner)
        setattr(parent, name, Adapter(getattr(parent, name)))
        with pytest.raises(v.CodaInputError, match=rf"layers\.1\.{where} is a Adapter"):
            ct.apply_coda(model)


class _LowRank(nn.Module):
    """LoRA's shape around a linear: the base layer plus a trainable low-rank update."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, 2, bias=False, dtype=base.weight.dtype)
        self.up = nn.Linear(2, base.out_features, bias=False, dtype=base.weight.dtype)

    def forward(self, x):
        return self.base_layer(x) + self.up(self.down(x))


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_the_loss_alone_leaves_the_layers_and_their_adapters(family, kernel, monkeypatch):
    """``apply_coda(model, layers=False)``: the decoder layers stay HF's own modules, so a
    model with adapters in them (LoRA's shape, on v_proj / qkv_proj and down_proj, the base
    weights frozen) patches, and, adapters added before the patch or after it, its training
    step (coda's loss, no logits; with ``kernel`` its kernel path through the interpreter)
    equals the unpatched model's: loss and every gradient, the adapters' included."""
    if kernel:  # (as the ``coda_path`` fixture, but no coda layer runs here)
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    coda.env._LAST.clear()
    cfg = tiny_config(family, **({"vocab_size": 128} if kernel else {}))
    ref, _ = pair(cfg, seed=7)
    ref.requires_grad_(False)
    v_name = "qkv_proj" if family == "phi3" else "v_proj"
    for layer in ref.model.layers:
        layer.self_attn.add_module(v_name, _LowRank(getattr(layer.self_attn, v_name)))
        layer.mlp.down_proj = _LowRank(layer.mlp.down_proj)
        with torch.no_grad():  # (LoRA starts its up at 0: a zero update would show nothing)
            for m in (getattr(layer.self_attn, v_name), layer.mlp.down_proj):
                m.up.weight.normal_()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    before = ct.apply_coda(copy.deepcopy(ref), layers=False)
    assert all(type(ly) is type(ref.model.layers[0]) for ly in before.model.layers)
    assert_same_step(ref, before, input_ids=ids, labels=ids)
    after = copy.deepcopy(ref)  # the same adapters added after a layers=False patch
    for layer_p, layer_r in zip(after.model.layers, ref.model.layers):
        setattr(layer_p.self_attn, v_name, getattr(layer_r.self_attn, v_name).base_layer)
    after = ct.apply_coda(after, layers=False)
    for layer_p, layer_r in zip(after.model.layers, ref.model.layers):
        setattr(layer_p.self_attn, v_name, copy.deepcopy(getattr(layer_r.self_attn, v_name)))
    assert_same_step(ref, after, input_ids=ids, labels=ids)
    path = coda.last_path("LMHeadLoss")[0]
    assert path == ("kernel" if kernel else "reference") and not coda.last_path("DecoderLayer")
    with pytest.raises(v.CodaInputError, match=rf"{v_name} is a _LowRank"):
        ct.apply_coda(copy.deepcopy(ref))  # (the layers patched: refused, as above)


def test_a_peft_wrapper_has_its_model_patched():
    """A PEFT model (its wrapper class has ``get_base_model()``, emulated here: no download,
    no PEFT install) has the transformers model it wraps patched and is returned itself;
    with adapters in the layers the whole patch names them and says what works."""

    class PeftLike(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.base_model = model

        def get_base_model(self):
            return self.base_model

        def forward(self, *args, **kwargs):
            return self.base_model(*args, **kwargs)

    cfg = tiny_config()
    ref, _ = pair(cfg, seed=8)
    ref.model.layers[0].mlp.down_proj = _LowRank(ref.model.layers[0].mlp.down_proj)
    wrapped = PeftLike(copy.deepcopy(ref))
    with pytest.raises(v.CodaInputError, match=r"down_proj is a _LowRank.*layers=False"):
        ct.apply_coda(wrapped)
    assert ct.apply_coda(wrapped, layers=False) is wrapped
    assert wrapped.base_model.coda_method == "auto"
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert_same_step(ref, wrapped.base_model, input_ids=ids, labels=ids)
    assert wrapped(input_ids=ids, labels=ids).logits is None  # (coda's loss, through it)


def test_an_adapter_on_the_lm_head_is_refused_at_the_call():
    """coda's loss reads the LM head's weight alone: an adapter wrapped around lm_head after
    the patch (PEFT's way to train new tokens) is named at the training call, not left out."""
    cfg = tiny_config()
    _, patched = pair(cfg)
    patched.lm_head = _LowRank(patched.lm_head)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with pytest.raises(v.CodaInputError, match="lm_head is a _LowRank, not a plain"):
        _step(patched, input_ids=ids, labels=ids)
    with torch.no_grad():  # (HF's own forward, logits through the adapter: as unpatched)
        assert patched(input_ids=ids, labels=ids).logits is not None


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_peft_lora_trains_under_the_loss_alone(family):
    """With PEFT installed (not a dev dependency: skipped without it), a real LoRA model
    (``get_peft_model`` on q/v/down or Phi-3's fused projections) patched with
    ``layers=False``, before or after PEFT wraps it, trains as the unpatched LoRA model:
    loss and every trainable gradient; the whole patch names PEFT's linear."""
    peft = pytest.importorskip("peft")
    cfg = tiny_config(family)
    ref, _ = pair(cfg, seed=9)
    phi3 = family == "phi3"
    targets = ["qkv_proj", "gate_up_proj"] if phi3 else ["q_proj", "v_proj", "down_proj"]
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    want = peft.get_peft_model(copy.deepcopy(ref), lora)
    with pytest.raises(v.CodaInputError, match=r"is a peft\..*Linear, not a plain"):
        ct.apply_coda(copy.deepcopy(want))
    before = ct.apply_coda(copy.deepcopy(want), layers=False)
    after = peft.get_peft_model(ct.apply_coda(copy.deepcopy(ref), layers=False), lora)
    after.load_state_dict(want.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    loss = _step(want, input_ids=ids, labels=ids)
    grads = {n: p.grad for n, p in want.named_parameters() if p.grad is not None}
    assert len(grads) > 0
    for model in (before, after):
        assert rel_err(_step(model, input_ids=ids, labels=ids), loss) < TOL
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == grads.keys()
        for n, g in grads.items():
            assert rel_err(got[n], g, floor=float(g.abs().max())) < TOL, n
