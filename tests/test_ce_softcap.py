"""The LM-head loss of soft-capped logits c tanh(l / c) (Gemma 2's ``final_logit_softcapping``,
``softcap=`` of ``lm_head_loss`` / ``LMHeadLoss``): the kernel path's "recompute" program (its
capped stats and gradient epilogues, ``capped_logits_lse_target`` and
``capped_softmax_grad_logits``, the target entry's slope in ``_one_hot_fixup``) run through
the tile interpreter in float64 equals the reference path's canonical loss (``cross_entropy_ref``
of the capped logits) and its autograd gradients, over shapes whose vocabulary spans several
chunks and a ragged last tile, with ignored targets, every reduction, the z-loss, and a cap
that bends the logits (so a lost cap or slope shows). Both kernels compile for sm_90a
(``test_forward_kernels.py``, ``test_backward_kernels.py``, ``test_tuned.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import coda.env
from coda import _validate as v
from coda.nn import LMHeadLoss, lm_head_loss

TOL = 1e-10


def _case(M: int, d: int, V: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d, dtype=torch.float64, generator=g)
    gamma = 1.0 + 0.3 * torch.randn(d, dtype=torch.float64, generator=g)
    # logits of a few units against a cap of 2: tanh far from linear
    w = torch.randn(d, V, dtype=torch.float64, generator=g) * (3.0 / d**0.5)
    t = torch.randint(0, V, (M,), generator=g)
    t[::5] = -100
    return x, gamma, w, t


def _run(x, gamma, w, t, **kw):
    leaves = [p.detach().clone().requires_grad_(True) for p in (x, gamma, w)]
    loss = lm_head_loss(*leaves, t, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    return [loss.detach()] + [p.grad for p in leaves]


@pytest.mark.parametrize("M,d,V,chunk", [(37, 24, 136, 64), (64, 48, 200, 96), (9, 16, 72, 72)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_capped_kernel_path_equals_reference_float64(
    M, d, V, chunk, reduction, z_loss, monkeypatch
):
    x, gamma, w, t = _case(M, d, V, seed=M + V)
    kw = dict(reduction=reduction, z_loss=z_loss, softcap=2.0, chunk=chunk)
    want = _run(x, gamma, w, t, **kw)
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    coda.env._LAST.clear()
    got = _run(x, gamma, w, t, **kw)
    assert coda.last_path("LMHeadLoss")[0] == "kernel"
    for name, a, e in zip(("loss", "dx", "dgamma", "dW"), got, want):
        assert rel_err(a, e) < TOL, name
    # the cap bends these logits: the uncapped loss and gradients are far from them
    plain = _run(x, gamma, w, t, reduction=reduction, z_loss=z_loss, chunk=chunk)
    assert all(rel_err(a, e) > 1e-2 for a, e in zip(plain, want))


@pytest.mark.parametrize("M,d,V", [(300, 24, 256), (37, 16, 384)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_capped_three_gemm_program_equals_reference_float64(
    M, d, V, reduction, z_loss, monkeypatch
):
    """CE-S with the cap (``method="scaled_exp"``: ``capped_scaled_exp_logits``, the target's
    coefficient times its slope): the kernel path through the interpreter equals the reference
    in float64, over token chunks of 128 rows (three at M = 300, the last padded), with ignored
    targets and the z-loss."""
    import coda.autograd

    x, gamma, w, t = _case(M, d, V, seed=M + V)
    kw = dict(reduction=reduction, z_loss=z_loss, softcap=2.0, method="scaled_exp")
    want = _run(x, gamma, w, t, **kw)
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    monkeypatch.setattr(coda.autograd, "chunk_rows_scaled", lambda vocab: 128)
    coda.env._LAST.clear()
    got = _run(x, gamma, w, t, **kw)
    assert coda.last_path("LMHeadLoss")[0] == "kernel"
    for name, a, e in zip(("loss", "dx", "dgamma", "dW"), got, want):
        assert rel_err(a, e) < TOL, name


def test_reference_is_the_capped_cross_entropy():
    """The reference path's loss is F.cross_entropy of c tanh(l / c), l the normed rows'
    logits: written out here once, from the definition."""
    x, gamma, w, t = _case(23, 16, 40, seed=1)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
    z = 2.0 * torch.tanh((y @ w) / 2.0)
    want = torch.nn.functional.cross_entropy(z, t, ignore_index=-100)
    assert rel_err(lm_head_loss(x, gamma, w, t, softcap=2.0), want) < TOL


def test_module_carries_the_cap_and_auto_runs_scaled_exp(monkeypatch):
    """``LMHeadLoss(softcap=)`` on the kernel path: "auto" with a vocabulary of 128 runs
    CE-S's capped program (the fastest on the H200 with a cap, run 293), and equals the
    functional call."""
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    head = LMHeadLoss(16, 128, dtype=torch.float64, softcap=3.0)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    t = torch.randint(0, 128, (2, 7))
    want = lm_head_loss(x, head.final_norm, head.w_lm, t, softcap=3.0, backend="reference")
    assert rel_err(head(x, t), want) < TOL
    from coda.autograd import resolve_lm_head_method

    assert resolve_lm_head_method("auto", 128, True) == "scaled_exp"
    assert coda.last_path("LMHeadLoss")[0] == "kernel"


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(softcap=0.0), "softcap: must be a finite positive number"),
        (dict(softcap=-1.0), "softcap: must be a finite positive number"),
        (dict(softcap=float("inf")), "softcap: must be a finite positive number"),
        (dict(softcap=True), "softcap: must be a finite positive number"),
        (dict(softcap=30.0, label_smoothing=0.1), "softcap: not supported with label_smoothing"),
        (dict(softcap=30.0, method="chunked"), "softcap: runs the 'recompute' or 'scaled_exp'"),
    ],
)
def test_bad_caps_are_refused_named(kw, match):
    x, gamma, w, t = _case(8, 16, 40, seed=2)
    with pytest.raises(v.CodaInputError, match=match):
        lm_head_loss(x, gamma, w, t, **kw)
    with pytest.raises(v.CodaInputError, match=match):
        LMHeadLoss(16, 40, **kw)


def _protocol(device: str, M: int, d: int, V: int, cap: float, seed: int = 0, method="auto"):
    """CODA's protocol for the capped loss: bf16 inputs, coda's kernel path and the plain
    PyTorch bf16 path (HF's Gemma 2: the normed rows, the logits and the cap in bf16, the
    loss in fp32), each against float64: {output: (coda's error, PyTorch's, tie band)}."""
    from conftest import fro_err, tie_band

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, d, generator=g)
    gamma = 1.0 + 0.3 * torch.randn(d, generator=g)
    w = torch.randn(d, V, generator=g) * (0.6 * cap / d**0.5)  # logits ~ 0.6 c: tanh bends
    t = torch.randint(0, V, (M,), generator=g)
    t[::7] = -100
    inputs = [p.to(device, torch.bfloat16) for p in (x, gamma, w)]
    t = t.to(device)

    def torch_bf16(x, gamma, w):
        y = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        z = torch.tanh((y * gamma) @ w / cap) * cap
        return torch.nn.functional.cross_entropy(z.float(), t, ignore_index=-100)

    def grads(fn, dtype):
        leaves = [p.detach().to(dtype).requires_grad_(True) for p in inputs]
        loss = fn(*leaves)
        loss.backward()
        return [loss.detach()] + [p.grad for p in leaves]

    ref = grads(lambda *p: lm_head_loss(*p, t, softcap=cap, backend="reference"), torch.float64)
    ours = grads(lambda *p: lm_head_loss(*p, t, softcap=cap, method=method), torch.bfloat16)
    theirs = grads(torch_bf16, torch.bfloat16)
    names = ("loss", "dx", "dgamma", "dW")
    return {
        n: (fro_err(a, r), fro_err(b, r), tie_band(r))
        for n, a, b, r in zip(names, ours, theirs, ref)
    }


def _assert_protocol(errors, floor: float) -> None:
    for name, (e_c, e_t, band) in errors.items():
        if name == "loss":  # (a scalar: no worse than PyTorch's above its rounding floor)
            assert max(e_c, floor) <= max(e_t, floor), (name, e_c, e_t)
        else:
            assert e_c <= e_t * (1.0 + band), (name, e_c, e_t, band)


@pytest.mark.parametrize("method", ["recompute", "scaled_exp"])
def test_capped_bf16_protocol_on_the_interpreter(method, monkeypatch):
    """The protocol on the CPU, the kernel path's bf16 roundings through the interpreter
    (a model of the GPU's; the GPU's own: ``test_gpu_capped_loss_protocol``)."""
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    errors = _protocol("cpu", 512, 64, 512, cap=5.0, method=method)
    assert coda.last_path("LMHeadLoss")[0] == "kernel"
    _assert_protocol(errors, 2.0**-9 / 512**0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["recompute", "scaled_exp"])
@pytest.mark.parametrize("cap", [30.0, 5.0])
def test_gpu_capped_loss_protocol(cap, method):
    """H200: Gemma 2 2B's width and cap (30; and a tighter one), V = 32768, 4096 rows; the
    recompute program and CE-S's capped program ("auto"'s)."""
    errors = _protocol("cuda", 4096, 2304, 32768, cap, method=method)
    _assert_protocol(errors, 2.0**-9 / 4096**0.5)
