"""A patched Hugging Face model inside training machinery (tiny random Llama and Qwen3 models
built here, as in ``test_transformers.py``, whose helpers these tests use): through
``coda.nn.GraphedStep`` and CUDA-graph captures (emulated on the CPU where transformers 5.17's
capture behaviour matters), deep copies, HF's activation checkpointing, models made on the meta
device, and partial fine-tuning (frozen weights, adapters). CPU tests in float64 on the
reference path; ``gpu`` tests on the H200's kernel path."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import assert_compiled_graphs_train_as_eager, rel_err  # noqa: E402
from test_transformers import (  # noqa: E402
    SCALED_ROPES,
    TOL,
    _step,
    assert_same_step,
    model_class,
    pair,
    tiny_config,
)
from transformers import LlamaForCausalLM  # noqa: E402

import coda._hf_forward as hf_forward  # noqa: E402
import coda.autograd  # noqa: E402
import coda.transformers as ct  # noqa: E402
from coda import _validate as v  # noqa: E402


def _eager_steps_by_keyword(model, opt, batches) -> list:
    """The hand-written loop ``GraphedStep`` stands for, an HF model's way: the losses."""
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_graphed_step_trains_a_patched_model_by_keyword(family):
    """``coda.nn.GraphedStep`` with an HF model patched by ``apply_coda``: the batch by keyword,
    the loss from the output's ``.loss``; on the CPU every call eager, equal to the hand-written
    loop (losses and weights bitwise, float64)."""
    import coda.nn as cnn

    _, a = pair(tiny_config(family))
    b = copy.deepcopy(a)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 97, (2, 9), generator=g) for _ in range(4)]
    want = _eager_steps_by_keyword(a, torch.optim.AdamW(a.parameters(), lr=1e-2), batches)
    step = cnn.GraphedStep(b, torch.optim.AdamW(b.parameters(), lr=1e-2))
    got = [step(input_ids=ids, labels=ids) for ids in batches]
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert len({float(x) for x in got}) == len(got)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_deep_copy_of_a_patched_model_runs_its_own_weights():
    """``copy.deepcopy`` of a patched model (as ``GraphedStep`` users and the benchmarks make
    them): its forward, with labels and without, and its decoder stack's run the copy's
    weights, not the original's (the patched forwards hold no bound method of the original)."""
    _, a = pair(tiny_config())
    b = copy.deepcopy(a)
    with torch.no_grad():
        for p in b.parameters():
            p.mul_(1.5)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    for call in (
        lambda m: m(input_ids=ids).logits,
        lambda m: m(input_ids=ids, labels=ids).loss,
        lambda m: m.model(input_ids=ids).last_hidden_state,
    ):
        b_before = call(b)
        c = copy.deepcopy(b)  # the same weights as b: the same result
        assert torch.equal(call(c), b_before) and not torch.equal(call(a), b_before)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_patched_model_pickles(family, tmp_path):
    """``torch.save(model)`` / ``torch.load`` of a whole patched model (pickle): it comes back
    patched (the layers of the one patched class per HF class, sharing the model's mask hint;
    the forwards coda's: a training call returns the loss without logits), and its step gives
    the original's loss and gradients bitwise."""
    _, a = pair(tiny_config(family))
    torch.save(a, tmp_path / "model.pt")
    b = torch.load(tmp_path / "model.pt", weights_only=False)
    hf_class = type(b.model.layers[0]).coda_hf_class
    assert {type(layer) for layer in b.model.layers} == {ct.patched_class(hf_class)}
    assert all(layer.mask_hint is b.model.coda_mask_hint for layer in b.model.layers)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    assert b(input_ids=ids, labels=ids).logits is None
    assert torch.equal(_step(b, input_ids=ids, labels=ids), _step(a, input_ids=ids, labels=ids))
    got, want = ct.hf_gradients(b), ct.hf_gradients(a)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_model_pickled_before_its_final_norm_was_wrapped_still_trains(tmp_path):
    """A patched model pickled before session 84 has no wrapped final norm and a mask hint
    without ``layers``: its first training call wraps the norm (the loss applies it once),
    and its coda layers still refuse ``output_attentions``, as a model patched now does."""
    ref, a = pair(tiny_config())
    norm = a.model.norm
    del norm.forward, norm.coda_mask_hint, a.model.coda_mask_hint.layers  # (the old form)
    torch.save(a, tmp_path / "model.pt")
    b = torch.load(tmp_path / "model.pt", weights_only=False)
    assert "forward" not in b.model.norm.__dict__ and not b.model.coda_mask_hint.layers
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(8))
    assert rel_err(_step(b, input_ids=ids, labels=ids), _step(ref, input_ids=ids, labels=ids)) < TOL
    assert b.model.coda_mask_hint.layers and b.model.norm.coda_mask_hint is b.model.coda_mask_hint
    with pytest.raises(v.CodaInputError, match="output_attentions"):
        b(input_ids=ids, output_attentions=True)


