"""CUDA graphs: a coda training step (forward + backward of ``DecoderLayer`` and
``LMHeadLoss``) captured once with ``torch.cuda.graph`` replays to the bitwise-same result as
the eager step. (How to use it: README, "CUDA graphs".)"""

from __future__ import annotations

import pytest
import torch

import coda.nn as cnn


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
