"""How the benchmarks build and measure their peers and variants, on the CPU: Liger's patch
bound around its own steps only, peak memory taken with one model resident (``PeakAlone``),
the switched-off variants restoring their switches, the torch-embedding variant, and the
mixed-precision variants of the model and HF suites (fp32 parameters under bf16 autocast).
The figures need the GPU; these rules do not."""

from __future__ import annotations

import pytest
import torch


def test_liger_switch_binds_the_patch_around_its_own_steps_only():
    import types

    from benchmarks.bench_hf import LigerSwitch

    module = types.ModuleType("fake_modeling")

    class CausalLM:
        def forward(self):
            return "hf"

    CausalLM.__module__ = module.__name__
    module.CausalLM, module.rope = CausalLM, "hf rope"

    def apply(model):  # rebinds a class method and a module name, adds a name
        module.CausalLM.forward = lambda self: "liger"
        module.rope, module.extra = "liger rope", 1

    seen = []
    liger = LigerSwitch(module, apply)
    liger.patch(model=None)
    assert CausalLM().forward() == "hf" and module.rope == "hf rope"
    assert not hasattr(module, "extra")
    theirs = liger.wrap(lambda: seen.append((CausalLM().forward(), module.rope, module.extra)))
    theirs()
    assert seen == [("liger", "liger rope", 1)]
    assert CausalLM().forward() == "hf" and module.rope == "hf rope"
    assert not hasattr(module, "extra")


def test_peak_alone_counts_the_model_and_its_step_not_other_residents():
    from unittest import mock

    from benchmarks._common import PeakAlone, own_bytes

    model = torch.nn.Linear(64, 32)  # 64*32 + 32 fp32 values
    tied = torch.nn.Module()
    tied.a, tied.b = model, model  # a storage counted once
    assert own_bytes(model) == own_bytes(tied) == (64 * 32 + 32) * 4
    gib = 2**30
    fake = {"memory_allocated": 10 * gib, "max_memory_allocated": 13 * gib}
    with mock.patch.multiple(
        torch.cuda,
        synchronize=lambda: None,
        reset_peak_memory_stats=lambda: None,
        memory_allocated=lambda: fake["memory_allocated"],
        max_memory_allocated=lambda: fake["max_memory_allocated"],
    ):
        with PeakAlone(model) as mem:
            pass
    # 3 GiB above everything resident on entry, plus the model's own weights
    assert mem.gib == pytest.approx(3 + own_bytes(model) / gib)


def test_peak_alone_collects_first_and_refuses_a_block_that_freed_what_was_resident():
    """Garbage of an earlier model is collected before the entry's reading; a block that
    ends with less allocated than it began (something resident freed inside it, so its peak
    would understate the step's) raises instead of giving a figure, beyond a slack a small
    cache's turnover stays under; one that raised keeps its own error."""
    import gc
    from unittest import mock

    from benchmarks._common import PeakAlone

    gib = 2**30
    calls, allocated = [], iter([10 * gib, 8 * gib])
    with (
        mock.patch.multiple(
            torch.cuda,
            synchronize=lambda: None,
            reset_peak_memory_stats=lambda: None,
            memory_allocated=lambda: next(allocated),
            max_memory_allocated=lambda: 12 * gib,
        ),
        mock.patch.object(gc, "collect", lambda: calls.append("collect")),
    ):
        with pytest.raises(RuntimeError, match="2.00 GiB resident on entry was freed"):
            with PeakAlone(torch.nn.Linear(2, 2)):
                assert calls == ["collect"]
        allocated = iter([10 * gib, 10 * gib - PeakAlone.SLACK])
        with PeakAlone(torch.nn.Linear(2, 2)) as mem:
            pass
        assert mem.gib == pytest.approx(2, abs=1e-6)
        allocated = iter([10 * gib, 8 * gib])
        with pytest.raises(ValueError, match="the step's own"):
            with PeakAlone(torch.nn.Linear(2, 2)):
                raise ValueError("the step's own")