def _cache(out):
    """The KV cache an HF output carries (``cache`` from transformers 5.3, else
    ``past_key_values``)."""
    return getattr(out, "cache" if "cache" in type(out).__dataclass_fields__ else "past_key_values")


def test_a_training_step_makes_no_kv_cache_unless_asked():
    """A training call (labels, autograd recording) fills no KV cache, which the unpatched
    model's default config makes in every forward; ``use_cache=True`` still gets one, and the
    loss is the same either way. With position ids (packed documents) the cache stays: without
    one, transformers masks attention at the documents' boundaries, with one it does not, so
    the cache decides the loss there (``test_padding_and_packed_sequences_behave_as_unpatched``
    compares it with the unpatched model's)."""
    ref, patched = pair(tiny_config())
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    assert _cache(ref(input_ids=ids, labels=ids)) is not None  # HF's default
    out = patched(input_ids=ids, labels=ids)
    asked = patched(input_ids=ids, labels=ids, use_cache=True)
    assert _cache(out) is None and _cache(asked) is not None
    assert torch.equal(out.loss, asked.loss)
    packed = torch.cat([torch.arange(4), torch.arange(5)])[None].expand(2, -1)
    assert _cache(patched(input_ids=ids, labels=ids, position_ids=packed)) is not None


def test_an_instance_forward_set_before_the_patch_still_runs():
    """A forward someone set on the instance before ``apply_coda`` (a hook library's wrapper)
    stays in the call chain: the patched forward calls it, with and without labels."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config()).double()
    seen = []
    own = model.forward

    def hooked(*args, **kwargs):
        seen.append(sorted(kwargs))
        return own(*args, **kwargs)

    model.forward = hooked
    ct.apply_coda(model)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    logits = model(input_ids=ids).logits
    assert seen == [["input_ids"]] and logits.shape == (2, 9, 97)
    model(input_ids=ids, labels=ids)  # the loss path runs coda's head, not the wrapped forward
    assert seen == [["input_ids"]]


def _emulate_a_5_17_capture(monkeypatch) -> list:
    """A CUDA-graph capture as transformers 5.17 sees it, on the CPU: a capture reported,
    transformers' causal-mask skip turned off (so it builds the tensor mask). Returns the list
    each SDPA call appends (its mask is None, its is_causal) to."""
    import transformers.masking_utils as mu

    calls = _sdpa_calls(monkeypatch)
    monkeypatch.setattr(mu, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    monkeypatch.setattr(hf_forward, "_capturing", lambda: True)
    return calls


def _sdpa_calls(monkeypatch) -> list:
    """The list each SDPA call appends (its mask is None, its is_causal) to."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_capture_keeps_sdpa_causal_where_the_mask_is_plain(family, monkeypatch):
    """Under a CUDA-graph capture transformers 5.17 hands SDPA the causal mask as a tensor
    (it takes the capture for a trace); the patched model's sdpa layers drop it, so SDPA runs
    ``is_causal`` as eagerly, only where nothing the caller gave shapes the mask. Emulated on
    the CPU: a capture reported, transformers' mask skip turned off; the same loss as the eager
    call, bitwise (float64, reference path)."""
    _, model = pair(tiny_config(family))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, labels=ids).loss
    calls = _emulate_a_5_17_capture(monkeypatch)
    got = model(input_ids=ids, labels=ids).loss
    assert calls == [(True, True)] * 2 and torch.equal(got, want)  # two layers, no mask
    calls.clear()
    model.model(input_ids=ids)  # the decoder stack alone (a patched LlamaModel / Qwen3Model)
    assert calls == [(True, True)] * 2
    for given in (
        {"attention_mask": torch.ones_like(ids)},
        {"position_ids": torch.arange(9).expand(2, 9)},
    ):
        calls.clear()
        model(input_ids=ids, labels=ids, **given)
        assert calls == [(False, False)] * 2, given  # the caller's mask inputs: kept
    monkeypatch.setattr(hf_forward, "_capturing", lambda: False)
    calls.clear()
    model(input_ids=ids, labels=ids)
    assert calls == [(False, False)] * 2  # no capture: transformers' mask, as it made it


