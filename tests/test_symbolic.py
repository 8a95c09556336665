"""Level 1 proof, symbolic (Cleave's equivalence testing): each epilogue program's own ``fn``,
evaluated on sympy symbols (``coda.primitives.symbolic``), equals the canonical math it
reparameterizes, as an identity in every variable: the gradients it stores are sympy's
derivatives of the forward it inverts, its reduction terms are the derivatives a later AUX
step sums. The float64 tests (``test_reference_algebra``, the interpreter's) prove the tile
grid around each element; these prove the element itself, for all values at once.
A wrong sign, factor or lane is a nonzero difference, and the test fails."""

from __future__ import annotations

import pytest
import sympy as sp  # torch's own dependency: always installed beside it

from coda.kernels import dswiglu as dsw
from coda.kernels import gemm_residual_rms as grr
from coda.kernels import gemm_rmsnorm_gemm as grg
from coda.kernels import gemm_rope as rope
from coda.kernels import gemm_swiglu as sw
from coda.kernels import linear_cross_entropy as lce
from coda.kernels import linear_cross_entropy_bwd as ceb
from coda.kernels import linear_cross_entropy_chunked as cec
from coda.kernels import qk_norm as qk
from coda.kernels import rmsnorm_bwd as nb
from coda.kernels.ce_scaled_exp import (
    capped_scaled_exp_logits,
    scaled_exp_logits,
    scaled_grad_dw,
    scaled_grad_dx,
)
from coda.primitives.symbolic import evaluate, prepass


def silu(z):
    return z / (1 + sp.exp(-z))


def same(a, b) -> bool:
    """a == b as an identity (the difference simplifies to 0)."""
    return sp.simplify(a - b) == 0


def test_swiglu_stores_the_preactivation_and_silu_of_the_scaled_gate_times_up():
    a_g, a_u, r = sp.symbols("a_g a_u r")
    for program in (sw.swiglu_keep_preact, sw.swiglu_only):
        out = evaluate(program, acc=(a_g, a_u), rstd=r)
        assert same(out["s"], silu(r * a_g) * (r * a_u))
    assert evaluate(sw.swiglu_keep_preact, acc=(a_g, a_u), rstd=r)["D"] == (a_g, a_u)


def test_dswiglu_pair_is_the_gradient_of_the_forward_and_its_statistic_the_rstd_gradient():
    """B4: with s = silu(r u_g) r u_u the forward, and ds the upstream gradient (acc): the
    stored pair is ds ds/du (gate, up), the recomputed s is s, and the row statistic is
    ds ds/dr, what the norm's backward needs of this GEMM (corr = -(r^3/d) sum_t stat)."""
    ds, u_g, u_u, r = sp.symbols("ds u_g u_u r")
    s = silu(r * u_g) * (r * u_u)
    out = evaluate(dsw.dswiglu_rescaled, acc=ds, c=(u_g, u_u), rstd=r)
    assert same(out["D"][0], ds * sp.diff(s, u_g))
    assert same(out["D"][1], ds * sp.diff(s, u_u))
    assert same(out["s"], s)
    assert same(out["stat"], ds * sp.diff(s, r))


def test_dswiglu_proof_fails_on_a_wrong_formula():
    """The proof can fail: the same check against a swapped lane is not an identity."""
    ds, u_g, u_u, r = sp.symbols("ds u_g u_u r")
    s = silu(r * u_g) * (r * u_u)
    out = evaluate(dsw.dswiglu_rescaled, acc=ds, c=(u_g, u_u), rstd=r)
    assert not same(out["D"][0], ds * sp.diff(s, u_u))


def test_relu2_stores_the_preactivation_and_the_square_of_relu_of_the_scaled_column():
    """F4 without a gate (Arcee's relu2): s = relu(r acc)^2, u = acc, in both regimes of the
    sign (r > 0: a norm's rstd; acc = +p or -p with p > 0, where relu is p or 0)."""
    p, r = sp.symbols("p r", positive=True)
    for acc, relu_z in ((p, r * p), (-p, 0)):
        for program in (sw.relu2_keep_preact, sw.relu2_only):
            assert same(evaluate(program, acc=acc, rstd=r)["s"], relu_z**2)
        assert evaluate(sw.relu2_keep_preact, acc=acc, rstd=r)["D"] == acc


