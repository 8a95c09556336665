"""GeGLU (GELU's tanh form gating the up projection: Gemma's MLP) in the gate/up GEMM's
epilogue and in the down projection's dgrad epilogue, beside SwiGLU: ``activation=
"gelu_tanh"`` of ``coda.gemm_swiglu``, ``DecoderLayer`` and ``CausalLM``.

Level 1: the EW helpers equal torch's GELU and its derivative; each program, run by the tile
interpreter over ragged tiles, equals the textbook reference in float64 (the symbolic proofs
are in ``test_symbolic``; the layer's whole kernel sequence in ``test_kernel_path_cpu`` and
``test_reference_algebra``). Level 2: the programs compile for sm_90a (``test_forward_kernels``
and ``test_backward_kernels``' compile lists). Level 3: CODA's error protocol on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_no_worse, rel_err
from test_backward_kernels import assert_layer_and_head_protocol

import coda
import coda.nn as cnn
from coda import _validate as v
from coda.kernels import dswiglu as dsw
from coda.kernels import gemm_swiglu as sw
from coda.kernels.config import GemmConfig
from coda.primitives import gelu_tanh, gelu_tanh_gate, gelu_tanh_slope
from coda.reference import swiglu as sw_ref

F64 = torch.float64
GELU = "gelu_tanh"


def test_gelu_helpers_are_torch_gelu_and_its_derivative():
    """gelu_tanh = torch's ``gelu(approximate="tanh")`` and gelu_tanh_slope its autograd
    derivative, float64, over the range where the tanh saturates on both sides."""
    x = torch.cat([torch.linspace(-30, 30, 2001, dtype=F64), torch.randn(1000, dtype=F64)])
    x.requires_grad_(True)
    want = F.gelu(x, approximate="tanh")
    (slope,) = torch.autograd.grad(want.sum(), x)
    x = x.detach()
    assert rel_err(gelu_tanh(x), want.detach()) < 1e-14
    assert rel_err(gelu_tanh_slope(x, gelu_tanh_gate(x)), slope) < 1e-14


CONFIGS = [GemmConfig(), GemmConfig(64, 32, 1, 1, False), GemmConfig(128, 96, 1, 1, False)]


def programs_equal_the_reference(seed: int, activation: str):
    """F4's and B4's programs for ``activation`` through the tile interpreter (ragged M, K and
    f; tiles that do not divide them) equal ``gemm_swiglu_ref`` / ``dswiglu_ref`` in float64
    (W_il as wide as the activation takes: 2f gated, f without a gate). Returns (u, r,
    dx @ W_d^T, dz~) for further checks."""
    g = torch.Generator().manual_seed(seed)
    M, K, f = (
        int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 150), (1, 70), (1, 90))
    )
    a = torch.randn(M, K, dtype=F64, generator=g)
    n_il = f if activation in sw.UNGATED else 2 * f
    w_il = torch.randn(K, n_il, dtype=F64, generator=g) / K**0.5
    r = 0.5 + torch.rand(M, dtype=F64, generator=g)
    config = CONFIGS[seed % len(CONFIGS)]
    s, u = sw.gemm_swiglu_interpreted(a, w_il, r, config, activation=activation)
    s_ref, u_ref = sw_ref.gemm_swiglu_ref(a, w_il, r, activation)
    assert s.shape == (M, f) and rel_err(s, s_ref) < 1e-13 and rel_err(u, u_ref) < 1e-13
    d = int(torch.randint(1, 60, (1,), generator=g))
    dx = torch.randn(M, d, dtype=F64, generator=g)
    w_d = torch.randn(f, d, dtype=F64, generator=g) / f**0.5
    dz, s2, stat = dsw.dswiglu_interpreted(dx, w_d, u, r, config, activation=activation)
    s_re, dz_ref, S_ref = sw_ref.dswiglu_ref(dx @ w_d.t(), u, r, activation)
    assert rel_err(dz, dz_ref) < 1e-12 and rel_err(s2, s_re) < 1e-12
    assert rel_err(stat.sum(1), S_ref) < 1e-12
    return a, w_il, u, r, dx @ w_d.t(), dz


@pytest.mark.parametrize("seed", range(6))
def test_geglu_programs_equal_the_reference_float64(seed):
    a, w_il, _, r, _, _ = programs_equal_the_reference(seed, GELU)
    # the SwiGLU programs give another answer: the activation reached the epilogue
    config = CONFIGS[seed % len(CONFIGS)]
    s_ref = sw_ref.gemm_swiglu_ref(a, w_il, r, GELU)[0]
    assert rel_err(sw.gemm_swiglu_interpreted(a, w_il, r, config)[0], s_ref) > 1e-3


def test_the_op_is_geglu_as_hf_computes_it():
    """``coda.gemm_swiglu(activation="gelu_tanh")`` on the CPU (reference path) is
    act(gate) * up as Gemma's MLP computes it, float64: gelu_tanh(x W_g) * (x W_u)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 24, dtype=F64, generator=g)
    wg, wu = (torch.randn(24, 19, dtype=F64, generator=g) for _ in range(2))
    w_il = sw_ref.interleave_gate_up(wg, wu)
    hf = F.gelu(x @ wg, approximate="tanh") * (x @ wu)
    out = coda.gemm_swiglu(x, w_il, activation=GELU, save_preact=True)
    assert rel_err(out.s, hf) < 1e-14 and rel_err(out.preact, x @ w_il) < 1e-14


