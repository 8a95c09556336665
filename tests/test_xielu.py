"""xIELU (Apertus's MLP activation, without a gate: HF's ``XIELUActivation``) in the input
projection's epilogue (F4: s = xielu(r u), u kept) and in the down projection's dgrad
epilogue (B4: dz = ds xielu'(z), s recomputed, the norm's statistic, and the gradients of its
two learned coefficients as row partials), its four numbers (a_p, a_n, beta, eps) read by the
kernels from device memory (``DeviceScalar``); ``DecoderLayer(activation="xielu")`` holds them
as HF's ``mlp.act_fn``.

Level 1: the reference is HF's module; the math helpers are the reference and its autograd
slope; each program, run by the tile interpreter over ragged tiles, equals the reference in
float64 (the symbolic proofs are in ``test_symbolic``; the layer's whole kernel sequence in
``test_kernel_path_cpu``, the HF model in ``test_transformers_families``). Level 2: the
programs compile for sm_90a. Level 3: CODA's error protocol on the GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_worse, family_z, pooled_ratio, rel_err, seed_errors
from test_backward_kernels import assert_layer_and_head_protocol, layer_and_head_step
from test_geglu import CONFIGS
from test_relu2 import assert_ungated_programs_compile

import coda
import coda.nn as cnn
from coda.kernels import dswiglu as dsw
from coda.kernels import gemm_swiglu as sw
from coda.kernels.config import GemmConfig
from coda.nn.activation import XIELU
from coda.primitives import xielu, xielu_slope
from coda.reference import swiglu as sw_ref

F64 = torch.float64
XI = "xielu"


def _numbers(alpha_p=0.3, alpha_n=-0.7, dtype=F64, device=None):
    act = XIELU(dtype=dtype, device=device)
    with torch.no_grad():
        act.alpha_p.fill_(alpha_p)
        act.alpha_n.fill_(alpha_n)
    return act


def _points(n=1000, dtype=F64):
    """Every regime: positive, between eps (-1e-6) and 0, below eps, and 0 itself."""
    return torch.cat(
        [
            torch.linspace(-8, 8, 801, dtype=dtype),
            -torch.rand(50, dtype=dtype) * 1e-6,
            torch.zeros(3, dtype=dtype),
            torch.randn(n, dtype=dtype),
        ]
    )


def test_the_reference_and_the_numbers_are_hfs():
    """``xielu_ref`` of ``XIELU.numbers()`` is HF's ``XIELUActivation`` (its Python form) with
    the same parameters, float64, in every regime; the module starts where HF's does (a_p =
    a_n = 0.8) and ``adopt`` copies HF's values."""
    from transformers.activations import ACT2CLS

    hf = ACT2CLS["xielu"](dtype=F64)
    ours = XIELU(dtype=F64)
    for name in ("alpha_p", "alpha_n", "beta", "eps"):
        assert torch.equal(getattr(ours, name), getattr(hf, name)), name
    with torch.no_grad():
        hf.alpha_p.fill_(0.3)
        hf.alpha_n.fill_(-0.7)
    x = _points()
    adopted = XIELU.adopt(hf)
    assert rel_err(sw_ref.xielu_ref(x, adopted.numbers()), hf._xielu_python(x)) < 1e-15
    assert rel_err(sw_ref.xielu_ref(x, ours.numbers()), hf._xielu_python(x)) > 1e-3


def test_the_math_helpers_are_the_reference_and_its_slope():
    """``primitives.xielu`` equals the reference, ``xielu_slope`` its autograd derivative
    (float64; min(x, eps)'s ties at exactly eps, which torch splits in halves, excluded)."""
    act = _numbers().numbers().detach()
    x = _points().requires_grad_(True)
    want = sw_ref.xielu_ref(x, act)
    (slope,) = torch.autograd.grad(want.sum(), x)
    x = x.detach()
    assert rel_err(xielu(x, *act.unbind()), want.detach()) < 1e-15
    assert rel_err(xielu_slope(x, *act.unbind()), slope) < 1e-14


