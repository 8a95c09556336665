"""The LM head's kernel path run on the CPU, beside ``test_kernel_path_cpu.py``'s whole
sequences: which program each method runs (the one-GEMM program without gradients, no dW GEMM
for a frozen weight), HF's (V, d) weight layout on every method in float64 and bf16, the dW
cast from its fp32 accumulator in every layout (its Triton kernel in the interpreter and
compiled for sm_90), and the head's parameters. Split from ``test_kernel_path_cpu.py``
(session 78) to keep each file under ~600 lines."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import coda.nn as cnn

F64 = torch.float64


def test_auto_lm_head_method_is_scaled_exp_where_it_applies():
    from coda.autograd import resolve_lm_head_method

    assert resolve_lm_head_method("auto", 128256) == "scaled_exp"
    assert resolve_lm_head_method("auto", 50257) == "recompute"  # V % 128 != 0
    assert resolve_lm_head_method("chunked", 128256) == "chunked"
    assert cnn.LMHeadLoss(8, 256, dtype=F64).method == "auto"


def test_lm_head_without_gradients_runs_the_one_gemm_program(monkeypatch):
    """An evaluation loss (no_grad, or nothing requiring grad) skips the gradient GEMMs."""
    from coda.kernels import library as lib

    head = cnn.LMHeadLoss(16, 256, method="scaled_exp", dtype=F64)
    x, t = torch.randn(10, 16, dtype=F64), torch.randint(0, 256, (10,))
    with_grads = head._kernel_loss(x, t, "mean")

    def refuse(*a, **k):
        raise AssertionError("the three-GEMM program ran without gradients")

    monkeypatch.setattr(lib, "lm_head_scaled", refuse)
    with torch.no_grad():
        assert rel_err(head._kernel_loss(x, t, "mean"), with_grads, floor=1.0) < 1e-12
    for p in head.parameters():
        p.requires_grad_(False)
    assert rel_err(head._kernel_loss(x, t, "mean"), with_grads, floor=1.0) < 1e-12
    with pytest.raises(AssertionError, match="without gradients"):
        x.requires_grad_(True)
        head._kernel_loss(x, t, "mean")


@pytest.mark.parametrize("method", ["scaled_exp", "chunked", "recompute"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_frozen_lm_head_forms_no_weight_gradient(method, smoothing, monkeypatch):
    """A frozen LM-head weight (tied to a frozen embedding, say): no method runs a dW GEMM
    (the three-GEMM programs keep no V x d accumulator either), the weight gets no gradient,
    and the loss, dX and dgamma equal the trainable head's (float64, kernel path)."""
    from coda.kernels import ce_scaled_exp as cse
    from coda.kernels import linear_cross_entropy_bwd as ceb
    from coda.kernels import linear_cross_entropy_chunked as cec

    torch.manual_seed(0)
    head = cnn.LMHeadLoss(16, 256, method=method, chunk=7, dtype=F64, label_smoothing=smoothing)
    x = torch.randn(19, 16, dtype=F64, requires_grad=True)
    t = torch.randint(0, 256, (19,))
    t[::5] = -100

    def step():
        x.grad = head.final_norm.grad = head.weight.grad = None
        loss = head._kernel_loss(x, t, "mean")
        loss.backward()
        return loss.detach(), x.grad, head.final_norm.grad

    want = step()
    assert head.weight.grad is not None
    dw_gemms = []
    launch = ceb.launch
    for module, name in ((cse, "scaled_grad_dw_kernel"), (cec, "dw_gemm"), (ceb, "launch")):
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            b3 = args[:1] == (ceb.passthrough,) and "add_to_output" not in kwargs  # (not B1, B2)
            if _real is not launch or b3:
                dw_gemms.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    step()
    assert dw_gemms  # (the counting sees the trainable head's dW GEMMs)
    head.weight.requires_grad_(False)
    dw_gemms.clear()
    got = step()
    assert dw_gemms == [] and head.weight.grad is None
    for a, b in zip(got, want):
        assert rel_err(a, b, floor=1.0) < 1e-12


