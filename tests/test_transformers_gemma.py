"""``apply_coda(model, layers=False)`` on tiny random Hugging Face Gemma, Gemma 2 and Gemma 3
(text) models: their decoder layers and scaled token embedding stay HF's, and the training
call's loss is coda's LM-head loss with Gemma's final norm, whose gain 1 + w is formed in fp32
and applied before the output's one rounding (``coda._hf_forward.final_norm``,
``coda.reference.final_norm_ref``). CPU: float64, coda's loss on its reference path and on its
kernel path through the tile interpreter, the loss and every gradient equal the unpatched
model's; bf16, the kernel path's loss and final-norm gradient no further from the float64
model than the unpatched bf16 model's, where a bf16 gain would be further. What the whole patch
lacks, and Gemma 2's logit soft-capping, are named."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from test_transformers import _step, assert_same_step, model_class, tiny_config  # noqa: E402

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402

FAMILIES = ["gemma", "gemma2", "gemma3"]


def gemma_model(family: str, dtype=torch.float64, w_std: float = 0.5, **kw):
    """A tiny ``family`` causal LM in ``dtype``, seeded, every norm's weight w drawn with
    standard deviation ``w_std`` (HF makes them 0: a gain 1 + w of 1 would hide a lost w)."""
    cfg = tiny_config(family, **kw)
    torch.manual_seed(0)
    model = model_class(cfg)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, w_std)
    return model.to(dtype)


def _kernel_path(monkeypatch) -> None:
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_alone_equals_unpatched_float64(family, kernel, monkeypatch):
    if kernel:  # (coda's loss on its kernel path; the layers are HF's either way)
        _kernel_path(monkeypatch)
    coda.env._LAST.clear()
    ref = gemma_model(family, **({"vocab_size": 128} if kernel else {}))
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    V = ref.config.vocab_size
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # (right padding: left-padded rows attend to nothing, NaN in HF's
    # float64 eager attention, Gemma 2's)
    labels = ids.masked_fill(mask == 0, -100)
    assert_same_step(ref, patched, input_ids=ids, attention_mask=mask, labels=labels)
    assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")
    assert patched(input_ids=ids, labels=labels).logits is None  # (a training call: no logits)
    n = torch.tensor(17.0, dtype=torch.float64)
    assert_same_step(ref, patched, input_ids=ids, labels=ids, num_items_in_batch=n)
    with torch.no_grad():  # (evaluation and generation: HF's own logits, as before)
        assert torch.equal(patched(input_ids=ids).logits, ref(input_ids=ids).logits)
    # the scaled token embedding stays HF's class (coda's would drop its sqrt(d) scale)
    assert type(patched.model.embed_tokens) is type(ref.model.embed_tokens)


@pytest.mark.parametrize("method", ["scaled_exp", "recompute", "chunked"])
@pytest.mark.parametrize("family", ["gemma", "gemma3"])
def test_bf16_loss_keeps_the_gain_in_fp32(family, method, monkeypatch):
    """bf16 models, coda's loss on its kernel path (the interpreter): the loss and the final
    norm's weight gradient no further from the float64 model's than the unpatched bf16
    model's (at 1.05x: one sample of each error), with a gain 1 + w whose w is small, as a
    trained model's can be: rounded to bf16 the gain would lose most of w (2^-8 near 1),
    which the first assertion catches (tried: a bf16 gain errs 5-30x more on the loss)."""
    _kernel_path(monkeypatch)
    ref = gemma_model(family, torch.bfloat16, w_std=0.02, vocab_size=256, hidden_size=64)
    ref64 = copy.deepcopy(ref).double()
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False, method=method)
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(2))
    l64, l16, lc = (_step(m, input_ids=ids, labels=ids) for m in (ref64, ref, patched))
    assert coda.last_path("LMHeadLoss")[0] == "kernel"
    assert abs(float(lc) - float(l64)) <= 1.05 * abs(float(l16) - float(l64)) + 1e-4, (
        float(lc - l64),
        float(l16 - l64),
    )
    g64, g16, gc = (m.model.norm.weight.grad for m in (ref64, ref, patched))
    assert gc.dtype == torch.bfloat16
    assert rel_err(gc, g64) <= 1.05 * rel_err(g16, g64) + 1e-3


def test_an_fp32_gain_with_bf16_rows_is_refused_by_neither_path(monkeypatch):
    """``lm_head_loss`` with bf16 rows and an fp32 gain (the reference path multiplied them into
    an fp32 product before the bf16 GEMM and failed deep in torch, before): both paths apply
    the gain in fp32 and round once; its gradient returns in fp32. Another dtype is named."""
    from coda.nn import lm_head_loss
    from coda.reference import cross_entropy_ref, final_norm_ref

    torch.manual_seed(3)
    x = torch.randn(21, 32, dtype=torch.bfloat16)
    w = (0.2 * torch.randn(32, 64)).bfloat16()
    gain = (1 + 0.01 * torch.randn(32)).requires_grad_()
    t = torch.randint(0, 64, (21,))
    want = cross_entropy_ref(final_norm_ref(x, gain, 1e-6) @ w, t, -100, "mean")
    got = lm_head_loss(x, gain, w, t, eps=1e-6, backend="reference")
    assert torch.equal(got, want)
    _kernel_path(monkeypatch)
    (grad,) = torch.autograd.grad(lm_head_loss(x, gain, w, t, eps=1e-6, backend="kernel"), gain)
    (want_grad,) = torch.autograd.grad(want, gain)
    assert grad.dtype == torch.float32 and rel_err(grad, want_grad) < 2e-2
    with pytest.raises(coda.CodaInputError, match=r"gamma: dtype must be x's .*float16"):
        lm_head_loss(x, gain.detach().half(), w, t)


def test_what_the_patch_does_not_take_is_named():
    model = gemma_model("gemma3")
    with pytest.raises(coda.CodaInputError, match=r"GeGLU.*layers=False"):
        ct.apply_coda(model)
    capped = gemma_model("gemma2", final_logit_softcapping=30.0)
    with pytest.raises(coda.CodaInputError, match=r"final_logit_softcapping=30\.0"):
        ct.apply_coda(capped, layers=False)
    with pytest.raises(coda.CodaInputError, match=r"Gemma3ForCausalLM"):  # the list of loss-only
        ct.apply_coda(torch.nn.Linear(2, 2))