@pytest.mark.parametrize("seed", range(6))
def test_xielu_programs_equal_the_reference_float64(seed):
    """F4's and B4's xIELU programs through the tile interpreter (ragged M, K and f; tiles that
    do not divide them) equal ``gemm_swiglu_ref`` / ``dswiglu_ref`` in float64, the two
    coefficient gradients included, and those are autograd's of the reference."""
    g = torch.Generator().manual_seed(seed)
    M, K, f, d = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in
                  ((1, 150), (1, 70), (1, 90), (1, 60)))  # fmt: skip
    a = torch.randn(M, K, dtype=F64, generator=g)
    w_up = torch.randn(K, f, dtype=F64, generator=g) / K**0.5
    r = 0.5 + torch.rand(M, dtype=F64, generator=g)
    alpha = torch.randn(2, dtype=F64, generator=g)
    module = _numbers(*alpha.tolist())
    act = module.numbers().detach()
    config = CONFIGS[seed % len(CONFIGS)]
    s, u = sw.gemm_swiglu_interpreted(a, w_up, r, config, XI, act)
    s_ref, u_ref = sw_ref.gemm_swiglu_ref(a, w_up, r, XI, act)
    assert s.shape == (M, f) and rel_err(s, s_ref) < 1e-13 and rel_err(u, u_ref) < 1e-13
    dx = torch.randn(M, d, dtype=F64, generator=g)
    w_d = torch.randn(f, d, dtype=F64, generator=g) / f**0.5
    dz, s2, stat, coef = dsw.dswiglu_interpreted(dx, w_d, u, r, config, XI, act)
    ds = dx @ w_d.t()
    s_re, dz_ref, S_ref, d_act = sw_ref.dswiglu_ref(ds, u, r, XI, act)
    assert rel_err(dz, dz_ref) < 1e-12 and rel_err(s2, s_re) < 1e-12
    assert rel_err(stat.sum(1), S_ref) < 1e-12
    assert coef.shape == (2, M, config.grid(M, f)[1])
    assert rel_err(coef.sum((1, 2)), d_act) < 1e-12
    # autograd of the reference: dz~ = r dL/dz, and (a_p, a_n)'s gradients
    z = (r[:, None] * u).requires_grad_(True)
    numbers = act.clone().requires_grad_(True)
    grad_z, grad_act = torch.autograd.grad(sw_ref.xielu_ref(z, numbers), (z, numbers), ds)
    assert rel_err(dz, r[:, None] * grad_z) < 1e-12
    assert rel_err(coef.sum((1, 2)), grad_act[:2]) < 1e-12


def test_an_xielu_layer_holds_hfs_parameters_and_is_refused_with_post_norms():
    """``DecoderLayer(activation="xielu")``: W_il is W_up alone (d, ffn); the numbers live in
    ``mlp.act_fn`` under HF's keys, learned (alpha_p, alpha_n) and constant (beta, eps), and
    follow the layer's dtype; with norms after the sublayers it is refused, named."""
    layer = cnn.DecoderLayer(32, 2, 1, 24, dtype=F64, activation=XI)
    assert layer.w_il.shape == (32, 24) and "activation='xielu'" in repr(layer)
    sd = layer.state_dict()
    assert {f"mlp.act_fn.{n}" for n in ("alpha_p", "alpha_n", "beta", "eps")} <= set(sd)
    assert {n for n, _ in layer.named_parameters()} >= {"mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n"}
    assert layer.to(torch.float32).mlp.act_fn.beta.dtype == torch.float32
    with pytest.raises(coda.CodaInputError, match="'xielu' with post_norms"):
        cnn.DecoderLayer(32, 2, 1, 24, activation=XI, post_norms=True)


def test_an_xielu_kernel_without_its_numbers_is_refused_named():
    a, w, r = (
        torch.randn(8, 16, dtype=F64),
        torch.randn(16, 24, dtype=F64),
        torch.ones(8, dtype=F64),
    )
    for act in (None, torch.ones(3)):
        with pytest.raises(ValueError, match="act must be its \\(4,\\) numbers"):
            sw.gemm_swiglu_interpreted(a, w, r, GemmConfig(), XI, act)