def test_drelu2_is_the_gradient_of_the_forward_and_its_statistic_the_rstd_gradient():
    """B4 without a gate: with s = relu(r u)^2 the forward (written per regime, u = +p or
    -p) and ds the upstream gradient: D = ds ds/du, the recomputed s, and the row statistic
    ds ds/dr, as for SwiGLU; and the proof fails on a wrong slope."""
    ds = sp.Symbol("ds", real=True)
    p, r = sp.symbols("p r", positive=True)
    u = sp.Symbol("u", real=True)
    for sign in (1, -1):
        s = (r * u) ** 2 if sign > 0 else sp.Integer(0)  # relu(r u)^2 where u has this sign
        out = evaluate(dsw.drelu2_rescaled, acc=ds, c=sign * p, rstd=r)
        at = {u: sign * p}
        assert same(out["D"], (ds * sp.diff(s, u)).subs(at))
        assert same(out["s"], s.subs(at))
        assert same(out["stat"], (ds * sp.diff(s, r)).subs(at))
    out = evaluate(dsw.drelu2_rescaled, acc=ds, c=p, rstd=r)
    assert not same(out["D"], ds * r * p)  # (the slope's factor 2 matters)


# xIELU's three regimes, each at a point z = r u of it (u = z / r: r stays a symbol): above 0,
# between eps and 0 (where min(z, eps) is eps), below eps; eps HF's -1e-6
XIELU_EPS = sp.Rational(-1, 10**6)
XIELU_REGIMES = (sp.Rational(3, 2), sp.Rational(-1, 10**7), sp.Rational(-1, 2))


def _xielu_regime(z, a_p, a_n, beta):
    """xIELU at z, written for the regime the point ``at`` lies in (no select)."""
    return lambda at: (
        a_p * z**2 + beta * z if at > 0
        else a_n * ((sp.exp(XIELU_EPS) - 1) if at >= XIELU_EPS else (sp.exp(z) - 1)) - a_n * z
        + beta * z
    )  # fmt: skip


def test_xielu_forward_and_backward_are_the_math_and_its_gradients():
    """F4's xIELU programs store u = acc and s = xielu(r acc); B4's D is ds ds/du, s again,
    the statistic ds ds/dr, and the two coefficient partials ds ds/da_p, ds ds/da_n, in each
    of the three regimes (the forward written per regime, differentiated by sympy)."""
    ds, a_p, a_n, beta, r = sp.symbols("ds a_p a_n beta r", positive=True)
    u = sp.Symbol("u", real=True)
    nums = dict(a_p=a_p, a_n=a_n, beta=beta, eps=XIELU_EPS)
    for at in XIELU_REGIMES:
        s = _xielu_regime(r * u, a_p, a_n, beta)(at)
        point = {u: at / r}
        for program in (sw.xielu_keep_preact, sw.xielu_only):
            assert same(evaluate(program, acc=at / r, rstd=r, **nums)["s"], s.subs(point))
        assert evaluate(sw.xielu_keep_preact, acc=at / r, rstd=r, **nums)["D"] == at / r
        out = evaluate(dsw.dxielu_rescaled, acc=ds, c=at / r, rstd=r, **nums)
        assert same(out["D"], (ds * sp.diff(s, u)).subs(point)), at
        assert same(out["s"], s.subs(point))
        assert same(out["stat"], (ds * sp.diff(s, r)).subs(point))
        assert same(out["d_ap"], (ds * sp.diff(s, a_p)).subs(point))
        assert same(out["d_an"], (ds * sp.diff(s, a_n)).subs(point))
    out = evaluate(dsw.dxielu_rescaled, acc=ds, c=XIELU_REGIMES[0] / r, rstd=r, **nums)
    assert not same(out["D"], ds * r * (a_p * XIELU_REGIMES[0] + beta))  # (the slope's 2)


