"""``apply_coda(model, layers=False)`` on tiny random Hugging Face mixture-of-experts models
(Mixtral, Qwen2-MoE, Qwen3-MoE, Granite-MoE and Granite-MoE-Shared, whose logits are
divided by ``logits_scaling``): their decoder layers stay HF's, and the training call's loss
is coda's LM-head loss plus the router's load-balancing term, added as HF's forward adds it
(``coda._hf_forward._router_loss``). CPU, float64, coda's loss on its reference path and on
its kernel path through the tile interpreter: the loss, ``aux_loss`` and every gradient (the
routers' included) equal the unpatched model's, with the router term on or off, a padding
mask (the term's own mask) and ``num_items_in_batch``. The whole patch names what it lacks."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from hf_tiny import MOE, padded_batch  # noqa: E402
from test_transformers import TOL, assert_same_step, model_class, tiny_config  # noqa: E402

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402


def moe_model(family: str, **kw):
    """A tiny float64 MoE causal LM (``tiny_config``'s), seeded, its final norm's weight moved
    off its initial value (HF makes it 1, or 0 for a 1 + w gain: a lost gain would not show)."""
    cfg = tiny_config(family, **kw)
    torch.manual_seed(0)
    model = model_class(cfg)(cfg)
    with torch.no_grad():
        model.model.norm.weight.add_(0.3 * torch.randn_like(model.model.norm.weight))
    return model.double()


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("family", list(MOE))
def test_the_loss_alone_with_the_router_term_equals_unpatched(family, kernel, monkeypatch):
    if kernel:  # (coda's loss on its kernel path; the layers are HF's either way)
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    coda.env._LAST.clear()
    ref = moe_model(family, **({"vocab_size": 128} if kernel else {}))
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    batch = padded_batch(ref.config.vocab_size)
    ids = batch["input_ids"]
    try:
        out_r = ref(**batch)
    except AttributeError as e:  # transformers 5.17's Granite-MoE records no router logits
        # and its own forward then fails on the router term (5.24 and 5.25 do not): the
        # patched model fails alike, and the term-off checks below still run
        with pytest.raises(AttributeError, match=str(e)):
            patched(**batch)
    else:
        assert_same_step(ref, patched, **batch)
        assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")
        out_p = patched(**batch)
        assert out_p.logits is None and rel_err(out_p.aux_loss, out_r.aux_loss) < TOL
        assert len(out_p.router_logits) == len(out_r.router_logits)
    # the term off by the call, and the token count HF's Trainer passes
    assert_same_step(ref, patched, input_ids=ids, labels=ids, output_router_logits=False)
    assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")
    assert patched(input_ids=ids, labels=ids, output_router_logits=False).aux_loss is None
    n = torch.tensor(17.0, dtype=torch.float64)
    off = dict(output_router_logits=False)  # (the term on where HF's forward computes it)
    kw = {} if family in ("mixtral", "qwen2_moe", "qwen3_moe") else off
    assert_same_step(ref, patched, input_ids=ids, labels=ids, num_items_in_batch=n, **kw)


def test_the_whole_patch_of_a_moe_model_says_what_works():
    model = moe_model("mixtral")
    with pytest.raises(coda.CodaInputError, match=r"mixture of experts.*layers=False"):
        ct.apply_coda(model)
    ct.apply_coda(model, layers=False)  # (and then the loss alone is patched)
    assert model.coda_method == "auto"
