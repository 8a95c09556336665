"""Determinism on the H200: two runs of the same step give bitwise-identical results.

coda's own kernels reduce in a fixed order (per-tile partials and fixed-order AUX sums, no
atomics; the CE one-hot fix-up adds one value per row), so the LM-head loss and its gradients
must repeat bit for bit, and so must the whole decoder layer when attention's backward is
deterministic (PyTorch's math SDPA). With flash SDPA the layer is reported as it is: flash
attention's backward accumulates dq with atomics in some builds, and the record names it.
The result is written to ``CODA_DETERMINISM_REPORT`` (JSON) when set (the GPU suite)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import coda.nn as cnn


def _step(module, x, *args):
    for p in module.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(True)
    out = module(x, *args)
    if out.dim() == 0:
        out.backward()
    else:
        out.backward(torch.ones_like(out) / out.numel() ** 0.5)
    return {"out": out.detach(), "dx": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def _same(a: dict, b: dict) -> dict:
    return {k: bool(torch.equal(a[k], b[k])) for k in a}


@pytest.mark.gpu
def test_gpu_two_runs_are_bitwise_identical():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    report = {}
    layer = cnn.DecoderLayer(2048, 16, 8, 5632, device="cuda")
    x = torch.randn(2, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
        with sdpa_kernel(backend):
            report[f"DecoderLayer, {name} SDPA"] = _same(_step(layer, x), _step(layer, x))
    t = torch.randint(0, 32768, (4096,), device="cuda")
    t[::7] = -100
    xh = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    for method in ("recompute", "chunked", "scaled_exp"):
        head = cnn.LMHeadLoss(2048, 32768, method=method, device="cuda")
        report[f"LMHeadLoss {method}"] = _same(_step(head, xh, t), _step(head, xh, t))
    path = os.environ.get("CODA_DETERMINISM_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    must = {k: v for k, v in report.items() if "flash" not in k}
    bad = {k: [n for n, ok in v.items() if not ok] for k, v in must.items()}
    assert not any(bad.values()), bad