@pytest.mark.parametrize("family", ["llama", "qwen3", "nanochat"])
def test_a_compiled_patched_model_keeps_sdpa_causal(family, monkeypatch):
    """Under torch.compile, transformers before torch 2.14 builds SDPA a tensor causal mask
    (``_ignore_causal_mask_sdpa`` declines the skip while tracing), which cost a compiled
    patched Llama 2.9x its attention time on the H100 (run 298). The patched sdpa layers drop
    that mask where nothing the caller gave shapes it, as under a capture: SDPA traced with no
    mask and ``is_causal`` (dynamo's eager backend, whole graph), the same loss as the
    uncompiled call; a caller's attention mask is kept. (NanoChat's: its embeddings' norm,
    a stand-in module made in the call, traced too.)"""
    _, model = pair(tiny_config(family))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, labels=ids).loss
    calls = _sdpa_calls(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    got = compiled(input_ids=ids, labels=ids).loss
    assert calls == [(True, True)] * 2 and torch.equal(got, want)  # two layers, no mask
    calls.clear()
    compiled(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
    assert calls == [(False, False)] * 2  # the caller's mask: transformers', as it made it
    torch._dynamo.reset()


def test_capture_keeps_a_sliding_window_mask(monkeypatch):
    """A Mistral model with a sliding window builds a windowed mask: under a capture it is
    not the plain causal one and stays (emulated as above; the same loss as eagerly)."""
    _, model = pair(tiny_config("mistral", sliding_window=4))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids, labels=ids).loss
    calls = _emulate_a_5_17_capture(monkeypatch)
    got = model(input_ids=ids, labels=ids).loss
    assert calls == [(False, False)] * 2 and torch.equal(got, want)


@pytest.mark.parametrize("family", ["llama", "qwen3", *SCALED_ROPES])
def test_a_model_patched_on_meta_and_loaded_matches(family):
    """A model made on the meta device (sharded before it is loaded, as FSDP2 recipes do) is
    patched there, given storage (``to_empty``) and loaded from an unpatched model's state
    dict: its RoPE inverse frequencies, which a meta buffer does not hold, come from the
    config as the model's rotary module computes them, and its step equals the unpatched
    model's (float64). The rotary module's own non-persistent buffer is transformers' to
    restore after ``to_empty``, as for an unpatched model."""
    extra = {"rope_parameters": SCALED_ROPES[family]} if family in SCALED_ROPES else {}
    cfg = tiny_config("qwen3" if family == "qwen3" else "llama", **extra)
    ref, patched = pair(cfg)
    with torch.device("meta"):
        model = model_class(cfg)(cfg).double()
    ct.apply_coda(model)
    model.to_empty(device="cpu")
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():  # (transformers' buffers, not coda's: as for an unpatched model)
        for name, buffer in ref.model.rotary_emb.named_buffers():
            model.model.rotary_emb.get_buffer(name).copy_(buffer)
    for mine, theirs in zip(model.model.layers, patched.model.layers):
        assert torch.equal(mine._inv_freq, theirs._inv_freq)
        assert mine.long_after == theirs.long_after  # (LongRoPE's, both sets in the tables)
        for key, table in theirs._rope_tables.items():
            assert torch.equal(mine._rope_tables[key], table), key
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(4))
    assert_same_step(ref, model, input_ids=ids, labels=ids)