@pytest.fixture
def gelu_constants(monkeypatch):
    """GELU's tanh-form constants as symbols (K2 = 2 k, a), so that the GeGLU proofs are
    identities in them, not in two roundings of each; their values are checked apart."""
    import coda.primitives.math as pm

    k2, a = sp.symbols("K2 a", positive=True)
    monkeypatch.setattr(pm, "GELU_TANH_K2", k2)
    monkeypatch.setattr(pm, "GELU_TANH_A", a)
    return k2, a


def gelu_tanh(z, k2, a):
    """The textbook form, 0.5 z (1 + tanh(k (z + a z^3))), k = K2 / 2."""
    return z / 2 * (1 + sp.tanh(k2 / 2 * (z + a * z**3)))


def same_exp(a, b) -> bool:
    """``same``, with tanh written through exp first (the kernels' sigmoid form)."""
    return sp.simplify((a - b).rewrite(sp.exp)) == 0


def test_gelu_constants_are_geluts():
    import math

    import coda.primitives.math as pm

    assert pm.GELU_TANH_K2 == 2 * math.sqrt(2 / math.pi) and pm.GELU_TANH_A == 0.044715


def test_geglu_stores_the_preactivation_and_gelu_of_the_scaled_gate_times_up(gelu_constants):
    a_g, a_u, r = sp.symbols("a_g a_u r")
    for program in (sw.geglu_keep_preact, sw.geglu_only):
        out = evaluate(program, acc=(a_g, a_u), rstd=r)
        assert same_exp(out["s"], gelu_tanh(r * a_g, *gelu_constants) * (r * a_u))
    assert evaluate(sw.geglu_keep_preact, acc=(a_g, a_u), rstd=r)["D"] == (a_g, a_u)


def test_dgeglu_pair_is_the_gradient_of_the_forward_and_its_statistic_the_rstd_gradient(
    gelu_constants,
):
    """B4 for GeGLU, as ``test_dswiglu_pair_...`` for SwiGLU; and the proof fails on a
    swapped lane."""
    ds, u_g, u_u, r = sp.symbols("ds u_g u_u r")
    s = gelu_tanh(r * u_g, *gelu_constants) * (r * u_u)
    out = evaluate(dsw.dgeglu_rescaled, acc=ds, c=(u_g, u_u), rstd=r)
    assert same_exp(out["D"][0], ds * sp.diff(s, u_g))
    assert same_exp(out["D"][1], ds * sp.diff(s, u_u))
    assert same_exp(out["s"], s)
    assert same_exp(out["stat"], ds * sp.diff(s, r))
    assert not same_exp(out["D"][0], ds * sp.diff(s, u_u))


def test_rope_rotates_each_pair_by_position_times_frequency():
    """F1: the pair (x1, x2) = r acc rotates by theta = pos * inv_freq, where the frequency
    row holds inv_freq / 2pi split as (hi, lo): x1 + i x2 times e^(i theta); the rotation
    keeps the pair's norm, and rotating back by -theta (dRoPE) returns it."""
    a1, a2, r, pos, hi, lo = sp.symbols("a1 a2 r pos hi lo", real=True)
    out = evaluate(rope.rope_scaled, acc=(a1, a2), rstd=r, pos=pos, freq=(hi, lo))
    theta = pos * 2 * sp.pi * (hi + lo)
    rotated = sp.expand_complex((r * a1 + sp.I * r * a2) * sp.exp(sp.I * theta))
    assert same(out["D"][0], sp.re(rotated)) and same(out["D"][1], sp.im(rotated))
    assert same(out["D"][0] ** 2 + out["D"][1] ** 2, r**2 * (a1**2 + a2**2))
    back = evaluate(rope.rope_scaled, acc=out["D"], rstd=1, pos=-pos, freq=(hi, lo))["D"]
    assert same(back[0], r * a1) and same(back[1], r * a2)


