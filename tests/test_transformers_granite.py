"""``apply_coda(model, layers=False)`` on a tiny random Hugging Face Granite model: its layers
(residual multipliers on both branches) stay HF's, and the training call's loss is coda's
LM-head loss with Granite's ``logits_scaling`` (logits / s) folded into the final norm's gain,
in fp32 (``coda._hf_forward.final_norm``). CPU, float64, coda's loss on its reference path and
on its kernel path through the interpreter: the loss and every gradient equal the unpatched
model's. The Granite MoE families run in ``test_transformers_moe.py``."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from test_transformers import assert_same_step, model_class, tiny_config  # noqa: E402

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402


def granite(**kw):
    cfg = tiny_config("granite", **kw)
    torch.manual_seed(0)
    return model_class(cfg)(cfg).double()


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_the_loss_alone_with_scaled_logits_equals_unpatched(kernel, monkeypatch):
    if kernel:
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    ref = granite(vocab_size=128)
    assert ref.config.logits_scaling == 4.0
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    assert_same_step(ref, patched, input_ids=ids, attention_mask=mask, labels=labels)
    assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")
    with torch.no_grad():  # (without labels: HF's scaled logits, as before)
        assert torch.equal(patched(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_granite_whole_patch_and_a_stray_logits_scaling_are_handled():
    with pytest.raises(coda.CodaInputError, match=r"residual multipliers.*layers=False"):
        ct.apply_coda(granite())
    # a config of another family carrying the attribute: its forward ignores it, so does coda
    cfg = tiny_config("llama", logits_scaling=4.0)
    torch.manual_seed(0)
    ref = model_class(cfg)(cfg).double()
    patched = ct.apply_coda(copy.deepcopy(ref))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