def test_frozen_weights_stay_frozen(family="qwen3"):
    """Partial fine-tuning: an HF weight frozen before the patch (``requires_grad=False``)
    stays frozen in the coda weight it becomes (before this, every patched weight came back
    trainable: frozen layers trained), gets no gradient, and the trainable ones get the
    unpatched model's (float64); a fused coda weight made from HF weights frozen unalike is
    refused, naming them."""
    cfg = tiny_config(family)
    ref, _ = pair(cfg)
    for p in ref.model.layers[0].parameters():
        p.requires_grad_(False)
    last = ref.model.layers[1]
    for proj in (last.self_attn.q_proj, last.self_attn.k_proj, last.self_attn.v_proj):
        proj.weight.requires_grad_(False)
    last.mlp.down_proj.weight.requires_grad_(False)
    ref.model.embed_tokens.weight.requires_grad_(False)
    patched = ct.apply_coda(copy.deepcopy(ref))
    first, second = patched.model.layers
    assert not any(p.requires_grad for p in first.parameters())
    trainable = {n for n, p in second.named_parameters() if p.requires_grad}
    assert trainable == {"attention_norm", "w_o", "ffn_norm", "w_il", "q_norm", "k_norm"}
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)  # the same gradients, none more
    mixed = copy.deepcopy(ref)
    mixed.model.layers[1].mlp.up_proj.weight.requires_grad_(False)  # gate trainable, up not
    with pytest.raises(v.CodaInputError, match=r"layers\.1: mlp\.gate_proj.*partly frozen"):
        ct.apply_coda(mixed)


def _enable_checkpointing(model, reentrant: bool = False) -> None:
    """HF's activation checkpointing, by its current name (5.23 renamed it; 5.17 has the old)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _count_attention_calls(monkeypatch) -> list:
    """Each patched layer's attention as it is built for a forward (a recompute included)."""
    calls = []
    build = ct.CodaLlamaDecoderLayer._hf_attention

    def counted(self, *args, **kwargs):
        calls.append(self.self_attn.layer_idx)
        return build(self, *args, **kwargs)

    monkeypatch.setattr(ct.CodaLlamaDecoderLayer, "_hf_attention", counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gemma3"])
@pytest.mark.parametrize("enabled", ["before", "after", "after, reentrant"])
def test_hf_activation_checkpointing_recomputes_the_patched_layers(family, enabled, monkeypatch):
    """``model.gradient_checkpointing_enable()`` (the Trainer's ``gradient_checkpointing``)
    checkpoints the patched layers as HF's own, enabled before the patch or after it: each
    layer runs again in the backward (before this, a patched layer was not a
    ``GradientCheckpointingLayer`` and was silently left whole), and the loss and every
    gradient equal the unpatched checkpointed model's (float64, reference path)."""
    cfg = tiny_config(family)
    ref, _ = pair(cfg)
    ref.train()
    if enabled == "before":
        _enable_checkpointing(ref)
        patched = ct.apply_coda(copy.deepcopy(ref))
    else:  # (the Trainer's older default was the reentrant form)
        patched = ct.apply_coda(copy.deepcopy(ref))
        _enable_checkpointing(ref, reentrant="reentrant" in enabled)
        _enable_checkpointing(patched, reentrant="reentrant" in enabled)
    calls = _count_attention_calls(monkeypatch)
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    assert calls == [0, 1, 1, 0]  # the forward, then each layer recomputed in the backward
    calls.clear()
    patched.eval()  # (HF checkpoints in training mode only)
    _step(patched, input_ids=ids, labels=ids)
    assert calls == [0, 1]


def _takes_every_n_layers() -> bool:
    from transformers import PreTrainedModel

    enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None)
    return enable is not None and "every_n_layers" in inspect.signature(enable).parameters


