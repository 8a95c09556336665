"""torch.compile over coda (CPU reference path, in CI): a whole ``coda.nn.CausalLM`` and a
Hugging Face Llama patched by ``coda.transformers.apply_coda`` trace into one graph with no
graph break (``torch._dynamo.explain``), ``fullgraph=True`` compiles them, the compiled step's
loss and gradients equal the eager step's, and with dynamic shapes new batch sizes and
sequence lengths do not recompile, and Dynamo meets none of coda's host caches. (The kernel
path's custom ops under torch.compile: ``test_custom_ops.py``.)"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import assert_compiled_graphs_train_as_eager, no_cache_warnings_from_dynamo, rel_err

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


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen3",
        "qwen2",
        "llama-bias",
        "phi3",
        "smollm3",
        "ministral",
        "phi3-longrope",
        "gemma",
        "gemma2",
        "gemma3",
        "glm4",
        "exaone4",
        "olmo2",
        "phi4-mini",
        "granite",
        "hunyuan_dense",
        "arcee",
        "ministral3",
        "llama-loss-alone",
        "gemma3-loss-alone",
        "gemma2-capped-loss-alone",
    ],
)
def test_patched_hf_model_traces_without_graph_breaks(family):
    """``gemma``: Gemma's layers (GeGLU, the 1 + w gains formed in the traced call);
    ``gemma2``, ``gemma3``: theirs (the norms after each sublayer: the post-norm row passes'
    ops; Gemma 2's soft-capped eager attention, Gemma 3's QK-norm and RoPE per layer type);
    ``glm4``: GLM-4's (partial RoPE of adjacent pairs: zero frequencies past them);
    ``exaone4``: EXAONE 4's (no norms before the sublayers: gains of 1 formed in the trace);
    ``olmo2``: OLMo 2's (its QK-norm over the whole q and k: the row passes' torch ops);
    ``phi4-mini``: Phi-4-mini's RoPE on 3/4 of each head (LongRoPE's c kept off the others);
    ``granite``: Granite's residual multipliers (and its embedding's and logits' scales);
    ``hunyuan_dense``: Hunyuan's QK-norm after RoPE (the gains after F1's unit-gain norm);
    ``arcee``: Arcee's MLP without a gate (relu^2); ``ministral3``: Llama 4's attention
    temperature on q (from the positions, in the traced attention call);
    ``*-loss-alone``: ``apply_coda(layers=False)``, HF's layers around coda's loss (Gemma 3's
    final-norm gain 1 + w formed in the traced call; Gemma 2's soft-capped logits);
    ``phi3-longrope``: LongRoPE's choice of
    frequency set, made on the device, traced. Skipped where the unpatched model itself
    breaks (transformers 5.17's LongRoPE picks its set on the host)."""
    pytest.importorskip("transformers")
    from hf_tiny import SCALED_ROPES
    from test_transformers import model_class, tiny_config

    import coda.transformers as ct

    if family == "phi3-longrope":  # (a 9-token call past its original context of 8)
        rope = SCALED_ROPES["longrope-rope"]
        cfg = tiny_config("phi3", rope_parameters=rope, original_max_position_embeddings=8)
    elif family == "gemma2-capped-loss-alone":  # (its logits soft-capped in coda's loss)
        cfg = tiny_config("gemma2", final_logit_softcapping=30.0)
    else:
        cfg = tiny_config(family.removesuffix("-loss-alone"))
    torch.manual_seed(0)
    unpatched = model_class(cfg)(cfg)
    model = ct.apply_coda(copy.deepcopy(unpatched), layers=not family.endswith("-loss-alone"))
    ids = torch.randint(0, 97, (2, 9))
    with no_cache_warnings_from_dynamo():
        explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    if explained.graph_break_count:  # (the unpatched model traced only then: half the time)
        theirs = torch._dynamo.explain(unpatched)(input_ids=ids, labels=ids).graph_break_count
        if theirs:  # (transformers 5.17 picks LongRoPE's set on the host: its own break)
            pytest.skip(f"the unpatched model breaks {theirs} times in this transformers")
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]


class _KernelStep(torch.nn.Module):
    """A layer and the LM-head loss on the kernel path (on the CPU its epilogue programs run
    through the tile interpreter, the Triton-less row passes through their torch forms)."""

    def __init__(self, dtype=torch.float64, device=None, **layer_options):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.layer = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, **kw, **layer_options)
        self.head = cnn.LMHeadLoss(40, 128, **kw)

    def forward(self, x, t):
        h = self.layer._kernel_forward(x).reshape(-1, 40)
        return self.head._kernel_loss(h, t.reshape(-1), "mean")