def test_rope_with_a_bias_rotates_the_biased_pair_and_keeps_z_without_it():
    """F1 with Qwen2's QKV bias: the pair r acc + b rotates as ``rope_scaled``'s r acc does
    (the same rotation of another pair), and z = r acc, the bias left out, is stored for
    B11's statistic."""
    a1, a2, r, pos, hi, lo, b1, b2 = sp.symbols("a1 a2 r pos hi lo b1 b2", real=True)
    ops = dict(rstd=r, pos=pos, freq=(hi, lo), bias=(b1, b2))
    out = evaluate(rope.rope_scaled_bias, acc=(a1, a2), **ops)
    plain = evaluate(
        rope.rope_scaled, acc=(r * a1 + b1, r * a2 + b2), rstd=1, pos=pos, freq=(hi, lo)
    )
    assert same(out["D"][0], plain["D"][0]) and same(out["D"][1], plain["D"][1])
    assert same(out["z_even"], r * a1) and same(out["z_odd"], r * a2)


def test_multimodal_rope_rotates_each_pair_by_its_sections_position():
    """F1 with multimodal RoPE (Qwen2-VL's): a pair whose section flags are (0, 0), (1, 0) or
    (0, 1) rotates as ``rope_scaled_bias`` at the time, height or width position, and z is
    kept the same way."""
    a1, a2, r, hi, lo, b1, b2 = sp.symbols("a1 a2 r hi lo b1 b2", real=True)
    rows = sp.symbols("t h w", real=True)
    ops = dict(rstd=r, freq=(hi, lo), bias=(b1, b2))
    for flags, at in (((0, 0), rows[0]), ((1, 0), rows[1]), ((0, 1), rows[2])):
        out = evaluate(
            rope.mrope_scaled_bias, acc=(a1, a2), pos=rows[0], pos_h=rows[1], pos_w=rows[2],
            sect=flags, **ops,
        )  # fmt: skip
        want = evaluate(rope.rope_scaled_bias, acc=(a1, a2), pos=at, **ops)
        for key in ("z_even", "z_odd"):
            assert same(out[key], want[key])
        assert same(out["D"][0], want["D"][0]) and same(out["D"][1], want["D"][1])


def test_qk_norm_with_multimodal_rope_rotates_by_the_sections_position():
    """Qwen3-VL's F1 (QK-norm and multimodal RoPE): a pair whose section flags pick the
    time, height or width row rotates as the QK-norm program at that row's position, z and
    the statistic kept alike."""
    r, s, hi, lo, w1, w2 = sp.symbols("r s hi lo w1 w2", real=True)
    acc, rows = sp.symbols("a1 a2", real=True), sp.symbols("t h w", real=True)
    head = dict(rstd=r, head_rstd=s, freq=(hi, lo), head_w=(w1, w2), plain=(0, 0))
    for keep_z in (False, True):
        mrope = qk.qk_norm_rope_program(1e-6, keep_z, True)
        plain = qk.qk_norm_rope_program(1e-6, keep_z)
        for flags, at in (((0, 0), rows[0]), ((1, 0), rows[1]), ((0, 1), rows[2])):
            out = evaluate(
                mrope, acc=acc, pos=rows[0], pos_h=rows[1], pos_w=rows[2], sect=flags, **head
            )
            want = evaluate(plain, acc=acc, pos=at, **head)
            assert same(out["D"][0], want["D"][0]) and same(out["D"][1], want["D"][1])
            for key in ("z_even", "z_odd") if keep_z else ():
                assert same(out[key], want[key])


def test_output_sumsq_epilogue_gives_the_post_norm_its_statistic():
    """F3 without the residual (a sublayer's output y normed before its add, Gemma 2's and
    3's): D = acc, sumsq's terms acc^2; over a row of N = 3 columns P1's scale
    (sum/N + eps)^-1/2 times D times g is RMSNorm(y) g."""
    eps = sp.Symbol("eps", positive=True)
    acc, g = (sp.symbols(f"{n}0:3", real=True) for n in ("acc", "g"))
    cols = [evaluate(grr.output_sumsq, acc=acc[j]) for j in range(3)]
    r = (sum(col["sumsq"] for col in cols) / 3 + eps) ** sp.Rational(-1, 2)
    rms = sp.sqrt(sum(x**2 for x in acc) / 3 + eps)
    for j, col in enumerate(cols):
        assert same(col["D"], acc[j]) and same(r * col["D"] * g[j], acc[j] / rms * g[j])


