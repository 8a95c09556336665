"""Level 1 proof: every CODA reparameterization equals the canonical math, in float64.

Random small shapes, several random instantiations of every dimension per identity (odd
sizes; M and N not multiples of any tile size), every backward formula against autograd.
Tags [Ix.y] are docs/KERNELS.md's. Tolerance: 1e-12 relative (float64 rounding is ~1e-16; a wrong
formula is off by O(1))."""

import pytest
import torch
from conftest import random_dims, rel_err

from coda.reference import cross_entropy as ce
from coda.reference import layer as L
from coda.reference import rmsnorm as rn
from coda.reference import rope as rp
from coda.reference import swiglu as sg

TOL = 1e-12
SEEDS = range(4)
F64 = torch.float64


def rand(g, *shape):
    return torch.randn(*shape, dtype=F64, generator=g)


@pytest.mark.parametrize("seed", SEEDS)
def test_rmsnorm_two_level_reduction_and_deferred_scale(seed):  # [I2.1-I2.3]
    dims = random_dims(seed, M=(1, 70), K=(1, 50), N=(2, 300), N2=(1, 40), tile=(3, 64))
    g = torch.Generator().manual_seed(seed)
    M, K, N, N2 = dims["M"], dims["K"], dims["N"], dims["N2"]
    x, w, c = rand(g, M, K), rand(g, K, N), rand(g, M, N)
    gamma, w2 = 1 + rand(g, N), rand(g, N, N2)
    h, a, r = rn.gemm_residual_rms_ref(x, w, c, gamma, eps=1e-5)
    P = rn.sumsq_partials_ref(h, dims["tile"])
    assert P.shape == (M, -(-N // dims["tile"]))
    assert rel_err(rn.rstd_from_partials_ref(P, N, 1e-5), rn.rstd_ref(c + x @ w, 1e-5)) < TOL
    canonical = rn.rmsnorm_ref(c + x @ w, gamma, 1e-5) @ w2
    assert rel_err(r[:, None] * (a @ w2), canonical) < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_rmsnorm_backward_canonical_vs_autograd(seed):  # [I5.4, I5.5]
    dims = random_dims(seed, M=(1, 60), d=(2, 90))
    g = torch.Generator().manual_seed(seed)
    h = rand(g, dims["M"], dims["d"]).requires_grad_(True)
    gamma = (1 + rand(g, dims["d"])).requires_grad_(True)
    dy = rand(g, dims["M"], dims["d"])
    rn.rmsnorm_ref(h, gamma, 1e-5).backward(dy)
    dh, dgamma = rn.rmsnorm_bwd_ref(h.detach(), gamma.detach(), rn.rstd_ref(h.detach(), 1e-5), dy)
    assert rel_err(dh, h.grad) < TOL and rel_err(dgamma, gamma.grad) < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_deferred_norm_backward_through_gemm2(seed):  # [I5.6, I5.8]
    """Boundary h -> y = RMSNorm(h) gamma -> z = y @ w2, plus a second consumer of h (dres):
    statistic from GEMM2's output, corr, dgrad epilogue, dgamma partials, wgrad rows."""
    dims = random_dims(seed, M=(1, 50), d=(2, 70), N2=(1, 60), tile_m=(3, 32))
    g = torch.Generator().manual_seed(seed)
    M, d, N2 = dims["M"], dims["d"], dims["N2"]
    h = rand(g, M, d).requires_grad_(True)
    gamma = (1 + rand(g, d)).requires_grad_(True)
    w2 = rand(g, d, N2).requires_grad_(True)
    dz, dres = rand(g, M, N2), rand(g, M, d)
    (rn.rmsnorm_ref(h, gamma, 1e-5) @ w2).backward(dz)
    hd, gd, wd = h.detach(), gamma.detach(), w2.detach()
    r = rn.rstd_ref(hd, 1e-5)
    u = (hd * gd) @ wd
    corr = rn.norm_corr_ref(r, rn.norm_stat_ref(dz, u), d)
    dz_t = r[:, None] * dz
    acc = dz_t @ wd.T
    dh, dgamma = rn.norm_bwd_apply_ref(acc, hd, gd, corr, dres=dres)
    # dgamma as RED_n partials over M-tiles + AUX
    tm = dims["tile_m"]
    parts = torch.stack([(acc * hd)[i : i + tm].sum(0) for i in range(0, M, tm)])
    assert rel_err(dh, h.grad + dres) < TOL
    assert rel_err(dgamma, gamma.grad) < TOL and rel_err(parts.sum(0), gamma.grad) < TOL
    assert rel_err(rn.wgrad_gamma_rows_ref(hd, dz_t, gd), w2.grad) < TOL


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("seed", SEEDS)
def test_swiglu_interleaved_forward_backward(seed, activation):  # [I3.1-I3.3, I5.1]
    dims = random_dims(seed, M=(1, 40), d=(2, 50), f=(1, 45))
    g = torch.Generator().manual_seed(seed)
    M, d, f = dims["M"], dims["d"], dims["f"]
    a, r = rand(g, M, d), 0.5 + rand(g, M).abs()
    wg, wu = rand(g, d, f).requires_grad_(True), rand(g, d, f).requires_grad_(True)
    w_il = sg.interleave_gate_up(wg.detach(), wu.detach())
    assert torch.equal(torch.cat(sg.split_gate_up(w_il), 1), torch.cat([wg, wu], 1))
    lin = sg.interleave_gate_up_linear(wg.detach().T, wu.detach().T)
    assert torch.equal(lin, w_il.T) and all(
        torch.equal(p, q.T) for p, q in zip(sg.split_gate_up_linear(lin), (wg, wu))
    )
    glu = sg.GLU_REFS[activation]
    s, u = sg.gemm_swiglu_ref(a, w_il, r, activation)
    y = r[:, None] * a
    s_canon = glu(y @ wg, y @ wu)
    assert rel_err(s, s_canon) < TOL
    ds = rand(g, M, f)
    s_canon.backward(ds)
    s_re, dz_t, S = sg.dswiglu_ref(ds, u, r, activation)
    assert rel_err(s_re, s) < TOL
    dw_il = a.T @ dz_t  # wgrad of the interleaved weight (r already in dz~)
    dwg, dwu = sg.split_gate_up(dw_il)
    assert rel_err(dwg, wg.grad) < TOL and rel_err(dwu, wu.grad) < TOL
    # S is the norm statistic: sum over GEMM2's output of d(loss)/dz * u
    zz = (r[:, None] * u).requires_grad_(True)
    glu(zz[:, 0::2], zz[:, 1::2]).backward(ds)
    assert rel_err(S, (zz.grad * u).sum(-1)) < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_rope_adjacent_layout(seed):  # [I3.4-I3.7, I5.2, I5.3]
    dims = random_dims(seed, B=(1, 3), S=(1, 13), Hkv=(1, 3), rep=(1, 3), half=(1, 8))
    g = torch.Generator().manual_seed(seed)
    B, S, Hkv, hd = dims["B"], dims["S"], dims["Hkv"], 2 * dims["half"]
    H, M = Hkv * dims["rep"], dims["B"] * dims["S"]
    pos = torch.arange(S).repeat(B)
    theta, cs = rp.rope_angles(pos, hd), rp.rope_table(pos, hd)
    x = rand(g, M, H, hd)
    perm = rp.head_perm(hd)
    assert (
        rel_err(rp.rope_adjacent_ref(x[..., perm], cs), rp.rope_hf_ref(x, theta)[..., perm]) < TOL
    )
    assert rel_err(rp.rope_adjacent_bwd_ref(rp.rope_adjacent_ref(x, cs), cs), x) < TOL
    # weight converters: exact round trips, both storage forms
    d = 5
    wq = rand(g, d, H * hd)
    adj = rp.hf_to_adjacent_columns(wq, H, hd)
    assert torch.equal(rp.adjacent_to_hf_columns(adj, H, hd), wq)
    assert torch.equal(rp.hf_to_adjacent_linear(wq.T, H, hd), adj.T)
    assert torch.equal(rp.adjacent_to_hf_linear(adj.T, H, hd), wq.T)
    # attention output unchanged by the q/k pair permutation (GQA, causal)
    s = L.LayerShape(B, S, d, H, Hkv, hd, ffn=4, vocab=4)
    y, wk, wv = rand(g, M, d), rand(g, d, Hkv * hd), rand(g, d, Hkv * hd)
    q = rp.rope_hf_ref((y @ wq).view(M, H, hd), theta).flatten(1)
    k = rp.rope_hf_ref((y @ wk).view(M, Hkv, hd), theta).flatten(1)
    qa = rp.rope_adjacent_ref((y @ adj).view(M, H, hd), cs).flatten(1)
    ka = rp.rope_adjacent_ref((y @ rp.hf_to_adjacent_columns(wk, Hkv, hd)).view(M, Hkv, hd), cs)
    o_hf = L.attention_ref(q, k, y @ wv, s)
    assert rel_err(L.attention_ref(qa, ka.flatten(1), y @ wv, s), o_hf) < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_cross_entropy_partials_and_backward(seed):  # [I4.1-I4.4]
    dims = random_dims(seed, M=(1, 50), V=(2, 300), tile=(3, 64), d=(1, 20))
    g = torch.Generator().manual_seed(seed)
    M, V, d = dims["M"], dims["V"], dims["d"]
    a, w, r = rand(g, M, d), rand(g, d, V), 0.5 + rand(g, M).abs()
    target = torch.randint(0, V, (M,), generator=g)
    target[torch.rand(M, generator=g) < 0.2] = -100
    logits = (r[:, None] * (a @ w)).requires_grad_(True)
    parts = ce.lse_partials_ref(logits.detach(), dims["tile"])
    lse = ce.lse_combine_ref(parts)
    shuffled = ce.lse_combine_ref(parts[:, torch.randperm(parts.shape[1], generator=g)])
    assert rel_err(lse, torch.logsumexp(logits.detach(), -1)) < TOL
    assert rel_err(shuffled, lse) < TOL
    tl = logits.detach().gather(1, target.clamp(min=0)[:, None])[:, 0]
    loss = ce.cross_entropy_ref(logits, target)
    if (target != -100).any():
        assert rel_err(ce.ce_from_stats_ref(lse, tl, target), loss.detach()) < TOL
        assert rel_err(ce.linear_cross_entropy_ref(a, w, r, target), loss.detach()) < TOL
        loss.backward()
        assert rel_err(ce.dlogits_ref(logits.detach(), lse, target), logits.grad) < TOL
    # stability: logits of +-1e4 stay finite
    big = torch.tensor([[1e4, -1e4, 0.0, 1e4]], dtype=F64)
    assert torch.isfinite(ce.lse_combine_ref(ce.lse_partials_ref(big, 3))).all()


@pytest.mark.parametrize("seed", SEEDS)
def test_full_layer_sequence_matches_autograd(seed):  # [I5.9-I5.14, I4.5]
    dims = random_dims(
        seed,
        B=(1, 3),
        S=(1, 9),
        Hkv=(1, 2),
        rep=(1, 3),
        half=(1, 4),
        d=(3, 29),
        f=(1, 37),
        V=(2, 61),
        tile=(3, 40),
    )
    s = L.LayerShape(
        dims["B"],
        dims["S"],
        dims["d"],
        dims["Hkv"] * dims["rep"],
        dims["Hkv"],
        2 * dims["half"],
        dims["f"],
        dims["V"],
        activation=("silu", "gelu_tanh")[seed % 2],  # the MLP's gate: SwiGLU or GeGLU
    )
    g = torch.Generator().manual_seed(100 + seed)
    w = L.random_layer_weights(s, generator=g)
    x0 = rand(g, s.tokens, s.d)
    target = torch.randint(0, s.vocab, (s.tokens,), generator=g)
    target[0] = -100 if s.tokens > 1 else target[0]
    wl = {k: t.clone().requires_grad_(True) for k, t in w.items()}
    x0l = x0.clone().requires_grad_(True)
    loss_ref = L.lm_head_loss_ref(L.llama_layer_ref(x0l, wl, s), wl, target, s)
    loss_ref.backward()
    loss, dx0, gr = L.coda_layer_sequence_ref(x0, L.to_coda_layout(w, s), target, s, dims["tile"])
    grads = L.from_coda_grads(gr, s)
    assert rel_err(loss, loss_ref.detach()) < TOL
    assert rel_err(dx0, x0l.grad) < TOL
    assert set(grads) == set(w)
    # With seq = 1 every token attends only to itself, so the q and k gradients are exactly
    # zero and both sides hold only round-off: compare every gradient on the scale of the
    # largest one (an absolute floor), never round-off to round-off.
    floor = max(float(wl[name].grad.abs().max()) for name in w)
    for name in w:
        assert rel_err(grads[name], wl[name].grad, floor=floor) < TOL, name
    if s.seq == 1:
        assert float(wl["wq"].grad.abs().max()) < 1e-12 * floor
