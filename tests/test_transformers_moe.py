"""``apply_coda`` on tiny random Hugging Face mixture-of-experts models. With
``layers=False`` (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite-MoE and Granite-MoE-Shared, whose
logits are divided by ``logits_scaling``, ...) their decoder layers stay HF's, and the
training call's loss is coda's LM-head loss plus the router's load-balancing term, added as
HF's forward adds it (``coda._hf_forward._router_loss``). CPU, float64, coda's loss on its
reference path and on its kernel path through the tile interpreter: the loss, ``aux_loss``
and every gradient (the routers' included) equal the unpatched model's, with the router term
on or off, a padding mask (the term's own mask) and ``num_items_in_batch``. The whole patch
(``_hf_families.MOE_LAYERS``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) makes each layer's
attention sublayer coda's, the norm before the experts and the experts the model's own
modules (``DecoderLayer(mlp=)``; that norm on the kernel path coda's row passes of its
weight): logits, steps padded and packed, generation, the router term and the state dict as
the unpatched model's; the families it does not take name why."""

from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from hf_tiny import MOE, padded_batch  # noqa: E402
from test_transformers import (  # noqa: E402
    TOL,
    assert_behaves_as_unpatched,
    assert_same_step,
    model_class,
    pair,
    tiny_config,
)

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


@pytest.mark.parametrize("family", ["gpt_oss", "laguna", "qwen3_next"])
def test_the_whole_patch_of_a_moe_model_it_lacks_says_what_works(family):
    """GPT-OSS (attention sinks), Laguna (a gated attention output) and Qwen3-Next (linear
    attention): the loss alone."""
    model = moe_model(family)
    with pytest.raises(coda.CodaInputError, match=r"mixture of experts.*layers=False"):
        ct.apply_coda(model)
    ct.apply_coda(model, layers=False)  # (and then the loss alone is patched)
    assert model.coda_method == "auto"


# the families of ``MOE_LAYERS`` whose layers the whole patch takes (by ``tiny_config`` name):
# Mixtral's, Qwen2-MoE's (a shared expert beside the routed ones; q, k, v biases), Qwen3-MoE's
# (QK-norm) each through every check; the others (OLMoE's QK-norm over the whole q and k,
# GLM-4.5's partial RoPE and first dense layer, Hunyuan's QK-norm after RoPE, ...) a padded step
WHOLE = ["mixtral", "qwen2_moe", "qwen3_moe"]
STEP = ["olmoe", "ernie4_5_moe", "minimax_m2", "mellum", "glm4_moe", "hunyuan_moe", "solar_open"]
# Granite-MoE's (its experts ``block_sparse_moe``; Granite-MoE-Shared's a shared MLP beside
# them) with Granite's multipliers away from 1 (``hf_tiny.GRANITE_KW``)
STEP += ["granitemoe", "granitemoeshared"]


@pytest.mark.parametrize("family", WHOLE)
def test_moe_layers_behave_as_unpatched_float64(family, coda_path):
    cfg = tiny_config(family, **coda_path)
    ref, patched = pair(cfg)
    # pickled whole, as ``torch.save(model)``, the experts with it (before a call: a called
    # MoE model, patched or not, holds HF's output-recording hooks, which pickle refuses)
    buffer = io.BytesIO()
    torch.save(patched, buffer)
    layers = patched.model.layers
    assert all(isinstance(la, ct.CodaLlamaDecoderLayer) and la.mlp_module for la in layers)
    assert all(type(la.mlp) is type(r.mlp) for la, r in zip(layers, ref.model.layers))
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))
    out_r, out_p = ref(**padded_batch(cfg.vocab_size)), patched(**padded_batch(cfg.vocab_size))
    assert rel_err(out_p.aux_loss, out_r.aux_loss) < TOL  # (the routers saw the same inputs)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded.model.layers[0]) is type(patched.model.layers[0])
    assert_same_step(ref, loaded, **padded_batch(cfg.vocab_size))


