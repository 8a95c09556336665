"""``CausalLM.logits`` and ``LMHeadLoss.logits``: the logits an evaluation or a sampler reads
(the training loss never forms them) are HF's ``LlamaForCausalLM``'s from the same weights,
and the loss is their cross-entropy (float64, CPU: the reference path, and the kernel path's
layers through the tile interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_tiny import model_class, tiny_config

import coda
import coda.nn as cnn

F64 = torch.float64
# the HF tests' tiny Llama (its vocabulary of 16-byte rows, for the kernel path's TMA rule)
CONFIG = tiny_config("llama", vocab_size=128, attn_implementation="eager")
SHAPE = dict(
    vocab=CONFIG.vocab_size, d=CONFIG.hidden_size, n_layers=CONFIG.num_hidden_layers,
    n_heads=CONFIG.num_attention_heads, n_kv_heads=CONFIG.num_key_value_heads,
    ffn=CONFIG.intermediate_size, eps=CONFIG.rms_norm_eps,
)  # fmt: skip


def _hf_twin(model: cnn.CausalLM):
    """The HF ``LlamaForCausalLM`` of ``CONFIG``, loaded from ``model``'s HF state dict."""
    hf = model_class(CONFIG)(CONFIG).to(F64)
    hf.load_state_dict(model.hf_state_dict(), strict=True)
    return hf.eval()


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_causal_lm_logits_are_hfs_and_the_loss_their_cross_entropy(path, monkeypatch):
    if path == "kernel":  # the layers' kernel sequence, its GEMMs through the interpreter
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    torch.manual_seed(0)
    model = cnn.CausalLM(**SHAPE, dtype=F64)
    tokens = torch.randint(0, SHAPE["vocab"], (2, 11))
    targets = torch.randint(0, SHAPE["vocab"], (2, 11))
    with torch.no_grad():
        logits = model.logits(tokens)
        want = _hf_twin(model)(tokens).logits
        loss = model(tokens, targets)
    assert coda.last_path("DecoderLayer")[0] == path
    assert logits.shape == (2, 11, SHAPE["vocab"]) and logits.dtype == F64
    # HF forms RoPE's cos and sin in fp32 whatever the model's dtype (coda in float64): the
    # logits agree to that precision (4.4e-8 of logits up to 0.52 here; a lost norm moves them
    # ~1e-2)
    torch.testing.assert_close(logits, want, rtol=0.0, atol=1e-6)
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, ce, rtol=1e-12, atol=0.0)


def test_lm_head_logits_carry_the_soft_cap():
    """With ``softcap`` c the logits are c tanh(l / c), the ones the capped loss is of."""
    torch.manual_seed(1)
    head = cnn.LMHeadLoss(32, 64, dtype=F64, softcap=0.1)
    plain = cnn.LMHeadLoss(32, 64, dtype=F64)
    plain.load_state_dict(head.state_dict())
    x, t = torch.randn(3, 5, 32, dtype=F64), torch.randint(0, 64, (3, 5))
    with torch.no_grad():
        capped = head.logits(x)
        torch.testing.assert_close(capped, 0.1 * torch.tanh(plain.logits(x) / 0.1))
        assert capped.abs().max() < 0.1 < plain.logits(x).abs().max()
        ce = F.cross_entropy(capped.flatten(0, 1), t.flatten(), reduction="sum")
        torch.testing.assert_close(head(x, t, reduction="sum"), ce, rtol=1e-12, atol=0.0)


def test_logits_name_a_bad_input():
    head = cnn.LMHeadLoss(32, 64, dtype=F64)
    with pytest.raises(coda.CodaInputError, match=r"LMHeadLoss.logits: x must be .* d = 32"):
        head.logits(torch.randn(3, 16, dtype=F64))
    model = cnn.CausalLM(**SHAPE, dtype=F64)
    with pytest.raises(coda.CodaInputError, match=r"tokens: ids must be in \[0, 128\)"):
        model.logits(torch.full((1, 4), 128))
