"""torch.autocast (bf16) over fp32 parameters, the standard mixed-precision recipe: coda's
kernel path casts x and the parameters to bf16 per call (``coda.env.compute_dtype``) and runs
its bf16 kernels, with autocast off inside (its fp32 glue stays fp32). On the CPU, through the
tile interpreter: an fp32 module under autocast equals its bf16 copy bitwise, the output and
every gradient (the fp32 parameters' gradients are the bf16 copy's, cast to fp32: autocast's
own rule for a cast weight; the LM head's weight gets the three-GEMM programs' fp32
accumulator itself, which the bf16 copy rounds). The reference path stays plain torch."""

from __future__ import annotations

import copy

import pytest
import torch

import coda.nn as cnn
from coda import CodaInputError
from coda.env import compute_dtype

BF16 = torch.bfloat16


def test_compute_dtype_is_bf16_inside_bf16_autocast_only():
    x = torch.randn(2, 3)
    assert compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=BF16):
        assert compute_dtype(x) == BF16
    with torch.autocast("cpu", dtype=torch.float16):  # not a kernel dtype: x's own
        assert compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=BF16, enabled=False):
        assert compute_dtype(x) == torch.float32


def _step(fn, x, params, dy=None):
    x = x.detach().clone().requires_grad_(True)
    for p in params:
        p.grad = None
    out = fn(x)
    out.backward(torch.ones_like(out) if dy is None else dy)
    return out.detach(), x.grad, [p.grad for p in params]


def _layer_under_autocast_is_its_bf16_copy(qk_norm, device, d=64, H=4, Hkv=2, f=96, hd=16):
    torch.manual_seed(0)
    layer32 = cnn.DecoderLayer(
        d, H, Hkv, f, head_dim=hd, dtype=torch.float32, qk_norm=qk_norm, device=device
    )
    layer16 = copy.deepcopy(layer32).to(BF16)
    x = torch.randn(2, 5, d, device=device)
    dy = torch.randn(2, 5, d, dtype=BF16, device=device)

    def autocast_fp32(x):
        with torch.autocast(device, dtype=BF16):
            return layer32._kernel_forward(x)

    out_a, dx_a, g_a = _step(autocast_fp32, x, list(layer32.parameters()), dy)
    out_b, dx_b, g_b = _step(layer16._kernel_forward, x.to(BF16), list(layer16.parameters()), dy)
    assert out_a.dtype == BF16 and torch.equal(out_a, out_b)
    assert dx_a.dtype == torch.float32 and torch.equal(dx_a, dx_b.float())
    for (name, p), a, b in zip(layer32.named_parameters(), g_a, g_b):
        assert a.dtype == torch.float32 and torch.equal(a, b.float()), name


@pytest.mark.parametrize("qk_norm", [False, True])
def test_decoder_layer_under_autocast_is_its_bf16_copy(qk_norm):
    _layer_under_autocast_is_its_bf16_copy(qk_norm, "cpu")