def test_residual_norm_epilogue_defers_rmsnorm_to_a_row_scale():
    """F3 + AUX: h = acc + c per element, sumsq's terms h^2, normed h gamma; over a row of
    N = 3 columns the AUX scale (sum/N + eps)^-1/2 times normed is RMSNorm(h) gamma."""
    eps = sp.Symbol("eps", positive=True)
    acc, c, gamma = (sp.symbols(f"{n}0:3", real=True) for n in ("acc", "c", "gamma"))
    cols = [evaluate(grr.residual_norm_sumsq, acc=acc[j], c=c[j], gamma=gamma[j]) for j in range(3)]
    h = [acc[j] + c[j] for j in range(3)]
    rstd = (sum(col["sumsq"] for col in cols) / 3 + eps) ** sp.Rational(-1, 2)
    rms = sp.sqrt(sum(x**2 for x in h) / 3 + eps)
    for j, col in enumerate(cols):
        assert same(col["D"], h[j])
        assert same(rstd * col["normed"], h[j] / rms * gamma[j])
    plain = evaluate(grr.residual_sumsq, acc=acc[0], c=c[0])
    assert same(plain["sumsq"], h[0] ** 2) and same(plain["D"], h[0])
    assert evaluate(grr.residual_add, acc=acc[0], c=c[0]) == {"D": h[0]}
    # with the projection's bias b (Llama's O projection): h = acc + b + c, the same norm
    b = sp.symbols("b0:3", real=True)
    hb = [h[j] + b[j] for j in range(3)]
    cols = [
        evaluate(grr.residual_bias_norm_sumsq, acc=acc[j], c=c[j], gamma=gamma[j], bias=b[j])
        for j in range(3)
    ]
    rstd = (sum(col["sumsq"] for col in cols) / 3 + eps) ** sp.Rational(-1, 2)
    rms = sp.sqrt(sum(x**2 for x in hb) / 3 + eps)
    for j, col in enumerate(cols):
        assert same(col["D"], hb[j]) and same(rstd * col["normed"], hb[j] / rms * gamma[j])
    plain = evaluate(grr.residual_bias_sumsq, acc=acc[0], c=c[0], bias=b[0])
    assert same(plain["sumsq"], hb[0] ** 2) and same(plain["D"], hb[0])
    # with a residual multiplier s (Granite's): h = s acc + c, the same norm of h
    s = sp.Symbol("s", real=True)
    hs = [s * acc[j] + c[j] for j in range(3)]
    cols = [
        evaluate(grr.scaled_residual_norm_sumsq, acc=acc[j], c=c[j], gamma=gamma[j], scale=s)
        for j in range(3)
    ]
    rstd = (sum(col["sumsq"] for col in cols) / 3 + eps) ** sp.Rational(-1, 2)
    rms = sp.sqrt(sum(x**2 for x in hs) / 3 + eps)
    for j, col in enumerate(cols):
        assert same(col["D"], hs[j]) and same(rstd * col["normed"], hs[j] / rms * gamma[j])
    assert same(evaluate(grr.scaled_residual_add, acc=acc[0], c=c[0], scale=s)["D"], hs[0])


def test_norm_backward_epilogue_is_rmsnorm_backward_with_its_residual():
    """B6 / B12 composed over a row of d = 3 columns: the forward y = r(h) h gamma with
    r(h) = (sum h^2 / d + eps)^-1/2; the next GEMM's upstream gradient G = dL/dy arrives as
    acc = r G (dz~ carries r), its producer's statistic S = sum_j G_j h_j gamma_j, and
    corr = -(r^3 / d) S (``norm_corr``). The epilogue's D then equals dL/dh plus the residual
    gradient c, and its dgamma term dL/dgamma, both by sympy's derivatives of the forward."""
    d = 3
    eps = sp.Symbol("eps", positive=True)
    h, gamma, G, c = (sp.symbols(f"{n}0:{d}", real=True) for n in ("h", "gamma", "G", "c"))
    r = (sum(x**2 for x in h) / d + eps) ** sp.Rational(-1, 2)
    L = sum(G[j] * r * h[j] * gamma[j] for j in range(d))  # sum_j G_j y_j
    S = sum(G[j] * h[j] * gamma[j] for j in range(d))
    corr = -(r**3 / d) * S
    for j in range(d):
        row = dict(acc=r * G[j], h=h[j], gamma=gamma[j], corr=corr)
        out = evaluate(nb.norm_bwd_residual, c=c[j], **row)
        assert same(out["D"], sp.diff(L, h[j]) + c[j])
        assert same(out["dgamma"], sp.diff(L, gamma[j]))
        assert same(evaluate(nb.norm_bwd, **row)["D"], sp.diff(L, h[j]))


