"""Cross-entropy options (label smoothing, z-loss) on every path, in float64 on the CPU:
the reference against ``F.cross_entropy`` / the z-loss formula, the public op's kernel program
(tile interpreter) and both ``LMHeadLoss`` methods' kernel sequences against the reference,
loss and every gradient. The B1 program with the smoothing shift compiles for sm_90a."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

import coda
import coda.nn as cnn
from coda.kernels import linear_cross_entropy as lce
from coda.kernels import linear_cross_entropy_bwd as ceb
from coda.reference.cross_entropy import cross_entropy_ref

F64 = torch.float64


def _case(seed):
    rng = random.Random(seed)
    M, d, V = rng.randrange(1, 60), rng.randrange(2, 40), rng.randrange(2, 200)
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, V, (M,), generator=g)
    t[torch.rand(M, generator=g) < 0.2] = -100
    eps, z = rng.choice([0.0, 0.1, 0.37]), rng.choice([0.0, 1e-4, 0.05])
    return M, d, V, t, eps, z, rng.choice(["mean", "sum", "none"]), g


@pytest.mark.parametrize("seed", range(8))
def test_reference_matches_torch_and_the_z_loss_formula(seed):
    M, d, V, t, eps, z, reduction, g = _case(seed)
    logits = torch.randn(M, V, dtype=F64, generator=g) * 3
    got = cross_entropy_ref(logits, t, -100, "none", eps, z)
    want = F.cross_entropy(logits, t, ignore_index=-100, reduction="none", label_smoothing=eps)
    valid = t != -100
    want = want + torch.where(valid, z * torch.logsumexp(logits, -1) ** 2, 0.0)
    assert rel_err(got, want, floor=1.0) < 1e-13
    red = cross_entropy_ref(logits, t, -100, "mean", eps, z)
    assert (torch.isnan(red) and not valid.any()) or rel_err(red, want.sum() / valid.sum()) < 1e-13


@pytest.mark.parametrize("seed", range(8))
def test_public_op_kernel_program_with_options(seed):
    M, d, V, t, eps, z, reduction, g = _case(seed)
    x, w = torch.randn(M, d, dtype=F64, generator=g), torch.randn(d, V, dtype=F64, generator=g)
    r = torch.rand(M, dtype=F64, generator=g) + 0.5
    op = coda.linear_cross_entropy(
        x, w, t, rstd=r, reduction=reduction, label_smoothing=eps, z_loss=z
    )
    parts, tl = lce.lm_head_stats_interpreted(x, w, r, t)
    from coda.primitives.aux import ce_loss_from_stats, combine_lse

    lsum = r * (x @ w.sum(1))
    kern = ce_loss_from_stats(
        combine_lse(parts),
        tl,
        t,
        -100,
        reduction,
        logit_sum=lsum,
        vocab=V,
        label_smoothing=eps,
        z_loss=z,
    )
    if torch.isnan(op).all():
        assert torch.isnan(kern).all()
    else:
        assert rel_err(kern, op, floor=1.0) < 1e-12


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("method", ["recompute", "chunked", "scaled_exp"])
def test_lm_head_kernel_sequence_with_options(seed, method):
    M, d, V, t, eps, z, reduction, g = _case(100 + seed)
    if method == "scaled_exp":  # its vocabulary is a multiple of 128 (targets stay valid)
        V = -(-V // 128) * 128
    torch.manual_seed(seed)
    head = cnn.LMHeadLoss(d, V, method=method, chunk=37, dtype=F64, label_smoothing=eps, z_loss=z)
    x = torch.randn(M, d, dtype=F64, requires_grad=True)
    dl = torch.randn(M, dtype=F64) if reduction == "none" else None
    outs = []
    for run in (lambda: head._kernel_loss(x, t, reduction), lambda: head(x, t, reduction)):
        for p in (x, *head.parameters()):
            p.grad = None
        loss = run()
        loss.backward(dl if dl is not None else torch.ones_like(loss))
        outs.append(
            [
                loss.detach(),
                x.grad.clone(),
                head.final_norm.grad.clone(),
                head.weight.grad.t().clone(),
            ]
        )
    (lk, *gk), (lr, *gr) = outs
    if torch.isnan(lr).all():
        assert torch.isnan(lk).all()
    else:
        assert rel_err(lk, lr, floor=1.0) < 1e-12
    for a, b in zip(gk, gr):
        assert rel_err(a, b, floor=max(float(b.abs().max()), 1e-300)) < 1e-11


def test_bad_options_are_named():
    with pytest.raises(coda.CodaInputError, match="label_smoothing: must be a number in"):
        cnn.LMHeadLoss(8, 16, label_smoothing=1.5)
    with pytest.raises(coda.CodaInputError, match="z_loss: must be a finite number"):
        coda.linear_cross_entropy(
            torch.randn(2, 8), torch.randn(8, 16), torch.zeros(2, dtype=torch.long), z_loss=-1
        )
    from coda.nn.head import lm_head_loss  # the functional form (``coda.transformers``'s)

    # ignore_index an int at every entry point (a float reached torch's loss as a TypeError)
    x, w, t = torch.randn(2, 8), torch.randn(8, 16), torch.zeros(2, dtype=torch.long)
    for bad in (1.5, True, "-100"):
        with pytest.raises(coda.CodaInputError, match="ignore_index: must be an int"):
            coda.linear_cross_entropy(x, w, t, ignore_index=bad)
        with pytest.raises(coda.CodaInputError, match="ignore_index: must be an int"):
            lm_head_loss(x, torch.ones(8), w, t, ignore_index=bad)
        with pytest.raises(coda.CodaInputError, match="ignore_index: must be an int"):
            cnn.LMHeadLoss(8, 16, ignore_index=bad)

    with pytest.raises(coda.CodaInputError, match="eps: must be a finite positive number"):
        lm_head_loss(
            torch.randn(2, 8), torch.ones(8), torch.randn(8, 16), torch.zeros(2).long(), eps=0
        )
    # the targets on another device than the activations (labels left on the host): by name
    elsewhere = torch.zeros(2, 3, dtype=torch.long, device="meta")
    with pytest.raises(coda.CodaInputError, match="one device; got .* target on meta"):
        cnn.LMHeadLoss(8, 16)(torch.randn(2, 3, 8, dtype=torch.bfloat16), elsewhere)


@pytest.mark.compile
def test_shifted_grad_program_compiles_for_sm90():
    assert ceb.compile_grad_logits(256, 1000, shifted=True) in (0, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["recompute", "chunked", "scaled_exp"])
def test_gpu_ce_options_protocol(method):
    """H200: with label smoothing 0.1 and z-loss 1e-4, the kernel path's loss and gradients
    against a float64 reference, no worse than the PyTorch bf16 path (CODA's protocol)."""
    from conftest import fro_err

    torch.manual_seed(0)
    M, d, V = 4096, 2048, 32768
    head = cnn.LMHeadLoss(d, V, method=method, device="cuda", label_smoothing=0.1, z_loss=1e-4)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, V, (M,), device="cuda")
    t[::7] = -100

    def run(module, xx, path):
        xx = xx.detach().clone().requires_grad_(True)
        for p in module.parameters():
            p.grad = None
        loss = module._kernel_loss(xx, t, "mean") if path == "kernel" else module(xx, t)
        loss.backward()
        return [loss.detach(), xx.grad, module.final_norm.grad, module.weight.grad.t()]

    got = run(head, x, "kernel")
    head64 = cnn.LMHeadLoss(d, V, device="cuda", dtype=F64, label_smoothing=0.1, z_loss=1e-4)
    head64.load_hf_state_dict({k: u.double() for k, u in head.hf_state_dict().items()})
    ref = run(head64, x.double(), "reference")
    head.backend = "reference"  # the plain PyTorch bf16 path, same weights
    peer = run(head, x, "reference")
    floor = 2.0**-9 / int((t != -100).sum()) ** 0.5
    for name, a, b, c in zip(("loss", "dx", "dgamma", "dW"), got, ref, peer):
        e_c, e_t = fro_err(a, b), fro_err(c, b)
        if name == "loss":
            e_c, e_t = max(e_c, floor), max(e_t, floor)
        assert e_c <= e_t, f"{method} {name}: {e_c:.3e} > torch bf16 {e_t:.3e}"
