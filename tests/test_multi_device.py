"""One process, two GPUs, no ``torch.cuda.set_device``: a model on ``cuda:1`` while ``cuda:0``
is current (an HF model placed with ``device_map="auto"``). coda's kernels launch on their
tensors' device (``coda._device``): the model's training step and an op give the bits they
give with ``cuda:1`` current, and ``cuda:0`` is current after. Needs two SM90 GPUs and is
skipped on one; the CPU tests of the launch sites' choice are in tests/test_triton_launch.py
and tests/test_launch_cache.py."""

from __future__ import annotations

import pytest
import torch

import coda
import coda.nn as cnn


def _step(model, tokens, targets):
    for p in model.parameters():
        p.grad = None
    loss = model(tokens, targets)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_kernels_launch_on_their_tensors_device():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    one = torch.device("cuda", 1)
    model = cnn.CausalLM(4096, 512, 2, 8, 4, 1408, device=one)
    tokens = torch.randint(0, 4096, (2, 256), device=one)
    targets = torch.randint(0, 4096, (2, 256), device=one)
    x = torch.randn(512, 512, device=one, dtype=torch.bfloat16)
    w = torch.randn(512, 2816, device=one, dtype=torch.bfloat16) / 512**0.5
    results = {}
    for current in (1, 0):  # the tensors' device current, then another one
        torch.cuda.set_device(current)
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad():  # (a deterministic backward)
            s = coda.gemm_swiglu(x, w).s
        with sdpa_kernel(SDPBackend.MATH):
            results[current] = [s, *_step(model, tokens, targets)]
        torch.cuda.synchronize(one)
        assert torch.cuda.current_device() == current
    for op in ("gemm_swiglu", "DecoderLayer", "LMHeadLoss", "Embedding"):
        assert coda.last_path(op)[0] == "kernel", op
    for a, b in zip(results[1], results[0]):
        assert a.device == one and torch.equal(a, b)