@pytest.mark.parametrize("smoothing", [False, True])
def test_softmax_gradient_epilogue_is_the_cross_entropy_gradient(smoothing):
    """B1 (CE-A's recompute backward) over a row of V = 3 logits l = r acc: D is
    dL/dacc of scale (lse(l) - (eps / V) sum_k l_k) (the target's -1 is added apart, exactly),
    with shift = scale eps / V for label smoothing, and the statistic's row sum is dL/dr."""
    V = 3
    r, scale, eps = sp.symbols("r scale eps", real=True)
    acc = sp.symbols(f"acc0:{V}", real=True)
    logits = [r * a for a in acc]
    lse = sp.log(sum(sp.exp(x) for x in logits))
    L = scale * (lse - (eps / V if smoothing else 0) * sum(logits))
    outs = []
    for j in range(V):
        if smoothing:
            args = dict(rstd=r, lse=lse, scale=scale, shift=scale * eps / V)
            outs.append(evaluate(ceb.softmax_grad_logits_shifted, acc=acc[j], **args))
        else:
            outs.append(evaluate(ceb.softmax_grad_logits, acc=acc[j], rstd=r, lse=lse, scale=scale))
        assert same(outs[j]["D"], sp.diff(L, acc[j]))
    assert same(sum(o["stat"] for o in outs), sp.diff(L, r))


def test_capped_programs_are_the_soft_capped_cross_entropy_and_its_gradient():
    """Gemma 2's soft-cap c: F6's capped program takes z = c tanh(l / c) of l = r acc into the
    LSE (formed as c (2 sigmoid(2 l / c) - 1)) and keeps the target's l uncapped; B1's capped
    program over a row of V = 3 logits stores D = dL/dacc of L = scale lse(z) (the target's
    term apart, as uncapped), and its statistic's row sum is dL/dr. (The programs' constants
    2.0, 1.0 and 4.0 are exact in binary: ``exact`` makes them sympy's integers.)"""

    def exact(e):
        return sp.nsimplify(e, rational=True).rewrite(sp.exp)

    c = sp.Symbol("c", positive=True)
    acc, r = sp.symbols("acc r", real=True)
    out = evaluate(lce.capped_logits_lse_target, acc=acc, rstd=r, cap=c)
    assert same(out["target_logit"], r * acc)
    assert same(exact(out["lse"]), (c * sp.tanh(r * acc / c)).rewrite(sp.exp))
    V = 3
    scale = sp.Symbol("scale", real=True)
    accs = sp.symbols(f"acc0:{V}", real=True)
    z = [c * sp.tanh(r * a / c) for a in accs]
    lse = sp.log(sum(sp.exp(x) for x in z))
    L = scale * lse
    outs = []
    for j in range(V):
        args = dict(rstd=r, lse=lse, scale=scale, cap=c)
        outs.append(evaluate(ceb.capped_softmax_grad_logits, acc=accs[j], **args))
        assert same(exact(outs[j]["D"]), sp.diff(L, accs[j]).rewrite(sp.exp))
    stat = sum(o["stat"] for o in outs)
    assert same(exact(stat), sp.diff(L, r).rewrite(sp.exp))