def _same_up_to_rare_steps(name, a, b, exact):
    """a == b bitwise (the CPU), or (the H200) up to one bf16 step in at most 1 in 10^4
    entries: run 19 found 1-2 of 397824 dx entries one step apart on the chunked and CE-S
    programs (the bf16 copy itself is deterministic, checked first; which of the GPU-only
    pieces, the GEMM epilogues or the torch.compile'd row kernels compiled for each call's
    guards, rounds differently is not isolated)."""
    differ = a != b
    report = (
        f"{name}: {int(differ.sum())} of {differ.numel()} entries differ, in rows "
        f"{differ.any(-1).nonzero().flatten()[:10].tolist() if a.dim() > 1 else '-'}, by at "
        f"most {(a.float() - b.float()).abs().max().item():.3g} (max |{name}| "
        f"{b.abs().max().item():.3g})"
    )
    if exact:
        assert not differ.any(), report
        return
    step = b.float().abs() * 2.0**-7  # one bf16 step at each entry (bf16 values)
    assert int(differ.sum()) <= max(2, differ.numel() // 10_000), report
    assert ((a.float() - b.float()).abs() <= step + 1e-30).all(), report


def _head_under_autocast_is_its_bf16_copy(method, device, d=64, V=256, M=10):
    torch.manual_seed(1)
    head32 = cnn.LMHeadLoss(
        d, V, method=method, dtype=torch.float32, label_smoothing=0.1, device=device
    )
    head16 = copy.deepcopy(head32).to(BF16)
    x = torch.randn(M, d, device=device)
    t = torch.randint(0, V, (M,), device=device)
    t[::3] = -100

    def autocast_fp32(x):
        with torch.autocast(device, dtype=BF16):
            return head32._kernel_loss(x, t, "mean")

    loss_a, dx_a, g_a = _step(autocast_fp32, x, list(head32.parameters()))
    loss_b, dx_b, g_b = _step(
        lambda x: head16._kernel_loss(x, t, "mean"), x.to(BF16), list(head16.parameters())
    )
    again = _step(
        lambda x: head16._kernel_loss(x, t, "mean"), x.to(BF16), list(head16.parameters())
    )[1]
    assert torch.equal(dx_b, again), "the bf16 copy's own dx differs between two runs"
    assert torch.equal(loss_a, loss_b)
    (dgf_a, dw_a), (dgf_b, dw_b) = g_a, g_b
    # the weight's gradient comes in its own dtype: for the three-GEMM programs the fp32
    # accumulator itself, which the bf16 copy rounds once (recompute's is bf16, cast)
    assert dx_a.dtype == dgf_a.dtype == dw_a.dtype == torch.float32
    for name, a, b in (("dx", dx_a, dx_b), ("dgamma", dgf_a, dgf_b), ("dW", dw_a.to(BF16), dw_b)):
        _same_up_to_rare_steps(name, a.to(b.dtype), b, exact=device == "cpu")
    unrounded = not torch.equal(dw_a, dw_a.to(BF16).float())
    assert unrounded == (method != "recompute")


@pytest.mark.parametrize("method", ["recompute", "chunked", "scaled_exp"])
def test_lm_head_loss_under_autocast_is_its_bf16_copy(method):
    _head_under_autocast_is_its_bf16_copy(method, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_decoder_layer_under_autocast_is_its_bf16_copy(qk_norm):
    """H200: the same, on the SM90 kernels (math SDPA: flash's dQ uses atomics, and two runs
    of it are not bitwise equal even at one dtype)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        _layer_under_autocast_is_its_bf16_copy(qk_norm, "cuda", 512, 8, 4, 1408, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["recompute", "chunked", "scaled_exp"])
def test_gpu_lm_head_loss_under_autocast_is_its_bf16_copy(method):
    _head_under_autocast_is_its_bf16_copy(method, "cuda", 512, 32768, 777)


def test_public_calls_accept_autocast_mixed_dtypes_and_reject_them_outside():
    """Inside autocast a bf16 activation meets fp32 parameters (the previous layer's output):
    accepted on either path; outside autocast the mismatch is still an error naming it."""
    torch.manual_seed(2)
    model = cnn.CausalLM(256, 64, 2, 4, 2, 96, head_dim=16, dtype=torch.float32)
    tokens, targets = torch.randint(0, 256, (2, 7)), torch.randint(0, 256, (2, 7))
    with torch.autocast("cpu", dtype=BF16):
        loss = model(tokens, targets)
        h = model.layers[0](torch.randn(2, 7, 64, dtype=BF16))
    assert torch.isfinite(loss) and h.shape == (2, 7, 64)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(CodaInputError, match="x is torch.bfloat16 but the parameters are"):
        model.layers[0](torch.randn(2, 7, 64, dtype=BF16))


def test_kernel_path_under_autocast_traces_without_graph_breaks():
    torch.manual_seed(3)
    layer = cnn.DecoderLayer(64, 4, 2, 96, head_dim=16, dtype=torch.float32)
    head = cnn.LMHeadLoss(64, 256, dtype=torch.float32)  # "auto": CE-S
    t = torch.randint(0, 256, (10,))

    def step(x):
        with torch.autocast("cpu", dtype=BF16):
            return head._kernel_loss(layer._kernel_forward(x).reshape(-1, 64), t, "mean")

    explained = torch._dynamo.explain(step)(torch.randn(2, 5, 64, requires_grad=True))
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]


@pytest.mark.parametrize("method", ["chunked", "scaled_exp"])
def test_hf_layout_lm_head_weight_under_autocast_gets_the_fp32_accumulator(method):
    """An HF ``lm_head.weight`` (V, d) in fp32, passed as its (d, V) view (what
    ``apply_coda`` does): its gradient under autocast is the fp32 accumulator, in the (V, d)
    layout, and rounds to the bf16 copy's exactly. So is the final norm's fp32 gain's (kept in
    fp32 since session 65: here bf16 values, so that both calls compute the same loss)."""
    from coda.nn.head import _kernel_lm_head_loss

    torch.manual_seed(4)
    d, V, M = 64, 256, 12
    w32 = torch.nn.Parameter(torch.randn(V, d) * 0.05)
    g32 = torch.nn.Parameter((1 + 0.1 * torch.randn(d)).to(BF16).float())
    w16, g16 = (torch.nn.Parameter(p.detach().to(BF16)) for p in (w32, g32))
    x = torch.randn(M, d)
    t = torch.randint(0, V, (M,))

    def loss(x, w, g):
        return _kernel_lm_head_loss(x, g, w.t(), t, 1e-5, -100, "mean", 16384, method, 0, 0)

    with torch.autocast("cpu", dtype=BF16):
        la = loss(x, w32, g32)
    la.backward()
    lb = loss(x.to(BF16), w16, g16)
    lb.backward()
    assert torch.equal(la, lb)
    assert w32.grad.dtype == torch.float32 and w32.grad.shape == (V, d)
    assert torch.equal(w32.grad.to(BF16), w16.grad) and not torch.equal(w32.grad, w16.grad.float())
    assert torch.equal(g32.grad.to(BF16), g16.grad) and not torch.equal(g32.grad, g16.grad.float())
