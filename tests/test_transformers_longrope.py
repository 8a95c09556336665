"""LongRoPE (Phi-3.5-mini's and Phi-3's 128k models' RoPE, transformers' ``longrope``) through
``apply_coda``: two sets of inverse frequencies, the long one for every call whose largest
position reaches the original context length, decided per call over the whole batch (HF's
rule: ``max(position_ids) + 1 > original_max_position_embeddings``), and cos and sin scaled
by a constant, folded into the attention's scale as YaRN's. On the CPU in float64, on coda's
reference path and its kernel path (the tile interpreter): the patched model's step equals
the unpatched model's on each side of the threshold, packed documents (a long row of short
documents: the short set), a batch of a short and a long row (the long set for both),
generation across the threshold, and a model patched after a long call (HF's buffer then
holds the long set). The layers' choice is one device tensor per step (no host sync)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from test_transformers import TOL, assert_same_step, model_class, tiny_config  # noqa: E402

import coda.transformers as ct  # noqa: E402
from coda import _validate as v  # noqa: E402
from coda.nn import DecoderLayer  # noqa: E402

AFTER = 8  # the original context: calls reaching position 8 take the long set
ROPE = dict(
    rope_type="longrope", factor=4.0, rope_theta=1e4, original_max_position_embeddings=AFTER
)


def _models(family: str, seed: int = 0, **kw):
    if family == "phi3":  # (Phi-3's config keeps the original context at its top level)
        kw["original_max_position_embeddings"] = AFTER
    cfg = tiny_config(family, rope_parameters=ROPE, **kw)
    torch.manual_seed(seed)
    ref = model_class(cfg)(cfg).double()
    return cfg, ref


def _calls(vocab: int) -> dict:
    """Training calls of 12 tokens on either side of the threshold."""
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
    packed = torch.cat([torch.arange(5), torch.arange(7)])  # positions 0-6: short
    return {
        "long (positions 0-11)": dict(input_ids=ids, labels=ids),
        "short (12 tokens, packed documents)": dict(
            input_ids=ids, position_ids=packed[None].expand(2, -1), labels=ids
        ),
        "long (one row short, one long)": dict(
            input_ids=ids, position_ids=torch.stack([packed, torch.arange(12)]), labels=ids
        ),
        "short (8 tokens: positions 0-7)": dict(input_ids=ids[:, :8], labels=ids[:, :8]),
        "long (9 tokens: position 8)": dict(input_ids=ids[:, :9], labels=ids[:, :9]),
    }


@pytest.mark.parametrize("family", ["phi3", "llama"])
def test_longrope_model_matches_unpatched_float64(family, coda_path):
    cfg, ref = _models(family, **coda_path)
    patched = ct.apply_coda(copy.deepcopy(ref))
    layer = patched.model.layers[0]
    assert layer.long_after == AFTER and layer.rope_scale == ref.model.rotary_emb.attention_scaling
    assert layer.rope_scale > 1.0  # (sqrt(1 + ln 4 / ln 8): folded into the attention's scale)
    for name, batch in _calls(cfg.vocab_size).items():
        with torch.no_grad():
            kw = {k: t for k, t in batch.items() if k != "labels"}
            assert rel_err(patched(**kw).logits, ref(**kw).logits) < TOL, name
        assert_same_step(ref, patched, **batch)
    # generation across the threshold: positions 5-10, the new tokens' q and k rotated by the
    # long set from position 8 on beside keys cached under the short one (HF's behavior)
    ids = _calls(cfg.vocab_size)["long (positions 0-11)"]["input_ids"][:, :5]
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=6, do_sample=False)
        assert torch.equal(patched.generate(ids, max_new_tokens=6, do_sample=False), want)


def test_the_sets_matter():
    """A patched model that kept one set would fail the comparison above: each set alone
    misses the unpatched model on the calls of the other side by far more than round-off."""
    cfg, ref = _models("phi3")
    patched = ct.apply_coda(copy.deepcopy(ref))
    calls = _calls(cfg.vocab_size)
    for layer in patched.model.layers:  # the long set never: only the short one
        layer.long_after = 10**6
    with torch.no_grad():
        batch = calls["long (positions 0-11)"]
        assert rel_err(patched(batch["input_ids"]).logits, ref(batch["input_ids"]).logits) > 1e-4
    for layer in patched.model.layers:  # the long set always
        layer.long_after = 1
    batch = calls["short (12 tokens, packed documents)"]
    with torch.no_grad():
        kw = {k: t for k, t in batch.items() if k != "labels"}
        assert rel_err(patched(**kw).logits, ref(**kw).logits) > 1e-4


def test_patched_after_a_long_call():
    """HF's rotary module keeps the set of its last call in its ``inv_freq`` buffer: a model
    patched after a long call still takes the short set as its base and both sets."""
    cfg, ref = _models("phi3", seed=1)
    batch = _calls(cfg.vocab_size)["long (positions 0-11)"]
    fresh = ct.apply_coda(copy.deepcopy(ref))
    with torch.no_grad():
        ref(batch["input_ids"])  # the long set now in HF's buffer
    assert not torch.equal(ref.model.rotary_emb.inv_freq, ref.model.rotary_emb.original_inv_freq)
    patched = ct.apply_coda(copy.deepcopy(ref))
    for mine, theirs in zip(patched.model.layers, fresh.model.layers):
        assert torch.equal(mine._inv_freq, theirs._inv_freq)
        assert torch.equal(mine._long_inv_freq, theirs._long_inv_freq)
    for batch in _calls(cfg.vocab_size).values():
        assert_same_step(ref, patched, **batch)


def test_the_choice_is_one_device_table_per_step():
    """``DecoderLayer``'s LongRoPE: the kernel path's table for a call is the long or the
    short one by the call's largest position, one tensor for every layer given the same
    positions (the backward's cos/sin, remembered per table, then built once a step), the
    short one for an empty call; the arguments checked."""
    hd = 8
    short = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)
    long = short / torch.tensor([1.0, 2.0, 8.0, 32.0], dtype=torch.float64)
    kw = dict(head_dim=hd, dtype=torch.float64, inv_freq=short)
    layers = [DecoderLayer(32, 4, 2, 40, **kw, long_inv_freq=long, long_after=6) for _ in "ab"]
    plain = DecoderLayer(32, 4, 2, 40, **kw)
    dev = torch.device("cpu")
    for positions, use_long in (([0, 1, 2, 3, 4, 5], False), ([0, 1, 2, 0, 1, 6], True)):
        pos = layers[0]._positions(torch.tensor(positions), 1, 6, dev)
        tables = [layer._freq_table(dev, pos) for layer in layers]
        assert tables[0] is tables[1]
        want = layers[0]._freq_table(dev) if not use_long else None
        if use_long:
            long_only = DecoderLayer(32, 4, 2, 40, head_dim=hd, dtype=torch.float64, inv_freq=long)
            want = long_only._freq_table(dev)
        assert torch.equal(tables[0], want)
        assert torch.equal(plain._freq_table(dev, pos), plain._freq_table(dev))
        inv = layers[0]._inverse_frequencies(dev, pos)
        assert torch.equal(inv, long if use_long else short)
    empty = layers[0]._positions(torch.zeros(2, 0, dtype=torch.long), 2, 0, dev)
    assert torch.equal(layers[0]._freq_table(dev, empty), layers[0]._freq_table(dev))
    for bad, match in (
        (dict(long_inv_freq=long), "give both"),
        (dict(long_after=6), "give both"),
        (dict(long_inv_freq=long[:3], long_after=6), r"long_inv_freq: expected shape \(head_dim"),
        (dict(long_inv_freq=long, long_after=0), "long_after: must be a positive integer"),
    ):
        with pytest.raises(v.CodaInputError, match=match):
            DecoderLayer(32, 4, 2, 40, **kw, **bad)


def test_dynamic_rope_is_refused():
    cfg = tiny_config(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4))
    model = model_class(cfg)(cfg)
    with pytest.raises(v.CodaInputError, match="rope_type='dynamic' is not supported"):
        ct.apply_coda(model)