@pytest.mark.skipif(not _takes_every_n_layers(), reason="transformers before 5.23")
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_checkpointing_every_n_layers_recomputes_those_patched_layers(
    family, offload, coda_path, monkeypatch
):
    """transformers 5.23's ``activation_checkpointing_enable(every_n_layers=2)`` checkpoints
    layers 0 and 2 of four, patched as HF's own: those two run again in the backward (on
    the kernel path their first forwards lean: no SwiGLU pre-activation stored), and the loss
    and every gradient equal the unpatched model's under the same call (float64, both
    paths). ``offload=True`` wraps each checkpoint in ``save_on_cpu``'s hooks, outside the
    checkpoint's own, by which coda's layers tell a checkpoint's first pass; HF pins that
    host memory, which a CPU-only torch cannot (HF's call fails there, patched or not), so
    here the hooks run unpinned."""
    import transformers.modeling_utils as modeling_utils
    from torch.autograd.graph import save_on_cpu

    if not torch.cuda.is_available():
        unpinned = lambda pin_memory, **kw: save_on_cpu(pin_memory=False, **kw)  # noqa: E731
        monkeypatch.setattr(modeling_utils, "save_on_cpu", unpinned)
    cfg = tiny_config(family, num_hidden_layers=4, **coda_path)
    ref, _ = pair(cfg)
    ref.train()
    patched = ct.apply_coda(copy.deepcopy(ref))
    for model in (ref, patched):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False},
            every_n_layers=2,
            offload=offload,
        )
    calls = _count_attention_calls(monkeypatch)
    lean = []  # the F4 launches that store no pre-activation
    real = coda.autograd.lib.gemm_swiglu_only
    monkeypatch.setattr(
        coda.autograd.lib, "gemm_swiglu_only", lambda *a: lean.append(1) or real(*a)
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    assert calls == [0, 1, 2, 3, 2, 0]  # the forward, then layers 2 and 0 recomputed
    assert len(lean) == (2 if coda_path else 0)  # layers 0 and 2's first forwards


def test_a_checkpointing_recompute_under_a_capture_keeps_sdpa_causal(monkeypatch):
    """Under a capture (emulated as in the test above: transformers 5.17's tensor mask) an
    activation-checkpointing recompute runs in the backward, after the forward that set the
    model's mask hint has returned; the verdict rides on the mask tensor, so the recompute
    also calls SDPA with no mask and ``is_causal``, as the first forward did."""
    _, model = pair(tiny_config())
    model.train()
    _enable_checkpointing(model)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _step(model, input_ids=ids, labels=ids)
    grads = {n: p.grad for n, p in model.named_parameters()}
    calls = _emulate_a_5_17_capture(monkeypatch)
    assert torch.equal(_step(model, input_ids=ids, labels=ids), want)
    assert calls == [(True, True)] * 4  # two layers' forwards, then their two recomputes
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, grads[n]), n


def _small_cuda_model(family: str, attn: str = "sdpa"):
    """The gpu tests' unpatched HF model: 2 layers, d = 256, V = 1024 (Qwen3 with head_dim
    64, as the protocol test's), bf16 on the GPU, seeded."""
    shape = dict(hidden_size=256, intermediate_size=512, vocab_size=1024, num_hidden_layers=2)
    head = {"head_dim": 64} if family == "qwen3" else {}
    cfg = tiny_config(family, **shape, **head, attn_implementation=attn)
    torch.manual_seed(0)
    return model_class(cfg)(cfg).to("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_gpu_hf_checkpointing_recomputes_the_kernel_path(family, monkeypatch):
    """H200: HF's activation checkpointing over a patched bf16 model on the kernel path: each
    layer recomputed in the backward, and (SDPA's math backend) the loss and every gradient
    bitwise the same step's without checkpointing: the recompute runs the same kernels (the
    first forward, storing stand-ins for what only the backward reads, the lean ones)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = ct.apply_coda(_small_cuda_model(family)).train()
    checkpointed = copy.deepcopy(plain)
    _enable_checkpointing(checkpointed)
    ids = torch.randint(0, 1024, (4, 256), device="cuda")
    calls = _count_attention_calls(monkeypatch)
    lean = []  # the F4 launches that store no pre-activation, one a layer's first forward
    real = coda.autograd.lib.gemm_swiglu_only
    monkeypatch.setattr(
        coda.autograd.lib, "gemm_swiglu_only", lambda *a: lean.append(1) or real(*a)
    )
    with sdpa_kernel(SDPBackend.MATH):
        want = _step(plain, input_ids=ids, labels=ids)
        assert calls == [0, 1] and not lean
        calls.clear()
        got = _step(checkpointed, input_ids=ids, labels=ids)
        assert calls == [0, 1, 1, 0] and len(lean) == 2
    assert torch.equal(got, want)
    grads = dict(checkpointed.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_graphed_step_trains_a_patched_model(family):
    """H200: a patched bf16 model trained through ``coda.nn.GraphedStep``, its batch by keyword
    and its loss from the output's ``.loss``, trains as the eager steps do over five steps
    (two eager, a capture, two replays): capturing proves the patched model's forward and
    backward free of host syncs with HF's sdpa attention. With SDPA's deterministic math
    backend every loss and every weight is bitwise the hand-written loop's (the patched
    layers drop the causal mask transformers 5.17 builds under a capture, so the captured
    step is the eager step's computation: run 78; before that, run 73, it was 1e-6 off after
    the capture); with the default backend the first call is bitwise and the rest agree to
    1e-5 (flash SDPA's backward need not be bitwise run to run). With HF's eager attention
    the capture fails (its mask building copies a host scalar): ``GraphedStep`` says so and
    keeps nothing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import coda.nn as cnn

    def models(attn):
        ref = _small_cuda_model(family, attn)
        return [ct.apply_coda(copy.deepcopy(ref)) for _ in range(2)]

    def adamw(model):
        lr = torch.tensor(1e-3, device="cuda")
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)

    def eager_and_graphed():
        a, b = models("sdpa")
        want = _eager_steps_by_keyword(a, adamw(a), batches)
        step = cnn.GraphedStep(b, adamw(b), warmup=2)
        got = [step(input_ids=ids, labels=ids) for ids in batches]
        assert step.graphed
        return torch.stack(want), torch.stack(got), a, b

    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 1024, (4, 256), generator=g).cuda() for _ in range(5)]
    with sdpa_kernel(SDPBackend.MATH):
        want, got, a, b = eager_and_graphed()
    assert torch.equal(got, want)
    for (name, p), q in zip(b.named_parameters(), a.parameters()):
        assert torch.equal(p, q), name
    want, got, a, b = eager_and_graphed()
    assert torch.equal(got[0], want[0])  # the first call: the same kernels on the same weights
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for (name, p), q in zip(b.named_parameters(), a.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    _, eager = models("eager")
    step = cnn.GraphedStep(eager, adamw(eager), warmup=1)
    step(input_ids=batches[0], labels=batches[0])
    with pytest.raises(RuntimeError, match="could not be captured as a CUDA graph"):
        step(input_ids=batches[1], labels=batches[1])
    assert not step.graphed


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_patched_model_trains_under_torch_compiles_cuda_graphs(family):
    """H200: a patched bf16 model under ``torch.compile(mode="reduce-overhead")`` (HF's sdpa
    attention, batch by keyword, loss from ``.loss``) trains as the eager patched model over
    four AdamW steps (losses and gradients to the glue's bf16 rounding), no CUDA graph
    skipped: HF's mask building and coda's ops trace into graphs Inductor records."""
    eager = ct.apply_coda(_small_cuda_model(family))
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 1024, (4, 256), generator=g).cuda() for _ in range(4)]

    def loss_of(run, ids):
        return run(input_ids=ids, labels=ids).loss

    assert_compiled_graphs_train_as_eager(eager, batches, loss_of)