def test_a_switched_off_variant_sees_its_switches_off_and_restores_them():
    """``without_plan_tapes`` / ``without_direct_triton`` / ``without_row_kernels`` /
    ``storing_for_backward`` run their call with the switches off and put back what was
    there, also when the call raises."""
    from benchmarks._switches import (
        storing_for_backward,
        without_direct_triton,
        without_plan_tapes,
        without_row_kernels,
    )
    from coda import _autograd_support, ops
    from coda.kernels import _triton, drope, norm_rows

    switches = [
        (ops, "PLAN_TAPES"),
        (_triton, "FAST_LAUNCH"),
        (norm_rows, "TRITON"),
        (drope.cached_head_rotation, "enabled"),
        (_autograd_support, "LEAN_FORWARD"),
    ]
    seen = []

    def call():
        seen.append([getattr(o, n) for o, n in switches])
        raise KeyError

    variants = (
        without_plan_tapes,
        without_direct_triton,
        without_row_kernels,
        storing_for_backward,
    )
    for variant in variants:
        with pytest.raises(KeyError):
            variant(call)()
    off = [
        [False, True, True, True, True],
        [True, False, True, True, True],
        [True, True, False, False, True],
        [True, True, True, True, False],
    ]
    assert seen == off
    assert all(getattr(o, n) is True for o, n in switches)


@pytest.mark.parametrize("tied", [False, True])
def test_the_torch_embedding_variant_keeps_the_model_and_its_weight(tied):
    """The model suite's ``coda_torch_embedding`` variant: the same model, its embedding
    torch's ``nn.Embedding`` holding the same parameter (so its step differs only in the
    embedding's backward on the GPU, and a tied LM head stays tied)."""
    import copy
    import warnings

    import coda.nn as cnn
    from benchmarks import bench_step

    torch.manual_seed(0)
    model = cnn.CausalLM(64, 16, 1, 2, 1, 24, head_dim=8, dtype=torch.float64, tie_embeddings=tied)
    other = copy.deepcopy(model)
    bench_step._torch_embedding(other)
    assert type(model.embed) is cnn.Embedding and type(other.embed) is torch.nn.Embedding
    assert (other.head.weight is other.embed.weight) == tied
    assert torch.equal(other.embed.weight, model.embed.weight)
    t = torch.randint(0, 64, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference path's one-time notice on the CPU
        losses = [m(t, t) for m in (model, other)]
    assert torch.equal(*losses)
    for loss in losses:
        loss.backward()
    assert torch.equal(other.embed.weight.grad, model.embed.weight.grad)
    # one parameter table, not the swapped-out one beside it
    assert len(list(other.parameters())) == len(list(model.parameters()))


def test_amp_variant_runs_fp32_parameters_under_bf16_autocast(monkeypatch):
    """The model suite's ``CODA_MODEL_AMP=1`` variant: ``Autocast`` calls its model inside a
    bf16 autocast region on the parameters' device, weight-cast cache off, and nothing
    outside it; a coda model's fp32 parameters and their gradients stay fp32 (the
    optimizer's master weights) while its loss comes from bf16 compute (its bf16 copy's
    within bf16's rounding, not the fp32 model's own)."""
    import copy
    import warnings

    from benchmarks import bench_step
    from benchmarks._common import mixed_precision

    monkeypatch.delenv("CODA_MODEL_AMP", raising=False)
    assert not mixed_precision("CODA_MODEL_AMP")
    monkeypatch.setenv("CODA_MODEL_AMP", "1")
    assert mixed_precision("CODA_MODEL_AMP")

    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))

        def forward(self, x, scale=1.0):
            region = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
            seen.append((*region, torch.is_autocast_cache_enabled()))
            return (self.w * x).sum() * scale

    assert bench_step.Autocast(Probe())(torch.ones(2), scale=2.0).item() == 4.0
    assert seen == [(True, torch.bfloat16, False)] and not torch.is_autocast_enabled("cpu")

    cfg = dict(vocab=64, d=16, layers=2, heads=2, kv_heads=1, hd=8, ffn=24, batch=2, seq=5)
    fp32 = bench_step.build_model(cfg, torch.float32, device="cpu")
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    amp = bench_step.Autocast(fp32)
    t = torch.randint(0, 64, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference path's one-time notice on the CPU
        loss, copy_loss, own_loss = amp(t, t), bf16(t, t), fp32(t, t)
    assert abs(loss.item() - copy_loss.item()) <= 1e-3 * abs(copy_loss.item())
    assert not torch.equal(loss, own_loss)
    loss.backward()
    assert list(amp.parameters()) == list(fp32.parameters())
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in amp.parameters())