@pytest.mark.parametrize("method", ["scaled_exp", "chunked"])
def test_lm_head_hf_weight_layout_kernel_path_float64(method):
    """The functional LM head with an HF ``lm_head.weight`` (V, d) passed as its (d, V) view (what
    ``apply_coda`` does): the kernel sequence equals the reference, the weight's gradient lands in
    its own (V, d) layout, and the upstream gradient is any number."""
    from coda.nn.head import _kernel_lm_head_loss, lm_head_loss

    torch.manual_seed(3)
    M, d, V = 37, 24, 256
    w = torch.randn(V, d, dtype=F64, requires_grad=True)  # HF layout
    gam = (1 + 0.1 * torch.randn(d, dtype=F64)).requires_grad_(True)
    x = torch.randn(M, d, dtype=F64, requires_grad=True)
    t = torch.randint(0, V, (M,))
    t[::5] = -100
    g = torch.tensor(-0.613, dtype=F64)

    def grads(fn):
        for p in (w, gam, x):
            p.grad = None
        loss = fn()
        loss.backward(g)
        return loss.detach(), [p.grad.clone() for p in (x, gam, w)]

    args = (1e-5, -100, "mean", 16384, method, 0.0, 0.0)
    out_k, g_k = grads(lambda: _kernel_lm_head_loss(x, gam, w.t(), t, *args))
    out_r, g_r = grads(lambda: lm_head_loss(x, gam, w.t(), t))
    assert rel_err(out_k, out_r, floor=1.0) < 1e-12
    for name, a, b in zip(("x", "gamma", "w"), g_k, g_r):
        assert rel_err(a, b, floor=float(b.abs().max())) < 1e-11, name
    assert w.grad.is_contiguous()


@pytest.mark.parametrize("method", ["recompute", "chunked", "scaled_exp"])
def test_lm_head_hf_weight_layout_kernel_path_bf16(method):
    """The same in bf16, where the interpreter enforces the TMA's layout rules: every GEMM of
    every method accepts the HF weight's column-major view (CE-C's dW GEMM used to be handed a
    column-major output, which the TMA cannot store), and lands near the reference."""
    from coda.nn.head import _kernel_lm_head_loss, lm_head_loss

    torch.manual_seed(4)
    M, d, V = 37, 64, 256
    w = (0.05 * torch.randn(V, d)).to(torch.bfloat16).requires_grad_(True)  # HF layout
    gam = torch.ones(d, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(M, d, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (M,))

    def grads(fn):
        for p in (w, gam, x):
            p.grad = None
        loss = fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in (x, gam, w)]

    args = (1e-5, -100, "mean", 16384, method, 0.0, 0.0)
    out_k, g_k = grads(lambda: _kernel_lm_head_loss(x, gam, w.t(), t, *args))
    out_r, g_r = grads(lambda: lm_head_loss(x, gam, w.t(), t))
    assert rel_err(out_k, out_r) < 1e-2
    for name, a, b in zip(("x", "gamma", "w"), g_k, g_r):
        assert rel_err(a, b, floor=float(b.abs().max())) < 5e-2, name
    assert w.grad.is_contiguous()


def test_weight_grad_from_acc_every_layout():
    from coda.kernels.linear_cross_entropy_bwd import weight_grad_from_acc

    acc_vd = torch.randn(12, 5, dtype=torch.float32)  # a (V, d) accumulator
    g = torch.tensor(0.37)
    want = (acc_vd * g).to(torch.bfloat16)
    for like in (
        torch.empty(12, 5, dtype=torch.bfloat16).t(),  # same strides: one pass
        torch.empty(5, 12, dtype=torch.bfloat16),  # contiguous (d, V): transposing pass
        torch.empty(5, 24, dtype=torch.bfloat16)[:, ::2],  # anything else
    ):
        out = weight_grad_from_acc(acc_vd.t(), g, like)
        assert out.dtype == torch.bfloat16 and out.shape == (5, 12)
        assert torch.equal(out, want.t())
        if like.stride() == (1, 5):  # the HF layout keeps its strides (no transposing pass)
            assert out.stride() == like.stride()
    acc_dv = acc_vd.t().contiguous()  # a (d, V) accumulator against a (d, V) weight
    out = weight_grad_from_acc(acc_dv, g, torch.empty(5, 12, dtype=torch.bfloat16))
    assert out.is_contiguous() and torch.equal(out, want.t())