def test_scaled_exp_stores_exp_of_the_logit_over_its_tile_power_of_two():
    """CE-S's GEMM1: E = 2^(l log2 e - k) is e^l 2^-k and the target logit is l = r acc.
    log2 e is a float constant in the program, so this one identity is checked to 40
    digits at sampled points (its relative error is log2 e's rounding, ~1e-16 per unit of l)."""
    acc, r, k = sp.symbols("acc r k", real=True)
    out = evaluate(scaled_exp_logits, acc=acc, rstd=r, k=k)
    assert same(out["target_logit"], r * acc) and out["sum_exp"] == out["D"]
    canonical = sp.exp(r * acc) * 2 ** (-k)
    for point in ({acc: 0.75, r: 1.3, k: 1}, {acc: -7.5, r: 0.6, k: -6}, {acc: 40, r: 2.0, k: 115}):
        got, want = (sp.N(e.subs(point), 40) for e in (out["D"], canonical))
        assert abs(got / want - 1) < 1e-14


def test_capped_scaled_exp_stores_the_capped_numerator_times_its_slope():
    """CE-S's GEMM1 with Gemma 2's soft-cap c: its prepass value (the tile maximum's operand)
    is z = c tanh(l / c) of l = r acc; the sum's term is e^z 2^-k (to log2 e's rounding, at
    sampled points, as the uncapped program's); the stored tile is that term times the slope
    dz/dl = 1 - tanh^2(l / c), exactly; the target logit stays l, uncapped."""

    def exact(e):
        return sp.nsimplify(e, rational=True).rewrite(sp.exp)

    c = sp.Symbol("c", positive=True)
    acc, r, k = sp.symbols("acc r k", real=True)
    z = c * sp.tanh(r * acc / c)
    assert same(
        exact(prepass(capped_scaled_exp_logits, acc, rstd=r, cap=c)["k"]), z.rewrite(sp.exp)
    )
    out = evaluate(capped_scaled_exp_logits, acc=acc, rstd=r, cap=c, k=k)
    assert same(out["target_logit"], r * acc)
    slope = sp.diff(z, acc) / r
    assert same(exact(out["D"] / out["sum_exp"]), slope.rewrite(sp.exp))
    canonical = sp.exp(z) * 2 ** (-k)
    for point in ({acc: 0.75, r: 1.3, k: 1, c: 2}, {acc: -7.5, r: 0.6, k: -6, c: 30}):
        got, want = (sp.N(e.subs(point), 40) for e in (out["sum_exp"], canonical))
        assert abs(got / want - 1) < 1e-14