def test_hf_amp_step_runs_its_forward_under_bf16_autocast_and_its_backward_outside(monkeypatch):
    """``CODA_HF_AMP``: 0 / 1 / unset read as off / on / off, anything else raises; the HF
    suite's step with ``amp`` calls the model inside ``bf16_autocast`` and runs the loss's
    backward outside it, as HF's Trainer with ``bf16=True`` does."""
    import types

    from benchmarks import _common, bench_hf

    monkeypatch.delenv("CODA_HF_AMP", raising=False)
    assert not _common.mixed_precision("CODA_HF_AMP")
    monkeypatch.setenv("CODA_HF_AMP", "1")
    assert _common.mixed_precision("CODA_HF_AMP")
    monkeypatch.setenv("CODA_HF_AMP", "yes")
    with pytest.raises(ValueError, match="CODA_HF_AMP: must be 0 or 1"):
        _common.mixed_precision("CODA_HF_AMP")

    seen = []

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("backward", torch.is_autocast_enabled("cpu")))
            return g

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, input_ids, labels):
            seen.append(("forward", torch.is_autocast_enabled("cpu"), labels is input_ids))
            return types.SimpleNamespace(loss=Backward.apply(self.w * input_ids).sum())

    model, ids = Model(), torch.arange(3.0)
    for amp in (True, False):
        seen.clear()
        bench_hf._step(model, ids, amp)()
        assert seen == [("forward", amp, True), ("backward", False)]
        assert torch.equal(model.w.grad, ids)


def test_the_storing_checkpointed_variant_stores_in_the_first_forward(monkeypatch):
    """``bench_step``'s ``coda_checkpointed_storing`` (``Storing``): the checkpointed model's
    first forward runs F4 storing u, as before session 64, where the plain checkpointed model
    runs the lean F4; both reruns store it, and the two steps' gradients are the same (the
    kernel path forced on the CPU)."""
    import coda.env
    import coda.nn as cnn
    from benchmarks.bench_step import Storing
    from coda.kernels import library as lib

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    calls = []
    for name, keeps in (("gemm_swiglu", True), ("gemm_swiglu_only", False)):
        real = getattr(lib, name)
        monkeypatch.setattr(
            lib, name, lambda *a, _f=real, _k=keeps, **k: calls.append(_k) or _f(*a, **k)
        )
    torch.manual_seed(0)
    kw = dict(vocab=128, d=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn=40, dtype=torch.float64)
    model = cnn.CausalLM(**kw, checkpoint=True)
    tokens, targets = torch.randint(0, 128, (2, 5)), torch.randint(0, 128, (2, 5))
    grads = []
    for variant in (model, Storing(model)):
        model.zero_grad(set_to_none=True)
        calls.clear()
        variant(tokens, targets).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert calls == [variant is not model, True]  # (the first forward, then the rerun)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def _tiny_hf_base(name: str, dtype=torch.float32):
    """(family, model) of ``bench_hf.SHAPES[name]`` at a tiny width, built as the suite builds
    it, on the CPU."""
    from benchmarks import bench_hf

    family, shape = bench_hf.SHAPES[name]
    kv = shape["num_key_value_heads"]  # (as the shape groups its heads: 4 query heads)
    kv = 4 if kv == shape["num_attention_heads"] else min(kv, 2)
    dims = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1)
    dims.update(head_dim=16, num_attention_heads=4, num_key_value_heads=kv)
    dims.update({k: 8 for k in ("sliding_window",) if k in shape})
    dims.update({"pad_token_id": 0} if "pad_token_id" in shape else {})
    torch.manual_seed(0)
    return family, bench_hf.build(family, {**shape, **dims}, "cpu", dtype)


