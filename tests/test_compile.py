"""torch.compile over coda (CPU reference path, in CI): a whole ``coda.nn.CausalLM`` and a
Hugging Face Llama patched by ``coda.transformers.apply_coda`` trace into one graph with no
graph break (``torch._dynamo.explain``), ``fullgraph=True`` compiles them, the compiled step's
loss and gradients equal the eager step's, and with dynamic shapes new batch sizes and
sequence lengths do not recompile, and Dynamo meets none of coda's host caches. (The kernel
path's custom ops under torch.compile: ``test_custom_ops.py``.)"""

from __future__ import annotations

import pytest
import torch
from conftest import no_cache_warnings_from_dynamo, rel_err

import coda.nn as cnn


def _model():
    torch.manual_seed(0)
    return cnn.CausalLM(64, 32, 2, 4, 2, 48, dtype=torch.float32)


def _batch(b, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, s), generator=g), torch.randint(0, 64, (b, s), generator=g)


def test_causal_lm_traces_without_graph_breaks():
    with no_cache_warnings_from_dynamo():
        explained = torch._dynamo.explain(_model())(*_batch(2, 8))
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_compiled_step_equals_eager_and_does_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for b, s in ((2, 8), (3, 11), (4, 5)):  # (dynamo specializes sizes 0 and 1 by design)
        tok, tgt = _batch(b, s, seed=b * 100 + s)
        results = []
        for run in (model, compiled):
            model.zero_grad(set_to_none=True)
            loss = run(tok, tgt)
            loss.backward()
            results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        for a, e in zip(*results):
            assert rel_err(a, e, floor=1e-6) < 1e-5
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == [frames[0]] * 3  # no recompile for new token counts


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_patched_hf_model_traces_without_graph_breaks(family):
    pytest.importorskip("transformers")
    from test_transformers import model_class, tiny_config

    import coda.transformers as ct

    cfg = tiny_config(family)
    torch.manual_seed(0)
    model = ct.apply_coda(model_class(cfg)(cfg))
    ids = torch.randint(0, 97, (2, 9))
    with no_cache_warnings_from_dynamo():
        explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
