"""The scaled-exp LM-head GEMM (``coda.kernels.ce_scaled_exp``), the method around it (its
row passes' torch forms) and its ``TileMaxLog2`` primitive: level 1 (float64 through the tile
interpreter, against the definitions and against the softmax / logsumexp they
reparameterize) and level 2 (sm_90a compiles). Level 3 (the H200) is the LM-head ``gpu``
tests' "scaled_exp" cases: it is ``LMHeadLoss``'s default method. The row passes' Triton
kernels: tests/test_ce_scaled_rows.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rel_err

from coda.kernels import ce_scaled_exp as cse
from coda.kernels import ce_scaled_rows as rows
from coda.kernels.config import GemmConfig
from coda.reference.cross_entropy import scaled_exp_logits_ref

F64 = torch.float64


def _case(seed, M, d, V, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, d, generator=g, dtype=F64)
    w = torch.randn(d, V, generator=g, dtype=F64) * (scale / math.sqrt(d))
    rstd = torch.rand(M, generator=g, dtype=F64) + 0.5
    t = torch.randint(0, V, (M,), generator=g)
    t[torch.rand(M, generator=g) < 0.2] = -100  # ignored rows: never selected
    return a, w, rstd, t


@pytest.mark.parametrize(
    "seed, M, d, V, tile_m, tile_n",
    [
        (0, 1, 8, 64, 64, 64),
        (1, 37, 24, 192, 64, 64),
        (2, 130, 40, 384, 128, 192),
        (3, 257, 16, 256, 128, 128),
        (4, 64, 8, 512, 64, 256),
    ],
)
def test_kernel_equals_its_definition_and_the_softmax(seed, M, d, V, tile_m, tile_n):
    a, w, rstd, t = _case(seed, M, d, V, scale=8.0)
    cfg = GemmConfig(tile_m=tile_m, tile_n=tile_n)
    e, s, k, tl = cse.scaled_exp_logits_kernel(a, w, rstd, t, cfg)
    want = scaled_exp_logits_ref(a, w, rstd, t, tile_n)
    for got, ref in zip((e, s, k, tl), want):
        assert rel_err(got, ref, floor=1.0) < 1e-12
    # the reparameterization: k integers, E <= sqrt 2, E 2^k = exp(l), lse and softmax exact
    assert torch.equal(k, k.round()) and float(e.max()) <= math.sqrt(2) * (1 + 1e-12)
    logits = rstd[:, None] * (a @ w)
    T = V // tile_n
    k_cols = k.repeat_interleave(tile_n, dim=1)
    assert rel_err(e * torch.exp2(k_cols), logits.exp()) < 1e-12
    lse = rows.lse_from_scaled(s, k)
    assert rel_err(lse, torch.logsumexp(logits, dim=1)) < 1e-14
    K = k.amax(1, keepdim=True)
    v = torch.exp2(K[:, 0]) * torch.exp(-lse)
    p = torch.exp2(k - K).repeat_interleave(tile_n, dim=1) * v[:, None] * e
    assert rel_err(p, torch.softmax(logits, dim=1)) < 1e-12
    assert s.shape == k.shape == (M, T)
    hit = t >= 0
    assert torch.equal(tl[~hit], torch.zeros_like(tl[~hit]))


def test_no_overflow_at_large_logits_in_fp32():
    """Logits in the thousands: exp(l) overflows fp32, the scaled form does not."""
    a, w, rstd, t = _case(5, 64, 16, 128, scale=4000.0)
    cfg = GemmConfig(tile_m=64, tile_n=64)
    e, s, k, _ = cse.scaled_exp_logits_kernel(a.float(), w.float(), rstd.float(), t, cfg)
    assert torch.isfinite(e).all() and torch.isfinite(s).all()
    logits = rstd[:, None] * (a @ w)
    assert float(logits.abs().max()) > 1000
    lse = rows.lse_from_scaled(s.double(), k.double())
    assert rel_err(lse, torch.logsumexp(logits, dim=1)) < 1e-6


def test_tile_must_divide_the_vocabulary():
    a, w, rstd, t = _case(6, 8, 8, 200)
    with pytest.raises(ValueError, match="multiple of tile_n"):
        cse.scaled_exp_logits_kernel(a, w, rstd, t, GemmConfig(tile_m=64, tile_n=64))
    assert cse.scaled_exp_config(128256, GemmConfig()).tile_n == 192
    assert cse.scaled_exp_config(32768, GemmConfig()).tile_n == 128
    with pytest.raises(ValueError, match="divisible by 64"):
        cse.scaled_exp_config(200, GemmConfig())


@pytest.mark.compile
@pytest.mark.parametrize("v, tile_n", [(768, 192), (512, 128)])
def test_scaled_exp_logits_compiles_for_sm90(v, tile_n):
    cfg = GemmConfig(tile_n=tile_n)
    assert cse.compile_scaled_exp_logits(512, v, config=cfg) in (0, 1)
    assert cse.compile_scaled_exp_logits(512, v, config=cfg, capped=True) in (0, 1)


def _autograd_reference(a, w, rstd, t, weight, smoothing, z_loss):
    """G = dL/da and dW = dL/dW of L = sum_m w_m ce_m(r_m (a_m W)) by autograd (float64)."""
    a, w = a.clone().requires_grad_(True), w.clone().requires_grad_(True)
    logits = rstd[:, None] * (a @ w)
    lse = torch.logsumexp(logits, dim=1)
    valid = (t >= 0) & (t < w.shape[1])
    ly = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
    ce = lse - (1 - smoothing) * ly - smoothing * logits.mean(1) + z_loss * lse**2
    (weight * torch.where(valid, ce, 0.0)).sum().backward()
    return lse.detach(), ly.detach(), a.grad, w.grad


def _with_targets(G, coef, t, w):
    """dL/da from the program's softmax share G and its target coefficients: G + coef W[:, y]
    (the backward's first step, ``head_norm_backward``)."""
    y = t.clamp(0, w.shape[1] - 1).long()
    return G + coef[:, None] * w.t()[y].to(G.dtype)


@pytest.mark.parametrize(
    "seed, M, d, V, rows, smoothing, z_loss",
    [
        (0, 1, 8, 128, 128, 0.0, 0.0),
        (1, 37, 24, 384, 128, 0.0, 0.0),
        (2, 300, 16, 256, 128, 0.1, 0.0),  # three chunks, the last one padded
        (3, 130, 40, 128, 256, 0.0, 1e-3),
        (4, 257, 8, 384, 128, 0.05, 1e-2),
        (5, 256, 16, 256, 256, 0.1, 1e-3),  # one whole chunk: its rows are the call's
        (6, 128, 24, 384, 128, 0.0, 0.0),
    ],
)
def test_three_gemm_method_equals_autograd(seed, M, d, V, rows, smoothing, z_loss):
    """CE-S end to end in float64 (GEMM1, the glue with the target fix, the dX and dW GEMMs
    through their A-operand transform, the rank-1 smoothing terms): lse, the target logit,
    dL/da (the softmax share plus the target entries), the final norm's statistic S and dL/dW
    equal autograd's through the canonical loss, and the softmax share alone is autograd's
    off the target entries."""
    from coda.primitives.aux import ce_row_weights

    a, w, rstd, t = _case(seed, M, d, V, scale=3.0)
    weight = ce_row_weights(t, -100, "mean", F64)
    lse, tl, G, coef, S, dw = cse.linear_cross_entropy_scaled(
        a, w, rstd, t, weight, rows=rows, interpreted=True, label_smoothing=smoothing, z_loss=z_loss
    )
    lse_r, ly_r, G_r, dw_r = _autograd_reference(a, w, rstd, t, weight, smoothing, z_loss)
    valid = t >= 0
    assert rel_err(lse, lse_r) < 1e-12
    assert rel_err(tl[valid], ly_r[valid]) < 1e-12
    assert rel_err(_with_targets(G, coef, t, w), G_r) < 1e-11
    assert rel_err(dw, dw_r) < 1e-11
    # the target entries' share, alone: coef_m W[:, y_m] is autograd's G less the rest
    assert rel_err(_with_targets(torch.zeros_like(G), coef, t, w), G_r - G) < 1e-10
    assert rel_err(S, (G_r * a).sum(-1) / rstd) < 1e-11


def test_each_token_chunk_s_numerators_are_freed_before_the_next_chunk_s(monkeypatch):
    """CE-S keeps one chunk's E (rows x V bf16, 1 GiB at its default) alive at a time: when the
    logits GEMM makes a chunk's E, no earlier chunk's is still referenced (the loop's name held
    the last one until rebound, 1 GiB more at d = 4096, V = 128256 before session 83)."""
    import weakref

    made = []
    kernel = cse.scaled_exp_logits_kernel

    def recording(*args, **kwargs):
        assert all(ref() is None for ref in made), "an earlier chunk's E is still alive"
        out = kernel(*args, **kwargs)
        made.append(weakref.ref(out[0]))
        return out

    monkeypatch.setattr(cse, "scaled_exp_logits_kernel", recording)
    a, w, rstd, t = _case(0, 300, 16, 256)
    from coda.primitives.aux import ce_row_weights

    weight = ce_row_weights(t, -100, "mean", F64)
    cse.linear_cross_entropy_scaled(a, w, rstd, t, weight, rows=128, interpreted=True)
    assert len(made) == 3  # three chunks


@pytest.mark.parametrize("config", cse.LOGITS_CANDIDATES, ids=str)
def test_three_gemm_method_is_the_same_at_every_logits_tile(config):
    """The strips u follow GEMM1's tile (one tile maximum per tile_n columns, read by the
    gradient GEMMs per 64-column strip): CE-S at each tile ``tune_configs.py`` sweeps for GEMM1
    (V = 768: every tile_n divides it; two chunks) equals autograd in float64, so a tuned
    GEMM1 tile would change the speed only."""
    from coda.primitives.aux import ce_row_weights

    a, w, rstd, t = _case(7, 200, 24, 768, scale=3.0)
    weight = ce_row_weights(t, -100, "mean", F64)
    lse, tl, G, coef, S, dw = cse.linear_cross_entropy_scaled(
        a, w, rstd, t, weight, rows=128, config=config, interpreted=True
    )
    lse_r, ly_r, G_r, dw_r = _autograd_reference(a, w, rstd, t, weight, 0.0, 0.0)
    assert rel_err(lse, lse_r) < 1e-12
    assert rel_err(_with_targets(G, coef, t, w), G_r) < 1e-11
    assert rel_err(dw, dw_r) < 1e-11
    assert rel_err(S, (G_r * a).sum(-1) / rstd) < 1e-11


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_three_gemm_method_ties_at_every_logits_tile():
    """H200: CE-S in bf16 at each tile swept for GEMM1 (V = 6144: every tile_n divides it;
    1000 rows in two chunks, the last one padded): lse, dL/da and dW each as close to float64
    autograd (on the same bf16 inputs) as at the first tile, within the tie band of their
    reference, so a tuned GEMM1 tile never trades accuracy for speed."""
    from conftest import fro_err, tie_band

    from coda.primitives.aux import ce_row_weights

    a, w, rstd, t = (x.cuda() for x in _case(9, 1000, 512, 6144, scale=3.0))
    a16, w16, r32 = a.bfloat16(), w.bfloat16(), rstd.float()
    weight = ce_row_weights(t, -100, "mean", torch.float32)
    ref = _autograd_reference(a16.double(), w16.double(), r32.double(), t, weight.double(), 0, 0)
    errs = []
    for config in cse.LOGITS_CANDIDATES:
        lse, _, G, coef, _, dw = cse.linear_cross_entropy_scaled(
            a16, w16, r32, t, weight, rows=512, config=config
        )
        got = (lse, _with_targets(G, coef, t, w16), dw)
        assert all(torch.isfinite(x).all() for x in got), config
        errs.append([fro_err(x, r) for x, r in zip(got, (ref[0], ref[2], ref[3]))])
    for config, e in zip(cse.LOGITS_CANDIDATES, errs):
        for name, e_k, e_0, r in zip(("lse", "dx", "dw"), e, errs[0], (ref[0], ref[2], ref[3])):
            # (+ 1e-7: lse is fp32 sums in a tile-dependent order, an error of that size)
            assert e_k <= e_0 * (1 + tie_band(r)) + 1e-7, (config, name, e_k, e_0)


def test_scale_a_strip_rules_are_coda_errors():
    import coda

    a, w, rstd, t = _case(7, 100, 8, 128)
    weight = torch.ones(100, dtype=F64)
    with pytest.raises(coda.CodaInputError, match="V % 128 == 0"):
        cse.linear_cross_entropy_scaled(a, w[:, :120], rstd, t.clamp(max=119), weight)
    e = torch.zeros(100, 128, dtype=F64)
    u = torch.ones(2, 100, dtype=F64)
    with pytest.raises(coda.CodaInputError, match="multiple of tile_m = 128"):
        cse.scaled_grad_dx_kernel(e, w, u, torch.ones(100, dtype=F64), a, torch.empty(100, 8))
    e = torch.zeros(128, 128, dtype=F64)
    with pytest.raises(coda.CodaInputError, match=r"shape \(2, 128\)"):
        a = torch.zeros(128, 8, dtype=F64)
        cse.scaled_grad_dx_kernel(e, w, u, torch.ones(128, dtype=F64), a, torch.empty(128, 8))


@pytest.mark.compile
@pytest.mark.parametrize("which", ["dx", "dw", "dw_accumulate"])
@pytest.mark.parametrize("d", [512, 768, 1000])  # tile_n 256, 192, 128 (``_grad_tile_n``)
def test_gradient_gemms_compile_for_sm90(which, d):
    if which == "dx":
        n = cse.compile_scaled_grad_dx(d, 768)
    else:
        n = cse.compile_scaled_grad_dw(d, 768, accumulate=which == "dw_accumulate")
    assert n in (0, 1)


@pytest.mark.compile
@pytest.mark.parametrize("config", cse.GRAD_CANDIDATES)
def test_gradient_gemms_compile_at_every_swept_config(config):
    """Each config ``benchmarks/tune_configs.py`` sweeps for the two gradient GEMMs compiles."""
    assert cse.compile_scaled_grad_dx(512, 768, config=config) in (0, 1)
    assert cse.compile_scaled_grad_dw(512, 768, accumulate=True, config=config) in (0, 1)


@pytest.mark.compile
@pytest.mark.parametrize("config", cse.LOGITS_CANDIDATES)
def test_logits_gemm_compiles_at_every_swept_config(config):
    """Each config ``benchmarks/tune_configs.py`` sweeps for GEMM1 (``ce_logits``) compiles
    (V = 768: every candidate's tile_n divides it)."""
    assert cse.compile_scaled_exp_logits(512, 768, config=config) in (0, 1)


@pytest.mark.compile
def test_the_deferred_dw_probe_compiles():
    """``tune_configs``' probe for the LM head's last dW chunk (fp32 C in, bf16 D out,
    cooperative with the A-operand transform) compiles for sm_90a on its default config: the
    next device session times it (``ce_grad_dw_final``)."""
    from benchmarks.tune_configs import dw_probe

    m, d, v = 256, 512, 768
    e, xs = torch.empty(m, v, dtype=torch.bfloat16), torch.empty(m, d, dtype=torch.bfloat16)
    u = torch.empty(v // cse.STRIP, m, dtype=torch.bfloat16)
    acc, out = torch.empty(v, d), torch.empty(v, d, dtype=torch.bfloat16)
    compiled = dw_probe(e, xs, u, acc, torch.tensor(1.0), out, cse.dw_config(d), dry=True)
    assert compiled in (0, 1)


def test_grad_tile_n_divides_d():
    for d, tn in ((2048, 256), (4096, 256), (8192, 256), (1536, 192), (3072, 192), (1000, 128)):
        assert cse._grad_tile_n(d) == tn, d


def test_far_tiles_stay_finite_in_bf16():
    """bf16 through the interpreter (a model of the GPU's rounding): a row whose target sits in
    a tile ~120 nats under the row's maximum; 2^(k - K) would underflow bf16 and its target
    entry overflow. The strip floor keeps every gradient finite and close to float64's."""
    from coda.primitives.aux import ce_row_weights

    M, d, V = 128, 16, 256
    g = torch.Generator().manual_seed(8)
    a = torch.randn(M, d, generator=g, dtype=F64)
    w = torch.randn(d, V, generator=g, dtype=F64) * 0.1
    w[:, :128] += 40.0 * a[0][:, None] / a[0].norm()  # row 0: tile 0 far above tile 1
    rstd = torch.ones(M, dtype=F64)
    t = torch.randint(0, V, (M,), generator=g)
    t[0] = 200  # in the far tile
    weight = ce_row_weights(t, -100, "sum", F64)
    logits = a @ w
    assert float(logits[0, :128].max() - logits[0, 128:].max()) > 100
    bf = torch.bfloat16
    _, _, G, coef, _, dw = cse.linear_cross_entropy_scaled(
        a.to(bf), w.to(bf), rstd.float(), t, weight.float(), rows=128, interpreted=True
    )
    G = _with_targets(G, coef, t, w.to(bf))
    _, _, G_r, dw_r = _autograd_reference(a, w, rstd, t, weight, 0.0, 0.0)
    assert torch.isfinite(G).all() and torch.isfinite(dw.float()).all()
    assert rel_err(G, G_r) < 0.05 and rel_err(dw, dw_r) < 0.05


def test_three_gemm_method_fuzz_float64():
    """40 random cases: odd token counts (1 included), chunks of 128 or 256 rows, V from 128
    to 640, d a multiple of 8, ignore patterns (none, some, all, first), mean or sum,
    smoothing and z-loss on or off; every output equals autograd's through the canonical loss."""
    import random

    from coda.primitives.aux import ce_row_weights

    for case in range(40):
        rng = random.Random(500 + case)
        M = rng.choice([1, 2, 127, 129, rng.randrange(1, 400)])
        d, V = 8 * rng.randrange(1, 9), 128 * rng.randrange(1, 6)
        a, w, rstd, t = _case(500 + case, M, d, V, scale=rng.choice([0.5, 3.0]))
        pattern = rng.choice(["none", "some", "all", "first"])
        t[:] = t.clamp(min=0)
        if pattern == "some":
            t[torch.rand(M) < 0.3] = -100
        elif pattern == "all":
            t[:] = -100
        elif pattern == "first":
            t[0] = -100
        reduction = rng.choice(["mean", "sum"])
        smoothing, z_loss = rng.choice([0.0, 0.1]), rng.choice([0.0, 1e-3])
        weight = ce_row_weights(t, -100, reduction, F64)
        lse, tl, G, coef, S, dw = cse.linear_cross_entropy_scaled(
            a,
            w,
            rstd,
            t,
            weight,
            rows=rng.choice([128, 256]),
            interpreted=True,
            label_smoothing=smoothing,
            z_loss=z_loss,
        )
        lse_r, ly_r, G_r, dw_r = _autograd_reference(a, w, rstd, t, weight, smoothing, z_loss)
        what = f"case {case}: M {M}, d {d}, V {V}, {pattern}, {reduction}"
        assert rel_err(lse, lse_r) < 1e-12, what
        valid = t >= 0
        assert rel_err(tl[valid], ly_r[valid], floor=1.0) < 1e-12, what
        scale = max(float(G_r.abs().max()), float(dw_r.abs().max()), 1e-300)
        assert rel_err(_with_targets(G, coef, t, w), G_r, floor=scale) < 1e-11, what
        assert rel_err(dw, dw_r, floor=scale) < 1e-11, what
        S_r = (G_r * a).sum(-1) / rstd
        assert rel_err(S, S_r, floor=max(float(S_r.abs().max()), 1e-300)) < 1e-11, what


def test_lm_head_loss_names_the_vocabulary_rule(monkeypatch):
    """The module's kernel path refuses a vocabulary the strips cannot tile, before any work."""
    import coda
    import coda.nn as cnn
    from coda.nn import head as nn_head

    monkeypatch.setattr(nn_head, "resolve_backend", lambda *a, **k: "kernel")
    head = cnn.LMHeadLoss(16, 200, method="scaled_exp", dtype=F64)
    with pytest.raises(coda.CodaInputError, match="vocab % 128 == 0"):
        head(torch.randn(4, 16, dtype=F64), torch.zeros(4, dtype=torch.long))
