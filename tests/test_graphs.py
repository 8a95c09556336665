"""CUDA graphs: a coda training step (forward + backward of ``DecoderLayer`` and
``LMHeadLoss``) captured once with ``torch.cuda.graph`` replays to the bitwise-same result as
the eager step. (How to use it: README, "CUDA graphs".)"""

from __future__ import annotations

import pytest
import torch

import coda
import coda.nn as cnn
from coda.nn.graph import check_capturable


def _capture(step):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # compiles, autotuning and allocator warm-up stay out of the graph
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["recompute", "chunked", "scaled_exp"])
def test_gpu_graph_replay_equals_eager_step(method):
    torch.manual_seed(0)
    layer = cnn.DecoderLayer(1024, 8, 4, 2816, device="cuda")
    head = cnn.LMHeadLoss(1024, 8192, method=method, device="cuda")
    params = [*layer.parameters(), *head.parameters()]
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 8192, (2, 512), device="cuda")
    t[:, ::7] = -100
    loss_out = torch.zeros((), device="cuda")

    def step():
        for p in (*params, x):
            p.grad = None  # the graph owns the gradient buffers it allocates
        loss = head(layer(x), t)
        loss.backward()
        loss_out.copy_(loss.detach())

    step()
    want = [loss_out.clone(), x.grad.clone(), *(p.grad.clone() for p in params)]
    graph = _capture(step)
    with torch.no_grad():  # new inputs in place, then replay: the graph reads them
        x.copy_(x * 1.0)
    graph.replay()
    torch.cuda.synchronize()
    got = [loss_out, x.grad, *(p.grad for p in params)]
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"tensor {i} differs after replay"
    # and a second replay on other data gives that data's eager result
    with torch.no_grad():
        x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    replayed = [loss_out.clone(), x.grad.clone(), *(p.grad.clone() for p in params)]
    step()
    eager = [loss_out, x.grad, *(p.grad for p in params)]
    for i, (a, b) in enumerate(zip(replayed, eager)):
        assert torch.equal(a, b), f"tensor {i} differs from the eager step on new data"


# -- coda.nn.GraphedStep -----------------------------------------------------------------------
def _tiny_lm(device, dtype, seed=0):
    torch.manual_seed(seed)
    return cnn.CausalLM(64, 32, 2, 4, 2, 48, device=device, dtype=dtype)


def _batches(n, vocab, shape, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, shape, generator=g).to(device),
            torch.randint(0, vocab, shape, generator=g).to(device),
        )
        for _ in range(n)
    ]


def _eager_steps(model, opt, batches, max_grad_norm=None):
    losses = []
    for tok, tgt in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(tok, tgt)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_graphed_step_is_the_eager_step_on_the_cpu(max_grad_norm):
    a, b = _tiny_lm("cpu", torch.float64), _tiny_lm("cpu", torch.float64)
    batches = _batches(5, 64, (2, 7), "cpu")
    want = _eager_steps(a, torch.optim.AdamW(a.parameters(), lr=1e-2), batches, max_grad_norm)
    step = cnn.GraphedStep(b, torch.optim.AdamW(b.parameters(), lr=1e-2), 2, max_grad_norm)
    got = [step(tok, tgt) for tok, tgt in batches]
    assert not step.graphed  # the CPU has no CUDA graphs: every call ran eagerly
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert len({float(x) for x in got}) == len(got)  # five batches, five losses
    if max_grad_norm is not None:  # clipping took effect
        assert float(step.grad_norm) > max_grad_norm