def test_qk_norm_epilogue_norms_each_head_then_rotates_and_passes_v_through():
    """Qwen3's F1 over one head of hd = 4 columns (two pairs): the prepass terms z^2 of
    z = r acc summed over the head give s = (mean z^2 + eps)^-1/2 (``GroupRstd``), and the
    stored pair is RoPE(z s w) on a q/k head (w the head's norm weight), z itself on a v
    head (weight 0, ``plain`` 1, frequency 0); the training program also keeps z."""
    hd, eps = 4, sp.Symbol("eps", positive=True)
    r, pos, hi, lo = sp.symbols("r pos hi lo", real=True)
    acc, w = sp.symbols(f"acc0:{hd}", real=True), sp.symbols(f"w0:{hd}", real=True)
    program = qk.qk_norm_rope_program(1e-6)
    pairs = [(acc[2 * i], acc[2 * i + 1]) for i in range(hd // 2)]
    terms = [prepass(program, p, rstd=r)["head_rstd"] for p in pairs]
    s = (sum(a + b for a, b in terms) / hd + eps) ** sp.Rational(-1, 2)
    z = [r * a for a in acc]
    assert same(s, (sum(x**2 for x in z) / hd + eps) ** sp.Rational(-1, 2))
    theta = pos * 2 * sp.pi * (hi + lo)
    for i, p in enumerate(pairs):
        q_head = dict(pos=pos, freq=(hi, lo), head_w=(w[2 * i], w[2 * i + 1]), plain=(0, 0))
        out = evaluate(program, acc=p, rstd=r, head_rstd=s, **q_head)["D"]
        x1, x2 = z[2 * i] * s * w[2 * i], z[2 * i + 1] * s * w[2 * i + 1]
        assert same(out[0], x1 * sp.cos(theta) - x2 * sp.sin(theta))
        assert same(out[1], x1 * sp.sin(theta) + x2 * sp.cos(theta))
        v_head = dict(pos=pos, freq=(0, 0), head_w=(0, 0), plain=(1, 1))
        out = evaluate(program, acc=p, rstd=r, head_rstd=s, **v_head)["D"]
        assert same(out[0], z[2 * i]) and same(out[1], z[2 * i + 1])
        # training's F1 (``keep_z``): the same output, and z kept as its even and odd lanes
        kept = evaluate(qk.qk_norm_rope_program(1e-6, True), acc=p, rstd=r, head_rstd=s, **q_head)
        assert same(kept["D"][0], x1 * sp.cos(theta) - x2 * sp.sin(theta))
        assert kept["z_even"] == z[2 * i] and kept["z_odd"] == z[2 * i + 1]


def test_the_programs_that_scale_or_copy():
    """The LM head's logits programs (F6's online-LSE term and target logit are the logit
    l = r acc, CE-C's stored logits too), the deferred row scale (``scale_rows``, CE-S's dX),
    and the plain copies (CE-C's gradient GEMMs, CE-S's dW, whose scaling is the A operand's)."""
    acc, r = sp.symbols("acc r", real=True)
    assert evaluate(lce.logits_lse_target, acc=acc, rstd=r) == {
        "lse": r * acc,
        "target_logit": r * acc,
    }
    out = evaluate(cec.logits_with_stats, acc=acc, rstd=r)
    assert out == {"D": r * acc, "lse": r * acc, "target_logit": r * acc}
    assert evaluate(grg.scale_rows, acc=acc, scale=r) == {"D": r * acc}
    a = sp.symbols("a", real=True)
    g = r * acc  # CE-S's dX, and the softmax share of the final norm's statistic with it
    assert evaluate(scaled_grad_dx, acc=acc, row_scale=r, a=a) == {"D": g, "stat": g * a}
    for program in (ceb.passthrough, scaled_grad_dw):
        assert evaluate(program, acc=acc) == {"D": acc}


# every program the tests above prove, by name; QK-norm's two are made per eps by a factory
PROVEN = {
    "swiglu_keep_preact", "swiglu_only", "dswiglu_rescaled", "rope_scaled", "residual_sumsq",
    "residual_add", "residual_norm_sumsq", "norm_bwd", "norm_bwd_residual", "softmax_grad_logits",
    "softmax_grad_logits_shifted", "scaled_exp_logits", "_qk_norm_rope", "_qk_norm_rope_keep_z",
    "logits_lse_target", "logits_with_stats", "scale_rows", "scaled_grad_dx", "passthrough",
    "scaled_grad_dw", "rope_scaled_bias", "residual_bias_sumsq", "residual_bias_norm_sumsq",
    "capped_logits_lse_target", "capped_softmax_grad_logits", "mrope_scaled_bias",
    "_qk_norm_mrope", "_qk_norm_mrope_keep_z", "capped_scaled_exp_logits", "geglu_keep_preact",
    "geglu_only", "dgeglu_rescaled", "output_sumsq", "scaled_residual_norm_sumsq",
    "scaled_residual_add", "relu2_keep_preact", "relu2_only", "drelu2_rescaled",
    "xielu_keep_preact", "xielu_only", "dxielu_rescaled",
}  # fmt: skip


def test_every_epilogue_program_has_a_symbolic_proof():
    """A program added to ``coda.kernels`` without a proof here fails this test."""
    import importlib
    import pkgutil

    import coda.kernels
    from coda.primitives.vocabulary import EpilogueProgram

    names = {
        qk.qk_norm_rope_program(1e-6, keep_z, mrope).name
        for keep_z in (False, True)
        for mrope in (False, True)
    }
    for info in pkgutil.iter_modules(coda.kernels.__path__):
        module = importlib.import_module(f"coda.kernels.{info.name}")
        names |= {v.name for v in vars(module).values() if isinstance(v, EpilogueProgram)}
    assert len(names) >= 19 and names <= PROVEN, sorted(names - PROVEN)