def test_every_hf_shape_builds_and_each_coda_variant_patches_it():
    """``bench_hf``: every shape (at a tiny width, on the CPU's reference path) builds its
    model class and config, and each coda variant patches it as the suite would (Gemma 3's
    the loss alone) and takes a training step."""
    pytest.importorskip("transformers")
    from benchmarks import bench_hf

    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    for name in bench_hf.SHAPES:
        family, base = _tiny_hf_base(name)
        made = {label: make for label, make in bench_hf.variants(family, base, None)}
        for label in ("hf_coda", "hf_coda_checkpointed", "hf_coda_torch_embedding"):
            model = made[label]()
            assert getattr(model, "coda_method", None) == "auto", (name, label)
            model(input_ids=ids, labels=ids).loss.backward()
            assert model.lm_head.weight.grad is not None, (name, label)


def test_the_compiled_coda_variant_steps_as_the_uncompiled_one(monkeypatch):
    """``hf_coda_compiled``: the patched model with its decoder stack under ``torch.compile``
    (Inductor on the GPU; here ``aot_eager``: the trace is what this checks, and Inductor's
    CPU compile took 30 s with a cold cache, session 78); for Gemma 3, whose loss alone coda
    takes, its loss and every gradient are the uncompiled patched model's in float64, to the
    fp32 roundings of HF's own layers (Gemma's norms compute in fp32 whatever the model's
    dtype; Inductor fused them in another order: 3e-7 of the largest gradient), while with the
    final norm run twice, as it would be were coda's swap of it to land on the compiled
    wrapper, they differ by 1.8 and the loss by 7e-4 (the final norm's gain moved off 1, so
    that the loss tells it too)."""
    pytest.importorskip("transformers")
    from benchmarks import bench_hf

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: compile_(m, backend="aot_eager", **kw))

    family, base = _tiny_hf_base("gemma-3-1B", torch.float64)
    with torch.no_grad():
        base.model.norm.weight.uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(2))
    made = dict(bench_hf.variants(family, base, None))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    steps = []
    for label in ("hf_coda", "hf_coda_compiled"):
        model = made[label]()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        steps.append((model, loss))
    (eager, want), (compiled, got) = steps
    assert isinstance(compiled.model, torch._dynamo.eval_frame.OptimizedModule)
    assert getattr(compiled, "coda_method", None) == "auto"
    torch.testing.assert_close(got, want, rtol=1e-8, atol=0)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert (q.grad - p.grad).abs().max() <= 2e-6 * p.grad.abs().max(), name


def test_the_hf_flex_variants_run_only_when_named(monkeypatch):
    """``bench_hf.variants``: the flex-attention rows (``ON_REQUEST_PEERS``) stay out of a
    default run and, named in ``CODA_HF_PEERS``, build the model switched to flex attention
    and then patched by coda (its layers' attention is the model's configured function)."""
    pytest.importorskip("transformers")
    from hf_tiny import TINY

    from benchmarks import bench_hf

    shape = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    base = bench_hf.build("llama", shape, "cpu", torch.float32)
    monkeypatch.delenv("CODA_HF_PEERS", raising=False)
    default = [name for name, _ in bench_hf.variants("llama", base, None)]
    assert "hf_coda" in default and not set(default) & set(bench_hf.ON_REQUEST_PEERS)
    monkeypatch.setenv("CODA_HF_PEERS", "hf_coda_flex")
    [(name, make)] = bench_hf.variants("llama", base, None)
    model = make()
    assert name == "hf_coda_flex" and model.config._attn_implementation == "flex_attention"
    assert type(model.model.layers[0]).__module__.startswith("coda")


def test_the_hf_liger_peers_may_be_named_for_a_family_liger_lacks(monkeypatch):
    """``bench_hf.variants`` without a Liger patch of the family (``liger`` None, as for
    Arcee's or Apertus's): a ``CODA_HF_PEERS`` naming ``hf_liger`` runs the other named peers
    (run 317 lost a whole suite to the ValueError), and a name no peer has still raises."""
    pytest.importorskip("transformers")
    from hf_tiny import TINY

    from benchmarks import bench_hf

    shape = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    base = bench_hf.build("llama", shape, "cpu", torch.float32)
    monkeypatch.setenv("CODA_HF_PEERS", "hf,hf_coda,hf_liger")
    assert [name for name, _ in bench_hf.variants("llama", base, None)] == ["hf", "hf_coda"]
    monkeypatch.setenv("CODA_HF_PEERS", "hf,hf_ligr")
    with pytest.raises(ValueError, match="hf_ligr"):
        bench_hf.variants("llama", base, None)
