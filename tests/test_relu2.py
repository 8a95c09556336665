"""An MLP without a gate, relu(x)^2 (Arcee's: HF's "relu2"), in the input projection's
epilogue (F4: s = relu(r u)^2, u kept) and in the down projection's dgrad epilogue (B4: dz =
ds 2 relu(z), s recomputed, the norm's statistic), ``DecoderLayer(activation="relu2")`` with
W_il = W_up (d x f).

Level 1: ``relu`` is torch's; each program, run by the tile interpreter over ragged tiles,
equals the textbook reference in float64 (the symbolic proofs are in ``test_symbolic``; the
layer's whole kernel sequence in ``test_kernel_path_cpu``, the HF model in
``test_transformers_families``). Level 2: the programs compile for sm_90a. Level 3: CODA's
error protocol on the GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_no_worse, rel_err
from test_backward_kernels import assert_layer_and_head_protocol
from test_geglu import programs_equal_the_reference

import coda.nn as cnn
from coda.kernels import dswiglu as dsw
from coda.kernels import gemm_swiglu as sw
from coda.kernels.config import GemmConfig
from coda.primitives import relu
from coda.reference import swiglu as sw_ref

F64 = torch.float64
RELU2 = "relu2"


def test_relu_is_torchs_and_relu2_hfs():
    x = torch.cat([torch.linspace(-3, 3, 601, dtype=F64), torch.randn(100, dtype=F64)])
    assert torch.equal(relu(x), torch.relu(x))
    from transformers.activations import ACT2FN

    assert torch.equal(sw_ref.relu2_ref(x), ACT2FN["relu2"](x))


@pytest.mark.parametrize("seed", range(6))
def test_relu2_programs_equal_the_reference_float64(seed):
    """F4's and B4's relu2 programs through the tile interpreter equal the references in
    float64 (``test_geglu``'s check); s is relu(r a W_up)^2, and dz~ is r times autograd's
    gradient of relu^2 at z = r u."""
    a, w_up, u, r, ds, dz = programs_equal_the_reference(seed, RELU2)
    s_ref = sw_ref.gemm_swiglu_ref(a, w_up, r, RELU2)[0]
    assert rel_err(s_ref, torch.relu((a @ w_up) * r[:, None]) ** 2) < 1e-13
    z = (r[:, None] * u).requires_grad_(True)
    (grad,) = torch.autograd.grad(sw_ref.relu2_ref(z), z, ds)
    assert rel_err(dz, r[:, None] * grad) < 1e-12


def test_a_relu2_layer_has_no_gate_and_differs_from_a_gated_one():
    """``DecoderLayer(activation="relu2")``: W_il is W_up alone (d, ffn), HF's keys are
    ``mlp.up_proj`` alone and convert exactly both ways; the layer's output is relu(.)^2's."""
    torch.manual_seed(0)
    layer = cnn.DecoderLayer(32, 2, 1, 24, dtype=F64, activation=RELU2)
    assert layer.w_il.shape == (32, 24) and "activation='relu2'" in repr(layer)
    sd = layer.hf_state_dict()
    assert "mlp.up_proj.weight" in sd and "mlp.gate_proj.weight" not in sd
    assert sd["mlp.up_proj.weight"].shape == (24, 32)
    other = cnn.DecoderLayer(32, 2, 1, 24, dtype=F64, activation=RELU2)
    other.load_hf_state_dict(sd)
    for a, b in zip(layer.parameters(), other.parameters()):
        assert torch.equal(a, b)


# -- level 2: the kernels compile for sm_90a ------------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("save_preact", [True, False])
def test_relu2_programs_compile_for_sm90(save_preact):
    assert_ungated_programs_compile(RELU2, save_preact)


def assert_ungated_programs_compile(activation: str, save_preact: bool):
    """F4's program for an MLP ``activation`` without a gate (and, storing the pre-activation,
    B4's) compiles for sm_90a, and a second shape reuses it (0 compiles)."""
    kw = dict(save_preact=save_preact, activation=activation)
    assert sw.compile_gemm_swiglu(256, 520, **kw) in (0, 1)
    assert sw.compile_gemm_swiglu(512, 1032, m=1000, **kw) == 0
    if save_preact:
        assert dsw.compile_dswiglu(256, 520, activation=activation) in (0, 1)
        assert dsw.compile_dswiglu(512, 1032, m=1000, activation=activation) == 0


# -- level 3: on an SM90 GPU ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,K,f", [(4096, 2048, 5632), (1000, 512, 1000)])
def test_gpu_relu2(M, K, f):
    """F4's relu2 epilogue vs the fp32 reference, no worse than the PyTorch bf16 path
    (normalize, project, relu(.)^2, each rounded)."""
    from coda.kernels import library as lib

    g = torch.Generator(device="cuda").manual_seed(M + f)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(K, f, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5
    r = 0.5 + torch.rand(M, device="cuda", generator=g)
    s, u = lib.gemm_swiglu(x, w, r, GemmConfig(), RELU2)
    torch.cuda.synchronize()
    s_ref, u_ref = sw_ref.gemm_swiglu_ref(x, w, r, RELU2)
    assert_no_worse("s", s, s_ref, sw_ref.gemm_swiglu_torch(x, w, r, RELU2))
    assert_no_worse("preact", u, u_ref, x @ w)


@pytest.mark.gpu
def test_gpu_relu2_layer_and_head_every_gradient():
    """A relu2 layer + LM head step (drelu2 in B4's epilogue): every gradient's error no
    worse than the PyTorch bf16 path's (``test_gpu_layer_and_head_every_gradient``'s)."""
    assert_layer_and_head_protocol(2, 1024, 1024, 8, 4, 2816, 32768, "auto", activation=RELU2)
