"""``apply_coda`` on tiny random Hugging Face SmolLM3 models (Llama's layer, with RoPE left out
of some layers: ``no_rope_layers``, every fourth in SmolLM3-3B, every second here), on the CPU
in float64 (coda's reference path, and with ``coda_path`` the kernel path through the tile
interpreter). A NoPE layer is coda's layer with zero inverse frequencies: RoPE at angle 0,
cos 1 and sin 0, is the identity exactly, on both paths, so no kernel changes."""

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
    pair,
    tiny_config,
)

import coda.transformers as ct  # noqa: E402


def test_patched_smollm3_matches_unpatched_float64(coda_path):
    cfg = tiny_config("smollm3", num_hidden_layers=4, **coda_path)
    ref, patched = pair(cfg)
    assert [layer.use_rope for layer in patched.model.layers] == [True, False, True, False]
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def test_a_nope_layer_is_not_rotated(coda_path):
    """The NoPE layers' verdict matters: the same patched model with RoPE forced back on them
    (their inverse frequencies the rotating layers') no longer matches; and a sliding window
    on some layers (SmolLM3's ``layer_types``) keeps the model's own masks."""
    cfg = tiny_config("smollm3", **coda_path)
    ref, patched = pair(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    rotated = copy.deepcopy(patched)
    nope = rotated.model.layers[1]
    nope.use_rope = True
    nope._inv_freq = rotated.model.layers[0]._inv_freq.clone()
    nope._rope_tables.clear()
    with torch.no_grad():
        assert rel_err(patched(ids).logits, ref(ids).logits) < TOL
        assert rel_err(rotated(ids).logits, ref(ids).logits) > 1e-3
    window = tiny_config(
        "smollm3",
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        **coda_path,
    )
    ref, patched = pair(window, seed=2)
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    assert ct.CodaLlamaDecoderLayer in type(patched.model.layers[0]).__mro__
