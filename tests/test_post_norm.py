"""The norm after a sublayer (``DecoderLayer(post_norms=True)``: Gemma 2's and 3's RMSNorm of
the attention's and the MLP's outputs before each residual add): the row passes P1 / P2 of
``coda.kernels.post_norm``, the projection GEMM that stores y with its sum-of-squares
partials (``gemm_residual_rms.output_sumsq``), and the layer's kernel path
(``coda.autograd_post_norm``).

Level 1 (CPU, float64): the passes' torch forms are the canonical norm and its autograd
derivative; their Triton kernels equal them in the interpreter (odd token counts and row
widths, one and several partials a row; bf16 within a step); the layer's kernel path equals
its reference path, output and every gradient, with GeGLU, Gemma's 1 + w gains and Gemma 3's
QK-norm (the reference equals HF's Gemma 2 and 3 layers: tests/test_transformers_families.py).
Level 2: every kernel compiles for sm_90 / sm_90a on the CPU. Level 3: CODA's protocol on a
Gemma-3-shaped layer + LM head on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton_child
from conftest import rel_err
from test_backward_kernels import assert_layer_and_head_protocol

import coda.env
import coda.nn as cnn
from coda import _validate as v
from coda.kernels import gemm_residual_rms as grr
from coda.kernels import post_norm as pn
from coda.reference.rmsnorm import rmsnorm_ref

F64 = torch.float64
# (M, d, partials a row); P1's launch takes several rows a program to d = 2048, two to 8192
# (3000), one beyond (9000: its partials reduced as a vector)
CASES = [(37, 72, 3), (5, 1000, 4), (130, 256, 1), (3, 2048, 16), (3, 3000, 23), (2, 9000, 5)]


def _partials(y, t: int):
    """y^2's row sums over ``t`` column groups, as an epilogue's RED_m leaves them."""
    return torch.stack([c.pow(2).sum(1) for c in torch.tensor_split(y, t, dim=1)], 1)


def pass_case(M, d, t, dtype, seed=0, device="cpu") -> dict:
    """Largest error of every output of P1 (both forms) and P2, kernel against torch form, in
    units of the output's largest magnitude."""
    g = torch.Generator().manual_seed(seed)
    y, x0, dx1 = (torch.randn(M, d, generator=g).to(device, dtype) for _ in range(3))
    acc = F64 if dtype == F64 else torch.float32  # (the gains in fp32: Gemma's 1 + w)
    gain, g1 = ((1 + 0.1 * torch.randn(d, generator=g)).to(device, acc) for _ in range(2))
    P = _partials(y.to(acc), t)
    out = {}
    for name, nxt in (("P1", None), ("P1 next", g1)):
        ref = pn.post_norm_torch(y, P, x0, gain, 1e-6, nxt)
        for launch in (None, (1, 4), (2, 4)):  # the default's, and one and two rows a program
            got = pn.post_norm_triton(y, P, x0, gain, 1e-6, nxt, launch=launch)
            out[f"{name} {launch or ''}"] = [_rel(a, b) for a, b in zip(got, ref)]
    r = pn.post_norm_torch(y, P, x0, gain, 1e-6)[1]
    got, ref = pn.post_norm_bwd_triton(dx1, y, r, gain), pn.post_norm_bwd_torch(dx1, y, r, gain)
    out["P2"] = [_rel(a, b) for a, b in zip(got, ref)]
    out["P2 dtypes"] = [a.dtype == b.dtype for a, b in zip(got, ref)]
    return out


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_post_norm import CASES, pass_case
out = []
for dtype in (torch.float64, torch.bfloat16):
    for i, case in enumerate(CASES):
        out.append([str(dtype), case, pass_case(*case, dtype, seed=i)])