_CAST_CHILD = """
import json, torch
from coda.kernels import linear_cross_entropy_bwd as ceb
from coda.kernels.linear_cross_entropy_bwd import (
    CAST_BLOCK, scaled_cast_triton, weight_grad_from_acc
)
out, launched = [], []
ceb.scaled_cast_triton = lambda *a: launched.append(1) or scaled_cast_triton(*a)
g = torch.tensor(0.37)
for i, n in enumerate((1, 7, CAST_BLOCK - 1, CAST_BLOCK, 3 * CAST_BLOCK + 5)):
    for src, dst in ((torch.float32, torch.bfloat16), (torch.float64, torch.float64)):
        acc = torch.randn(n, generator=torch.Generator().manual_seed(i), dtype=src) * 100
        got, want = scaled_cast_triton(acc, g, dst), (acc * g.to(src)).to(dst)
        err = ((got.double() - want.double()).abs() / want.double().abs()).max().item()
        out.append([n, str(dst), got.dtype == dst, err])
acc_vd = torch.randn(CAST_BLOCK + 3, 5)  # CE-S's (V, d) accumulator, LMHeadLoss's weight.t()
like = torch.empty(CAST_BLOCK + 3, 5, dtype=torch.bfloat16).t()
got = weight_grad_from_acc(acc_vd.t(), g, like)
want = (acc_vd.t() * g).bfloat16()
err = ((got.double() - want.double()).abs() / want.double().abs()).max().item()
nans = [int(t.isnan().sum()) for t in (acc_vd, got, want)]  # (one gate read err nan once)
out.append(["layout", got.stride() == like.stride(), err, len(launched), nans])
print(json.dumps(out))
"""


def test_weight_grad_cast_kernel_in_triton_interpreter_equals_torch_form():
    """The dW cast's Triton kernel (``scaled_cast_triton``) in Triton's interpreter against
    the torch form's ``(acc * g).to(dtype)`` at sizes off and on its block: float64 to float64
    bitwise, fp32 to bf16 within one bf16 step (the interpreter truncates where the GPU rounds
    to nearest even; on the H200 the test below is bitwise); ``weight_grad_from_acc`` takes it
    for LMHeadLoss's layout and keeps that layout's strides."""
    import triton_child

    results = triton_child.results(_CAST_CHILD)
    assert len(results) == 11
    layout, strides_kept, err, launched, nans = results.pop()
    # the kernel ran, once; ``nans``: NaN counts of the accumulator, the output and the torch
    # form, to tell an input from an output fault should the error read nan again
    assert strides_kept and err <= 2.0**-7 and launched == 1, (err, launched, nans)
    for n, dtype, dtype_ok, err in results:
        assert dtype_ok and err <= (0.0 if dtype == "torch.float64" else 2.0**-7), (n, dtype)


@pytest.mark.compile
def test_weight_grad_cast_kernel_compiles_for_sm90():
    from coda.kernels.linear_cross_entropy_bwd import compile_scaled_cast

    assert compile_scaled_cast() > 0


def test_lm_head_loss_weight_view_is_not_assignable():
    """``w_lm`` is a view of ``weight``: assigning it (which nn.Module would otherwise
    register as a second, unused parameter) raises, naming the parameter to assign."""
    head = cnn.LMHeadLoss(16, 32, dtype=F64)
    with pytest.raises(AttributeError, match="assign weight"):
        head.w_lm = torch.nn.Parameter(torch.zeros(16, 32, dtype=F64))
    assert [n for n, _ in head.named_parameters()] == ["final_norm", "weight"]
    assert head.w_lm.shape == (16, 32) and head.w_lm.data_ptr() == head.weight.data_ptr()