# -- level 2: the kernels compile for sm_90a ------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("save_preact", [True, False])
def test_xielu_programs_compile_for_sm90(save_preact):
    assert_ungated_programs_compile(XI, save_preact)


# -- level 3: on an SM90 GPU ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,K,f", [(4096, 2048, 5632), (1000, 512, 1000)])
def test_gpu_xielu(M, K, f):
    """F4's and B4's xIELU epilogues vs the fp32 reference, no worse than the PyTorch bf16 path
    (normalize, project, xIELU in bf16 as HF's module runs, each rounded); the coefficients'
    gradients no worse than bf16 autograd's."""
    from coda.kernels import library as lib

    g = torch.Generator(device="cuda").manual_seed(M + f)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(K, f, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5
    r = 0.5 + torch.rand(M, device="cuda", generator=g)
    act = _numbers(0.3, -0.7, torch.float32, "cuda").numbers().detach()
    s, u = lib.gemm_swiglu(x, w, r, GemmConfig(), XI, act)
    s_ref, u_ref = sw_ref.gemm_swiglu_ref(x, w, r, XI, act)
    assert_no_worse("s", s, s_ref, sw_ref.gemm_swiglu_torch(x, w, r, XI, act))
    assert_no_worse("preact", u, u_ref, x @ w)
    w_d = torch.randn(f, K, device="cuda", dtype=torch.bfloat16, generator=g) / f**0.5
    dx = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    dz, s2, stat, coef = lib.dxielu(dx, w_d, u, r, act, GemmConfig())
    torch.cuda.synchronize()
    ref = sw_ref.dswiglu_ref(dx.float() @ w_d.float().t(), u.float(), r, XI, act)
    z = (u.float() * r[:, None]).to(torch.bfloat16).requires_grad_(True)  # the bf16 path
    nums = act.to(torch.bfloat16).requires_grad_(True)
    peer = torch.autograd.grad(sw_ref.xielu_ref(z, nums), (z, nums), dx @ w_d.t())
    assert_no_worse("dz", dz, ref[1], r[:, None] * peer[0].float())
    assert_no_worse("s (B4)", s2, ref[0], sw_ref.xielu_ref(z.detach(), nums.detach()))
    assert_no_worse("d(a_p, a_n)", coef.sum((1, 2)), ref[3], peer[1][:2].float())


XIELU_SEEDS = 64


@pytest.mark.gpu
def test_gpu_xielu_layer_and_head_every_gradient():
    """An xIELU layer + LM head step: the loss's and every tensor gradient's error no worse
    than the PyTorch bf16 path's (``test_gpu_layer_and_head_every_gradient``'s), and the two
    learned scalars' gradients pooled over ``XIELU_SEEDS`` seeds (``conftest.seed_errors``,
    Bonferroni over the two): a one-element gradient's error on one seed is one sample, of
    the size of its operands' bf16 roundings and its own rounding to the parameter's bf16
    (one ulp of the scalar), so one seed is a coin flip (run 316: alpha_p 1.513 at seed 0;
    the CPU model, ``cpu_numerics.py xielu-layer-head``, pooled over 64 seeds: 0.646 and
    0.491; benchmarks/NOTES.md, sessions 78-79)."""
    shape = (2, 1024, 1024, 8, 4, 2816, 32768, "auto")
    scalars = ("mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n")
    assert_layer_and_head_protocol(*shape, skip=scalars, activation=XI)
    errors: dict = {}
    for seed in range(XIELU_SEEDS):
        _, grads = layer_and_head_step(*shape, seed, activation=XI)
        for n in scalars:
            got, ref, peer = grads[n]  # (the kernel path's, fp32's, the bf16 reference's)
            errors.setdefault(n, []).append(seed_errors(got, ref, peer))
    pooled = {n: pooled_ratio(e, family_z(len(scalars))) for n, e in errors.items()}
    print({n: (round(r, 4), round(1 + b, 4)) for n, (r, b) in pooled.items()})
    worse = {n: (round(r, 4), round(1 + b, 4)) for n, (r, b) in pooled.items() if r > 1 + b}
    assert not worse, worse