@pytest.mark.parametrize(
    "how, options",
    [
        ("mark_dynamic", {}),
        ("dynamic=True", {}),
        # Gemma's layer: GeGLU through the custom ops' ``act``, the fp32 gains 1 + w
        ("mark_dynamic", {"activation": "gelu_tanh", "norm_offset": 1.0}),
        # Gemma 3's: the norms after each sublayer (their row passes' ops), QK-norm
        (
            "mark_dynamic",
            {"activation": "gelu_tanh", "norm_offset": 1.0, "post_norms": True, "qk_norm": True},
        ),
    ],
    ids=["mark_dynamic", "dynamic=True", "mark_dynamic-gemma", "mark_dynamic-gemma3"],
)
def test_kernel_path_compiles_once_for_every_token_count(how, options):
    """The kernel path under torch.compile: one compile serves four token counts (the wgrad
    tiles keyed by the token count are chosen inside their custom op, the RoPE tables are
    built when the layer is made, not in the first traced call; a float module attribute
    made symbolic by dynamic=True is first used outside the autograd Functions), and the
    compiled step equals the eager one (float64, round-off)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = _KernelStep(**options)
    if options:  # (gains away from 0: a lost w would show)
        with torch.no_grad():
            for g in model.layer._norm_gains():
                g.uniform_(-0.5, 0.5)
    counter = CompileCounterWithBackend("aot_eager")
    dynamic = True if how == "dynamic=True" else None
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=dynamic)
    frames = []
    for b, s in ((2, 9), (3, 11), (4, 5), (5, 7)):
        g = torch.Generator().manual_seed(b * 100 + s)
        x = torch.randn(b, s, 40, dtype=torch.float64, generator=g)
        t = torch.randint(0, 128, (b, s), generator=g)
        t[:, ::4] = -100
        results = []
        for run in (model, compiled):
            model.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            if how == "mark_dynamic":
                for tensor in (xi, t):
                    torch._dynamo.mark_dynamic(tensor, 0)
                    torch._dynamo.mark_dynamic(tensor, 1)
            with no_cache_warnings_from_dynamo():
                loss = run(xi, t)
            loss.backward()
            results.append([loss.detach(), xi.grad] + [p.grad for p in model.parameters()])
        for a, e in zip(*results):
            assert rel_err(a, e, floor=1e-300) < 1e-12
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == [frames[0]] * 4, frames  # compiled once, then reused


def test_layer_builds_its_rope_tables_when_made_and_moved():
    """A call never fills the layer's RoPE tables (inside a compiled step that would change
    what its guards saw): they exist for the weights' device once the layer is made, and are
    rebuilt when it is moved or cast."""
    layer = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=torch.float32)
    keys = set(layer._rope_tables)
    assert keys == {("freq", torch.device("cpu")), ("inv_freq", torch.device("cpu"))}
    before = layer._rope_tables[("freq", torch.device("cpu"))]
    layer.double()
    assert set(layer._rope_tables) == keys
    assert torch.equal(layer._rope_tables[("freq", torch.device("cpu"))], before)
    x = torch.randn(1, 3, 40, dtype=torch.float64)
    layer._kernel_forward(x)
    assert set(layer._rope_tables) == keys


def _errors(stderr: str) -> str:
    """A child's exception lines (the traceback's last lines may be a long IR dump)."""
    return "\n".join(ln for ln in stderr.splitlines() if "Error" in ln)[-3000:]


# a fresh process: Inductor's lowering table is global, and an earlier compile in the same
# process would have filled it through the implicit path this test is about
_NO_IMPLICIT_FALLBACKS = """
import torch, torch._inductor.config as ic
from coda.autograd import Embedding
from test_compile import _KernelStep

class Step(_KernelStep):  # the kernel-path step above, fed by coda's embedding function
    def __init__(self):
        super().__init__(dtype=torch.float32)
        self.embed = torch.nn.Parameter(torch.randn(128, 40))

    def forward(self, tok, t):
        return super().forward(Embedding.apply(tok, self.embed, -1), t)

torch.manual_seed(0)
model = Step()
tok, t = torch.randint(0, 128, (2, 9)), torch.randint(0, 128, (2, 9))
with ic.patch(implicit_fallbacks=False, force_disable_caches=True):
    torch.compile(model, fullgraph=True)(tok, t).backward()
assert model.embed.grad is not None
print("compiled")
"""


def test_inductor_never_takes_its_implicit_fallback_for_a_coda_op():
    """Inductor lowers coda's ops through the fallbacks coda registers when they are first
    traced, never through its implicit path, whose eager formatting of the arguments' IR did
    not end in 400 s at the Llama-1B shape on torch 2.11 (``coda.kernels.op_support``). With
    Inductor's implicit fallbacks switched off, a kernel-path step (embedding, layer, LM head:
    forward and backward ops) compiles with the default backend and runs."""
    proc = subprocess.run(
        [sys.executable, "-c", _NO_IMPLICIT_FALLBACKS],
        capture_output=True, text=True, timeout=300, cwd=os.path.dirname(__file__),
    )  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, _errors(proc.stderr)


_DEEP_MODEL_ON_GPU = """
import torch, torch._inductor.config as ic
import coda.nn as cnn