def test_an_unknown_activation_is_named():
    x, w = torch.randn(4, 8), torch.randn(8, 6)
    with pytest.raises(
        v.CodaInputError, match=r"activation: must be one of \('silu', 'gelu_tanh'\), got 'gelu'"
    ):
        coda.gemm_swiglu(x, w, activation="gelu")
    with pytest.raises(v.CodaInputError, match="activation: must be one of"):
        cnn.DecoderLayer(16, 2, 1, 24, activation="relu")
    with pytest.raises(v.CodaInputError, match="activation: must be one of"):
        cnn.CausalLM(32, 16, 1, 2, 1, 24, activation="swish")


def test_the_model_passes_its_activation_to_every_layer():
    """``CausalLM(activation=...)`` builds GeGLU layers, and a GeGLU layer's step differs
    from a SwiGLU layer's on the same weights (the option reaches the math)."""
    torch.manual_seed(0)
    model = cnn.CausalLM(64, 16, 2, 2, 1, 24, activation=GELU, dtype=F64)
    assert [layer.activation for layer in model.layers] == [GELU] * 2
    assert "activation='gelu_tanh'" in repr(model.layers[0])
    swi = cnn.CausalLM(64, 16, 2, 2, 1, 24, dtype=F64)
    swi.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    assert rel_err(model(ids, ids), swi(ids, ids)) > 1e-6


# -- level 3: on an SM90 GPU ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,K,f", [(4096, 2048, 5632), (1000, 512, 1000)])
def test_gpu_geglu(M, K, f):
    """F4's GeGLU epilogue vs the fp32 reference, no worse than the PyTorch bf16 path
    (normalize, project, gelu_tanh(gate) * up, each rounded)."""
    g = torch.Generator(device="cuda").manual_seed(M + f)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(K, 2 * f, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5
    r = 0.5 + torch.rand(M, device="cuda", generator=g)
    out = coda.gemm_swiglu(x, w, r, save_preact=True, activation=GELU, backend="kernel")
    s_ref, u_ref = sw_ref.gemm_swiglu_ref(x, w, r, GELU)
    assert_no_worse("s", out.s, s_ref, sw_ref.gemm_swiglu_torch(x, w, r, GELU))
    assert_no_worse("preact", out.preact, u_ref, x @ w)


@pytest.mark.gpu
def test_gpu_geglu_layer_and_head_every_gradient():
    """A GeGLU layer + LM head step (dGeGLU in B4's epilogue): every gradient's error no
    worse than the PyTorch bf16 path's (``test_gpu_layer_and_head_every_gradient``'s)."""
    assert_layer_and_head_protocol(2, 1024, 1024, 8, 4, 2816, 32768, "auto", activation=GELU)