@pytest.mark.parametrize("layers", [True, False], ids=["whole", "loss-alone"])
def test_a_training_call_that_raises_leaves_the_final_norm_applied(layers):
    """The training call's loss applies the final norm, so the stack's own call of it passes
    through for that call only (``_hf_forward.base_forward``): the module stays in the model
    throughout (its state-dict key with it), and a call that raises inside the stack leaves
    no pass-through behind. After one, the stack's output, generation's logits and the next
    training step are the unpatched model's."""
    ref = model_class(tiny_config())(tiny_config()).double()
    with torch.no_grad():
        ref.model.norm.weight.add_(0.3)  # (a skipped norm would show)
    patched = ct.apply_coda(copy.deepcopy(ref), layers=layers)
    norm = patched.model.norm
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(6))
    seen = []

    def check_then_raise(module, args, output):
        seen.append(patched.model.norm is norm and "model.norm.weight" in patched.state_dict())
        raise RuntimeError("out of memory (a test's)")

    hook = patched.model.layers[-1].register_forward_hook(check_then_raise)
    with pytest.raises(RuntimeError, match="a test's"):
        patched(input_ids=ids, labels=ids)
    hook.remove()
    assert seen == [True]
    x = torch.randn(2, 9, ref.config.hidden_size, dtype=torch.float64)
    assert torch.equal(patched.model.norm(x), ref.model.norm(x))  # (called alone)
    want = ref.model(input_ids=ids).last_hidden_state
    assert rel_err(patched.model(input_ids=ids).last_hidden_state, want) < TOL
    with torch.no_grad():
        assert rel_err(patched(input_ids=ids).logits, ref(input_ids=ids).logits) < TOL
    assert (
        rel_err(_step(patched, input_ids=ids, labels=ids), _step(ref, input_ids=ids, labels=ids))
        < TOL
    )