torch.manual_seed(0)
model = cnn.CausalLM(4096, 256, 16, 4, 2, 768, device="cuda", backend="kernel")
tok = torch.randint(0, 4096, (2, 512), device="cuda")
with ic.patch(implicit_fallbacks=False, force_disable_caches=True):
    torch.compile(model)(tok, tok).backward()
assert model.embed.weight.grad is not None
print("compiled")
"""


@pytest.mark.gpu
def test_gpu_deep_model_compiles_without_implicit_fallbacks():
    """The H200 form of the test above, at the depth where the implicit path's formatting
    hung (16 layers; run 136's 1B model): a kernel-path ``CausalLM`` compiled with Inductor's
    implicit fallbacks off, in a fresh process, so every coda op is lowered through coda's
    own registration."""
    proc = subprocess.run(
        [sys.executable, "-c", _DEEP_MODEL_ON_GPU],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, _errors(proc.stderr)


@pytest.mark.gpu
def test_gpu_kernel_path_compiles_once_for_every_token_count():
    """On the H200 with Inductor: a ``CausalLM`` on the kernel path compiled with its token
    dimensions marked dynamic runs three token counts on one compile, with no graph break,
    and its loss and gradients match the eager step's (the same kernels run; Inductor
    compiles only the glue around them, whose bf16 rounding may differ)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch.manual_seed(0)
    model = cnn.CausalLM(4096, 512, 2, 4, 2, 1408, device="cuda", backend="kernel")
    tok = torch.randint(0, 4096, (2, 256), device="cuda")
    explained = torch._dynamo.explain(model)(tok, tok)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    frames = []
    for b, s in ((2, 256), (3, 384), (4, 128)):
        tok = torch.randint(0, 4096, (b, s), device="cuda")
        tgt = torch.randint(0, 4096, (b, s), device="cuda")
        for tensor in (tok, tgt):
            torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(tensor, 1)
        results = []
        for run in (model, compiled):
            model.zero_grad(set_to_none=True)
            loss = run(tok, tgt)
            loss.backward()
            results.append([loss.detach().float()] + [p.grad.float() for p in model.parameters()])
        for a, e in zip(*results):
            assert ((a - e).norm() / e.norm()).item() < 2e-2
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames == [frames[0]] * 3, frames


# (vocab, d, layers, heads, kv heads, ffn), (batch, seq): a small model, and one layer of the
# demo's d = 1024 model, whose LM head failed its capture until row kernels compiled once
# for every caller (runs 145-147; ``test_a_row_kernel_compiles_once_for_every_caller``)
GRAPHED_MODELS = {
    "small": ((4096, 512, 2, 4, 2, 1408), (2, 256)),
    "demo_width": ((8192, 1024, 1, 8, 4, 2816), (8, 1024)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GRAPHED_MODELS))
def test_gpu_compiled_with_its_cuda_graphs_trains_as_eager(shape):
    """``torch.compile(model, mode="reduce-overhead")`` over a kernel-path ``CausalLM``: coda's
    ops are captured in Inductor's CUDA graphs (none skipped), and four AdamW steps, replays
    among them, give the eager model's losses and gradients (the glue's bf16 rounding aside)."""
    dims, (batch, seq) = GRAPHED_MODELS[shape]
    torch.manual_seed(0)
    eager = cnn.CausalLM(*dims, device="cuda", backend="kernel")
    batches = [torch.randint(0, dims[0], (2, batch, seq), device="cuda") for _ in range(4)]
    assert_compiled_graphs_train_as_eager(eager, batches, lambda run, b: run(b[0], b[1]))


@pytest.mark.parametrize("outer", ["aot_eager", "inductor"])
def test_a_row_kernel_compiles_once_for_every_caller(monkeypatch, outer):
    """``fused``'s compiled row kernel, called from an autograd.Function in eager mode and
    from a custom op's implementation in three steps of a compiled function, compiles once:
    each recompile after the first step would land inside the step CUDA graph trees record
    (``mode="reduce-overhead"``) and invalidate the capture (runs 145-147)."""
    from torch._dynamo.testing import CompileCounter

    import coda.kernels._launch as launch

    torch._dynamo.reset()  # (the other parametrization's compiled forms)
    counter = CompileCounter()
    monkeypatch.setattr(launch, "COMPILED_ON", ("cpu",))
    monkeypatch.setattr(launch, "ROW_BACKEND", counter)

    def rows(a):  # a fresh function: its own compiled form
        return (a * a).sum(1, keepdim=True).rsqrt() * a

    @torch.library.custom_op("coda_test::rows_" + outer, mutates_args=())
    def op(a: torch.Tensor) -> torch.Tensor:
        return launch.fused(rows)(a)

    op.register_fake(lambda a: torch.empty_like(a))

    class Rows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return launch.fused(rows)(a)

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.randn(6, 5)
    assert torch.equal(Rows.apply(x), rows(x))
    step = torch.compile(lambda a: op(a.cos()), backend=outer)
    for _ in range(3):
        assert torch.allclose(step(x), rows(x.cos()))
    assert counter.frame_count == 1