print(json.dumps(out))
"""


# -- level 1 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("M,d,t", CASES)
def test_torch_forms_are_the_norm_and_its_derivative(M, d, t):
    """P1's x1 = x0 + rmsnorm(y) * g (the reference's norm, not re-typed) and r1 = x1's own
    rstd; P2's (dy, dg) are autograd's derivative of it, float64."""
    torch.manual_seed(M)
    y, x0, dx1 = (torch.randn(M, d, dtype=F64) for _ in range(3))
    g, g1 = 1 + 0.1 * torch.randn(d, dtype=F64), torch.randn(d, dtype=F64)
    x1, r, a1, r1 = pn.post_norm_torch(y, _partials(y, t), x0, g, 1e-6, g1)
    yy, gg = y.clone().requires_grad_(), g.clone().requires_grad_()
    want = x0 + rmsnorm_ref(yy, gg, 1e-6)
    assert rel_err(x1, want) < 1e-14
    assert rel_err(r, torch.rsqrt(y.pow(2).mean(-1) + 1e-6)) < 1e-14
    assert rel_err(r1, torch.rsqrt(want.pow(2).mean(-1) + 1e-6)) < 1e-14
    assert rel_err(a1, want * g1) < 1e-14
    want.backward(dx1)
    dy, dg = pn.post_norm_bwd_torch(dx1, y, r, g)
    assert rel_err(dy, yy.grad) < 1e-13 and rel_err(dg, gg.grad) < 1e-13


def test_post_norm_kernels_in_triton_interpreter_equal_torch_forms():
    results = triton_child.results(_CHILD)
    assert len(results) == 2 * len(CASES)
    for dtype, case, errs in results:
        bound = 1e-12 if "float64" in dtype else 2.0**-7  # (bf16: one step)
        for name, e in errs.items():
            if name.endswith("dtypes"):
                assert all(e), (dtype, case, name)
            else:
                assert max(e) <= bound, (dtype, case, name, e)


def test_output_sumsq_program_is_the_product_and_its_partials():
    """F3 without the residual: D = x @ w and y^2's per-tile partials, through the tile
    interpreter (a ragged last tile)."""
    torch.manual_seed(0)
    x, w = torch.randn(70, 64, dtype=F64), torch.randn(64, 200, dtype=F64)
    y, _, P = grr.epilogue_gemm(x, w, None)
    assert rel_err(y, x @ w) < 1e-14
    assert P.shape[1] > 1 and rel_err(P.sum(1), (x @ w).pow(2).sum(1)) < 1e-14


LAYERS = {  # (d, H, Hkv, ffn, head_dim, B, S), options
    "plain": ((128, 2, 1, 96, 64, 2, 7), {}),
    "gemma2": ((96, 3, 1, 80, 32, 3, 5), {"norm_offset": 1.0, "activation": "gelu_tanh"}),
    "gemma3": ((128, 2, 1, 96, 64, 1, 9), {"norm_offset": 1.0, "qk_norm": True, "eps": 1e-6}),
    "glm4": ((96, 3, 1, 80, 32, 2, 5), {"qkv_bias": True}),  # (q, k, v biases: GLM-4's)
    # no norms before the sublayers (EXAONE 4's), with and without its QK-norm
    "exaone4": ((128, 2, 1, 96, 64, 2, 7), {"qk_norm": True, "pre_norms": False}),
    "no_pre_norms": ((96, 3, 1, 80, 32, 3, 5), {"pre_norms": False}),
    # OLMo 2's and 3's: no pre-norms, QK-norm over the whole q and k, gains applied in fp32
    "olmo2": (
        (128, 4, 2, 96, 32, 2, 7),
        {"qk_norm": "whole", "pre_norms": False, "fp32_gains": True},
    ),
}


@pytest.fixture
def kernel_forced(monkeypatch):
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))


def _both_paths(layer, x):
    """(output, {gradient}) of one step on the reference path, then on the kernel path, with
    one random output gradient."""
    dy = torch.randn_like(x)
    results = []
    for backend in ("reference", "kernel"):
        layer.backend = backend
        results.append(_step(layer, x, dy))
    return results


def _step(layer, x, dy):
    for p in (*layer.parameters(), x):
        p.grad = None
    out = layer(x)
    out.backward(dy)
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_kernel_path_equals_reference_path_float64(kernel_forced, kind):
    (d, H, Hkv, f, hd, B, S), options = LAYERS[kind]
    torch.manual_seed(1)
    layer = cnn.DecoderLayer(d, H, Hkv, f, head_dim=hd, dtype=F64, post_norms=True, **options)
    with torch.no_grad():
        qk = [layer.q_norm, layer.k_norm] if layer.qk_norm else []
        for p in (*layer._norm_gains(), *qk, *([layer.bias_qkv] if layer.qkv_bias else [])):
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(B, S, d, dtype=F64, requires_grad=True)
    (out_r, g_r), (out_k, g_k) = _both_paths(layer, x)
    assert out_k.shape == (B, S, d) and out_k._base is None  # a tensor of its own
    assert rel_err(out_k, out_r) < 1e-13
    assert {"post_attention_norm", "post_ffn_norm"} <= set(g_r)
    for name in g_r:
        assert rel_err(g_k[name], g_r[name]) < 1e-12, name


@pytest.mark.parametrize("case", range(6))
def test_kernel_path_equals_reference_path_at_random_shapes(kernel_forced, case):
    """Random small shapes (d a multiple of 8, not of a tile; odd token counts; 1-4 KV heads
    and 1-3 query heads each; head_dim 16-64), each option drawn: float64, output and every
    gradient."""
    import random

    rng = random.Random(case)
    hd, Hkv = rng.choice([16, 32, 64]), rng.choice([1, 2, 4])
    H, d, f = Hkv * rng.choice([1, 2, 3]), 8 * rng.randrange(3, 25), 8 * rng.randrange(2, 20)
    options = dict(norm_offset=rng.choice([0.0, 1.0]), activation=rng.choice(["silu", "gelu_tanh"]))
    options.update(
        qk_norm=rng.choice([False, False, "head", "whole"]), eps=rng.choice([1e-6, 1e-5, 1e-2])
    )
    options["fp32_gains"] = rng.random() < 0.3
    options["qkv_bias"] = not options["qk_norm"] and rng.random() < 0.5
    options["pre_norms"] = rng.random() < 0.7
    # a branch multiplier (HyperCLOVAX's residual_multiplier under its post-norms: on the kernel
    # path folded into the post-norms' gains)
    options["residual_scale"] = rng.choice([1.0, 0.22, 3.0])
    B, S = rng.choice([1, 2, 3]), rng.choice([1, 3, 7, 17])
    torch.manual_seed(case)
    layer = cnn.DecoderLayer(d, H, Hkv, f, head_dim=hd, dtype=F64, post_norms=True, **options)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = torch.randn(B, S, d, dtype=F64, requires_grad=True)
    (out_r, g_r), (out_k, g_k) = _both_paths(layer, x)
    what = f"case {case}: d {d}, H {H}, Hkv {Hkv}, hd {hd}, f {f}, B {B}, S {S}, {options}"
    assert rel_err(out_k, out_r) < 1e-12, what
    # (a gradient that is 0 in exact arithmetic, q's with one token, is round-off on both
    # paths: compared on the scale of the largest gradient)
    floor = max(float(t.abs().max()) for t in g_r.values())
    for name in g_r:
        assert rel_err(g_k[name], g_r[name], floor=floor) < 1e-11, f"{what}: {name}"


def test_post_norms_change_the_layer():
    """The comparison above can fail: the same weights without the post-norms (or with one
    gain changed) give another output."""
    torch.manual_seed(0)
    a = cnn.DecoderLayer(64, 2, 1, 48, dtype=F64, post_norms=True)
    b = cnn.DecoderLayer(64, 2, 1, 48, dtype=F64)
    b.load_state_dict({k: t for k, t in a.state_dict().items() if "post" not in k})
    x = torch.randn(2, 5, 64, dtype=F64)
    assert rel_err(a(x), b(x)) > 1e-3
    with torch.no_grad():
        out = a(x)
        a.post_ffn_norm[0] += 0.5
    assert rel_err(a(x), out) > 1e-6


def test_hf_weights_and_bad_arguments():
    """HF's Gemma 2 / 3 keys (``pre_feedforward_layernorm`` is the MLP's pre-norm), exact round
    trip; the forms it does not take are refused by name."""
    torch.manual_seed(0)
    layer = cnn.DecoderLayer(32, 2, 1, 40, dtype=F64, post_norms=True, norm_offset=1.0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    sd = layer.hf_state_dict()
    assert torch.equal(sd["post_attention_layernorm.weight"], layer.post_attention_norm)
    assert torch.equal(sd["post_feedforward_layernorm.weight"], layer.post_ffn_norm)
    assert torch.equal(sd["pre_feedforward_layernorm.weight"], layer.ffn_norm)
    other = cnn.DecoderLayer(32, 2, 1, 40, dtype=F64, post_norms=True, norm_offset=1.0)
    other.load_hf_state_dict(sd)
    for (name, p), q in zip(layer.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
    assert "post_norms=True" in repr(layer)
    with pytest.raises(v.CodaInputError, match="post_norms with o_bias"):
        cnn.DecoderLayer(32, 2, 1, 40, post_norms=True, o_bias=True)
    assert cnn.DecoderLayer(32, 2, 1, 40, post_norms=True, qkv_bias=True).qkv_bias  # GLM-4's


# -- level 2 -----------------------------------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize(
    "d,t,gain", [(1152, 5, "fp32"), (2304, 9, "fp32"), (2048, 8, "bf16"), (16384, 64, "bf16")]
)
def test_post_norm_kernels_compile_for_sm90(d, t, gain):
    assert all(size > 0 for size in pn.compile_post_norm(d, t, gain))


@pytest.mark.compile
def test_output_sumsq_gemm_compiles_for_sm90():
    assert grr.compile_gemm_residual_rms(256, 520, gamma=False, residual=False) in (0, 1)
    # M, N and K are dynamic: another problem size reuses the same compiled kernel
    assert grr.compile_gemm_residual_rms(512, 1032, gamma=False, residual=False, m=1000) == 0


# -- level 3 -----------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,d", [(16384, 1152), (16384, 2304), (4099, 2048), (1000, 9000)])
def test_gpu_post_norm_kernels_equal_torch_forms(M, d):
    """The compiled P1 / P2 on the GPU against their torch forms at Gemma 3's and Gemma 2's
    widths (fp32 gains, one partial per 128 columns): every output within one bf16 step of
    its torch form, relative to its largest entry (as the interpreter test's bf16 cases)."""
    for name, e in pass_case(M, d, -(-d // 128), torch.bfloat16, device="cuda").items():
        if name.endswith("dtypes"):
            assert all(e), name
        else:
            assert max(e) <= 2.0**-7, (name, e)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [256, 128])
def test_gpu_gemma3_style_layer_and_head_every_gradient(head_dim):
    """Gemma-3-1B's layer shape (d 1152, 4 heads of 256 sharing one KV head, ffn 6912; and
    heads of 128): post-norms, GeGLU, QK-norm and every gain 1 + w in fp32, + LM head: every
    gradient's error no worse than the PyTorch bf16 path's."""
    heads = 1152 // head_dim if head_dim == 128 else 4
    assert_layer_and_head_protocol(
        2, 1024, 1152, heads, 1, 6912, 32768, "auto", head_dim=head_dim,
        activation="gelu_tanh", norm_offset=1.0, qk_norm=True, post_norms=True, eps=1e-6,
    )  # fmt: skip
