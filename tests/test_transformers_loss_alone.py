"""``apply_coda(model, layers=False)`` on tiny random Hugging Face dense models: Granite (its
``logits_scaling``, logits / s, folded into the final norm's gain in fp32) and OLMo 2 / OLMo 3
(their final norm scales by its weight in fp32 and rounds once,
``coda._hf_forward.FP32_SCALED_NORMS``), whose layers are coda's too since sessions 74-75, and
the families whose layers are not (``LOSS_ALONE``). CPU, float64, coda's loss on its reference
path and on its kernel path through the interpreter: the loss and every gradient equal the
unpatched model's. Gemma has its own file (``test_transformers_gemma.py``: its gain's
precision), the mixture-of-experts models theirs (``test_transformers_moe.py``)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from hf_tiny import LOSS_ALONE, padded_batch  # noqa: E402
from test_transformers import assert_same_step, model_class, tiny_config  # noqa: E402

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402


def tiny(family: str, **kw):
    cfg = tiny_config(family, **kw)
    torch.manual_seed(0)
    model = model_class(cfg)(cfg)
    with torch.no_grad():  # (HF makes the norms' weights 1: a lost weight would not show)
        model.model.norm.weight.normal_(1.0, 0.3)
    return model.double()


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("family", ["granite", "olmo2", "olmo3", *LOSS_ALONE])
def test_the_loss_alone_equals_unpatched(family, kernel, monkeypatch):
    if kernel:
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    ref = tiny(family, vocab_size=128)
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    batch = padded_batch(128)
    ids = batch["input_ids"]
    assert_same_step(ref, patched, **batch)
    assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")
    with torch.no_grad():  # (without labels: HF's own logits, as before)
        assert torch.equal(patched(input_ids=ids).logits, ref(input_ids=ids).logits)


@pytest.mark.parametrize("family", ["olmo2", "gpt_oss", "gemma4", "qwen3_next"])
def test_bf16_loss_rounds_its_final_norm_as_the_model_does(family):
    """OLMo's, GPT-OSS's and Gemma 4's final norm in bf16 (the product with its weight in fp32,
    rounded once; Gemma 4's logits not capped here), Qwen3-Next's (1 + w in fp32, rounded
    once): coda's reference path computes the same loss as HF's bitwise, which Llama's
    rounding (the normed rows rounded, then the product) would not."""
    cap = {"final_logit_softcapping": None} if family == "gemma4" else {}
    ref = tiny(family, vocab_size=128, **cap).to(torch.bfloat16)
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(2))
    loss_r = ref(input_ids=ids, labels=ids).loss
    loss_p = patched(input_ids=ids, labels=ids).loss
    assert coda.last_path("LMHeadLoss")[0] == "reference"
    assert torch.equal(loss_p, loss_r.to(loss_p.dtype))


def test_a_stray_logits_scaling_is_ignored_as_its_model_ignores_it():
    assert tiny("granite").config.logits_scaling == 4.0
    # a config of another family carrying the attribute: its forward ignores it, so does coda
    cfg = tiny_config("llama", logits_scaling=4.0)
    torch.manual_seed(0)
    ref = model_class(cfg)(cfg).double()
    patched = ct.apply_coda(copy.deepcopy(ref))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


def test_a_final_norm_coda_does_not_know_is_refused_before_patching():
    """A final norm of another form (here a LayerNorm put in the RMSNorm's place) would make
    coda's loss compute another model's: refused by ``apply_coda``, named, nothing patched."""
    model = tiny("olmo2")
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size).double()
    with pytest.raises(coda.CodaInputError, match=r"a final norm LayerNorm is not supported"):
        ct.apply_coda(model, layers=False)
    assert not hasattr(model, "coda_method")


def test_a_final_norm_that_rounds_as_another_form_is_refused():
    """A norm class that looks like Llama's (a ``variance_epsilon``) but rounds as OLMo's (the
    product with its weight in fp32, rounded once) would train on the wrong rounding, which no
    float64 test sees: ``check_final_norm`` runs a bf16 copy of it against coda's form and
    refuses it, named, nothing patched; a model on the meta device is taken by class."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class RoundsOnceRMSNorm(LlamaRMSNorm):
        def forward(self, h):
            hf = h.float()
            hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
            return (self.weight * hf).to(h.dtype)

    model = tiny("llama")
    model.model.norm = RoundsOnceRMSNorm(model.config.hidden_size).double()
    with pytest.raises(
        coda.CodaInputError, match=r"RoundsOnceRMSNorm does not compute coda's 'llama'"
    ):
        ct.apply_coda(model, layers=False)
    assert not hasattr(model, "coda_method")
    cfg = tiny_config("llama")
    with torch.device("meta"):
        on_meta = model_class(cfg)(cfg)
    ct.apply_coda(on_meta, layers=False)  # (its class is Llama's: its norm is not run)
    assert on_meta.coda_method == "auto"