def test_graphed_step_names_what_a_graph_cannot_hold():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(coda.CodaInputError, match="param group 0 is not capturable"):
        check_capturable(torch.optim.AdamW(p, lr=1e-3))
    with pytest.raises(coda.CodaInputError, match="float lr"):
        check_capturable(torch.optim.AdamW(p, lr=1e-3, capturable=True))
    check_capturable(torch.optim.AdamW(p, lr=torch.tensor(1e-3), capturable=True))
    model = _tiny_lm("cpu", torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(coda.CodaInputError, match="warmup: must be a positive integer"):
        cnn.GraphedStep(model, opt, warmup=0)
    with pytest.raises(coda.CodaInputError, match="max_grad_norm"):
        cnn.GraphedStep(model, opt, max_grad_norm=0.0)
    step = cnn.GraphedStep(model, opt)  # the signature rule, as a CUDA model's calls meet it
    tok = torch.zeros(2, 8, dtype=torch.long)
    step._check((tok,), {"targets": tok, "reduction": "mean"})
    step._check((tok.clone(),), {"targets": tok + 1, "reduction": "mean"})  # same signature
    other = torch.zeros(2, 9, dtype=torch.long)
    with pytest.raises(coda.CodaInputError, match=r"targets: .*\(2, 8\).*got tensor \(2, 9\)"):
        step._check((tok,), {"targets": other, "reduction": "mean"})
    with pytest.raises(coda.CodaInputError, match=r"inputs\[0\]: .*torch.int32"):
        step._check((tok.int(),), {"targets": tok, "reduction": "mean"})
    with pytest.raises(coda.CodaInputError, match="reduction: .*'mean'.*got 'sum'"):
        step._check((tok,), {"targets": tok, "reduction": "sum"})
    with pytest.raises(coda.CodaInputError, match=r"inputs\[0\], targets, reduction\); got"):
        step._check((tok, tok), {})
    with pytest.raises(coda.CodaInputError, match="0-dim loss tensor"):
        cnn.GraphedStep(model, opt)(tok, tok, reduction="none")  # the step needs one loss


@pytest.fixture
def stand_in_graphs(monkeypatch):
    """torch's graph API replaced by stand-ins, so ``GraphedStep``'s CUDA branch runs on the
    CPU: a capture runs its body once (a capture plus the replay after it is one step)."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    return Graph


def test_graphed_step_bookkeeping_with_a_stand_in_graph(stand_in_graphs):
    """The CUDA branch's bookkeeping: eager warm-up calls, one capture, the later calls'
    tensors (by position and by keyword) copied into the capture's buffers before each
    replay."""
    Graph = stand_in_graphs
    a, b = _tiny_lm("cpu", torch.float64), _tiny_lm("cpu", torch.float64)
    batches = _batches(5, 64, (2, 7), "cpu")
    want = _eager_steps(a, torch.optim.AdamW(a.parameters(), lr=1e-2), batches[:3])
    step = cnn.GraphedStep(b, torch.optim.AdamW(b.parameters(), lr=1e-2), warmup=2)
    step.cuda = True  # as on a GPU (the optimizer check is its own test)
    got = [step(tok, targets=tgt) for tok, tgt in batches[:3]]
    assert step.graphed and Graph.replays == 1
    assert all(torch.equal(x, y) for x, y in zip(got, want))  # two eager, one captured
    for tok, tgt in batches[3:]:
        step(tok, targets=tgt)
        assert torch.equal(step._args[0], tok) and torch.equal(step._kwargs["targets"], tgt)
    assert Graph.replays == 3
    with pytest.raises(coda.CodaInputError, match="holds one shape"):
        step(batches[0][0][:, :3], targets=batches[0][1][:, :3])


def test_graphed_step_keeps_nothing_of_a_failed_capture(stand_in_graphs):
    """A step that cannot be captured (here: the model raises as torch does for a pageable
    host copy during a capture) raises naming the rule, with torch's error as its cause, and
    leaves no graph behind: the next call captures afresh and replays."""
    model = _tiny_lm("cpu", torch.float64)

    class Refusing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.calls = model, 0

        def forward(self, tok, tgt):
            self.calls += 1
            if self.calls == 3:  # the call that captures
                raise RuntimeError("Cannot copy between CPU and CUDA tensors during capture")
            return self.inner(tok, tgt)

    step = cnn.GraphedStep(Refusing(), torch.optim.AdamW(model.parameters(), lr=1e-2), 2)
    step.cuda = True
    batches = _batches(4, 64, (2, 7), "cpu")
    step(*batches[0]), step(*batches[1])
    with pytest.raises(RuntimeError, match="could not be captured as a CUDA graph") as err:
        step(*batches[2])
    assert "Cannot copy between CPU and CUDA" in str(err.value.__cause__)
    assert not step.graphed and step._args is None and stand_in_graphs.replays == 0
    step(*batches[3])
    assert step.graphed and stand_in_graphs.replays == 1
    assert torch.equal(step._args[0], batches[3][0])


class OnGPU(torch.nn.Parameter):
    """A CPU parameter that reports CUDA device ``index``: what ``GraphedStep`` reads of a
    model's placement."""

    index = 1

    @property
    def device(self):
        return torch.device("cuda", self.index)

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return self.index


class Capturable:
    """An optimizer as ``GraphedStep`` needs one on a GPU (capturable, a tensor lr), whose
    step does nothing."""

    def __init__(self):
        self.param_groups = [{"capturable": True, "lr": torch.tensor(1e-2)}]

    def zero_grad(self, set_to_none=True):
        pass

    def step(self):
        pass


def test_graphed_step_runs_on_its_models_device(stand_in_graphs, fake_devices):
    """A model on GPU 1 while GPU 0 is current: every call (warm-up, capture, replay) runs
    with GPU 1 current, where its side stream and its graph are made, and GPU 0 is current
    again after; a model whose parameters span two GPUs is refused by name."""
    import coda._device

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = OnGPU(torch.ones(3))
            self.seen = []

        def forward(self, x):
            self.seen.append(coda._device._current())
            return (self.w * x).sum()

    model = Model()
    step = cnn.GraphedStep(model, Capturable(), warmup=1)
    for _ in range(3):  # a warm-up call, the capture, a replay
        step(torch.ones(3))
        assert fake_devices["current"] == 0
    assert step.graphed and model.seen == [1, 1] and fake_devices["entered"] == [1, 1, 1]
    other = Model()
    other.v = OnGPU(torch.ones(3))
    other.v.index = 0
    with pytest.raises(coda.CodaInputError, match=r"model: its parameters are on cuda:0, cuda:1"):
        cnn.GraphedStep(other, Capturable())


@pytest.mark.gpu
def test_gpu_graphed_step_trains_as_the_eager_step():
    """Six steps of a coda CausalLM on six batches: eager and through ``GraphedStep`` (two
    eager calls, a capture, three replays) give the same losses and weights, bitwise."""

    def lm():
        torch.manual_seed(0)
        return cnn.CausalLM(8192, 1024, 1, 8, 4, 2816, device="cuda")

    def adamw(model):
        lr = torch.tensor(1e-3, device="cuda")
        return torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)

    batches = _batches(6, 8192, (2, 512), "cuda")
    a, b = lm(), lm()
    want = _eager_steps(a, adamw(a), batches, max_grad_norm=1.0)
    step = cnn.GraphedStep(b, adamw(b), warmup=2, max_grad_norm=1.0)
    got = [step(tok, tgt) for tok, tgt in batches]
    assert step.graphed
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.equal(x, y), f"step {i}: loss {float(x)} against eager {float(y)}"
    for (name, p), q in zip(b.named_parameters(), a.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(coda.CodaInputError, match="holds one shape"):
        step(batches[0][0][:, :256], batches[0][1][:, :256])