@pytest.mark.parametrize("family", STEP)
def test_moe_layers_take_a_padded_step_as_unpatched_float64(family, coda_path):
    cfg = tiny_config(family, **coda_path)
    ref, patched = pair(cfg)
    # a layer of experts keeps them; a dense one (GLM-4.5's and ERNIE 4.5's first) is coda's
    layers = [
        (la.mlp_module, hasattr(getattr(r, "mlp", None), "down_proj"))
        for la, r in zip(patched.model.layers, ref.model.layers)
    ]
    assert (True, False) in layers and all(experts != dense for experts, dense in layers)
    assert_same_step(ref, patched, **padded_batch(cfg.vocab_size))


def test_attention_weights_the_layer_would_not_apply_are_refused_named():
    """A weight in an attention module beyond its projections and QK-norm (Laguna's output
    gate, GPT-OSS's sinks) is refused before anything changes: it would be lost."""
    model = moe_model("mixtral")
    model.model.layers[1].self_attn.g_proj = torch.nn.Linear(4, 4)
    with pytest.raises(coda.CodaInputError, match=r"layers\.1\.self_attn has weights .*g_proj"):
        ct.apply_coda(model)
    assert not any(isinstance(la, ct.CodaLlamaDecoderLayer) for la in model.model.layers)


def test_the_norm_before_the_experts_is_coda_s_row_passes_on_the_kernel_path(monkeypatch):
    """On the kernel path each MoE layer's norm before the experts runs as coda's row passes
    of its weight (``DecoderLayer.rows_norm``: HF's module is not called; its gradient is the
    row passes', the float64 step as the unpatched model's: the parity tests above), on the
    reference path as HF's module; and the bench's ``hf_coda_eager_experts_norm`` row (the
    form before session 82) calls HF's module again on the kernel path, to the same step."""
    from benchmarks import bench_hf

    cfg = tiny_config("qwen3_moe", vocab_size=128)
    ref, patched = pair(cfg)
    calls = []
    for layer in patched.model.layers:
        layer.post_attention_layernorm.register_forward_hook(lambda *a: calls.append(1))
    batch = padded_batch(cfg.vocab_size)
    patched(**batch)  # the reference path (the CPU's default): HF's module, once a layer
    assert len(calls) == cfg.num_hidden_layers
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    calls.clear()
    assert_same_step(ref, patched, **batch)
    assert coda.last_path("DecoderLayer")[0] == "kernel" and not calls
    monkeypatch.setenv("CODA_HF_PEERS", "hf_coda_eager_experts_norm")
    [(_, make)] = bench_hf.variants("qwen3_moe", ref, None)
    eager = make()
    for layer in eager.model.layers:
        layer.post_attention_layernorm.register_forward_hook(lambda *a: calls.append(1))
    assert_same_step(ref, eager, **batch)
    assert coda.last_path("DecoderLayer")[0] == "kernel" and calls


def test_the_patch_adds_no_graph_break_to_a_moe_model():
    """Under ``torch._dynamo.explain`` a tiny Qwen3-MoE breaks where transformers' own code
    does (its output recorders' ``ContextVar``, the experts' data-dependent shapes); the
    whole patch adds none: the training call's frame holds no ``try`` block around the stack
    (where Dynamo cannot resume after a break inside it: session 82 counted one more, named
    ``step_unsupported``)."""
    from conftest import no_cache_warnings_from_dynamo

    ref = moe_model("qwen3_moe")
    patched = ct.apply_coda(copy.deepcopy(ref))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    counts = []
    for model in (ref, patched):
        torch._dynamo.reset()
        with no_cache_warnings_from_dynamo():
            explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
        counts.append(explained.graph_break_count)
        reasons = [str(b.reason) for b in explained.break_reasons]
    assert counts[0] > 0  # (transformers' own breaks, which the count compares against)
    assert counts[1] <= counts[0], reasons
    assert not any("step_unsupported" in r for r in reasons), reasons
