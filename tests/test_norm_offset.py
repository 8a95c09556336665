"""``DecoderLayer(norm_offset=...)``: norms that scale by ``norm_offset + gain`` (Gemma's
1 + w), that sum formed in fp32 and applied before the one rounding, as HF's ``GemmaRMSNorm``
computes it; on the kernel path the fp32 gains enter the entry norm's row pass, F3's
epilogue and the norm-backward and gain-row weight-gradient GEMMs as they are.

Level 1 (CPU): the offset layer is the plain layer with gains 1 + w, float64, both paths and
every gradient; in bf16 the kernel path's plumbing (fp32 gains, bf16 weights and gradients)
runs through the interpreter near the reference; the reference's rounding is HF's. Level 2:
the fp32-gain kernels compile for sm_90a (``test_backward_kernels``' and
``test_gemm_residual_rms``' compile lists). Level 3: CODA's protocol on a Gemma-style layer
(GeGLU and 1 + w gains)."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from test_backward_kernels import assert_layer_and_head_protocol

import coda.nn as cnn
from coda import _validate as v

F64 = torch.float64


def _grads(layer, x, run, dy):
    for p in (*layer.parameters(), x):
        p.grad = None
    out = run()
    out.backward(dy)
    return out.detach(), {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_an_offset_layer_is_the_plain_layer_with_gains_one_plus_w(path):
    torch.manual_seed(0)
    offset = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=F64, norm_offset=1.0)
    plain = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=F64)
    with torch.no_grad():
        for g in (offset.attention_norm, offset.ffn_norm):
            assert torch.equal(g, torch.zeros_like(g))  # an effective gain of 1 at the start
            g.copy_(0.3 * torch.randn_like(g))
        plain.load_state_dict(offset.state_dict())
        for g in (plain.attention_norm, plain.ffn_norm):
            g.add_(1.0)
    x = torch.randn(2, 7, 40, dtype=F64, requires_grad=True)
    dy = torch.randn_like(x)

    def run(layer):
        return lambda: layer._kernel_forward(x) if path == "kernel" else layer(x)

    out_o, g_o = _grads(offset, x, run(offset), dy)
    out_p, g_p = _grads(plain, x, run(plain), dy)
    assert rel_err(out_o, out_p) < 1e-13
    for name in g_p:
        assert rel_err(g_o[name], g_p[name]) < 1e-12, name


def test_the_bf16_kernel_path_takes_fp32_gains():
    """bf16 through the interpreter (the TMA layout rules enforced): fp32 gains 1 + w in the
    entry norm, F3's epilogue and the backward GEMMs; the gains' gradients come back in the
    parameters' bf16, and the step is near the float64 reference."""
    torch.manual_seed(1)
    layer = cnn.DecoderLayer(64, 4, 2, 96, head_dim=16, norm_offset=1.0, activation="gelu_tanh")
    with torch.no_grad():
        for g in (layer.attention_norm, layer.ffn_norm):
            g.copy_(0.5 * torch.randn_like(g))
    x = torch.randn(2, 24, 64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    out_k, g_k = _grads(layer, x, lambda: layer._kernel_forward(x), dy)
    ref = cnn.DecoderLayer(64, 4, 2, 96, head_dim=16, norm_offset=1.0, activation="gelu_tanh")
    ref = ref.to(F64)
    ref.load_state_dict(layer.state_dict())
    x64 = x.detach().double().requires_grad_(True)
    out_r, g_r = _grads(ref, x64, lambda: ref(x64), dy.double())
    assert rel_err(out_k.double(), out_r) < 2e-2
    for name, grad in g_k.items():
        want = torch.bfloat16
        assert grad.dtype == want and torch.isfinite(grad).all(), name
        assert rel_err(grad.double(), g_r[name]) < 5e-2, name


def test_the_reference_rounds_as_hf_gemma_norm():
    """The bf16 reference path's norm is HF's ``GemmaRMSNorm`` bitwise (fp32 statistic and
    gain 1 + w, one rounding), not Llama's (round, then times a bf16 gain)."""
    gemma = pytest.importorskip("transformers.models.gemma.modeling_gemma")
    from coda.reference.rmsnorm import final_norm_ref

    torch.manual_seed(2)
    hf = gemma.GemmaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64))
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    layer = cnn.DecoderLayer(64, 4, 2, 96, head_dim=16, eps=1e-6, norm_offset=1.0)
    with torch.no_grad():
        layer.attention_norm.copy_(hf.weight)
    g1, _ = layer._gains(torch.bfloat16)
    assert g1.dtype == torch.float32
    assert torch.equal(final_norm_ref(x, g1, 1e-6), hf(x))


def test_a_norm_offset_must_be_finite():
    for bad in (float("nan"), float("inf"), "1", True):
        with pytest.raises(v.CodaInputError, match="norm_offset: must be a finite number"):
            cnn.DecoderLayer(16, 2, 1, 24, norm_offset=bad)
    assert "norm_offset=1.0" in repr(cnn.DecoderLayer(16, 2, 1, 24, norm_offset=1.0))


# -- level 3: on an SM90 GPU ----------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_gemma_style_layer_and_head_every_gradient():
    """A layer with Gemma's GeGLU and 1 + w gains in fp32, + LM head: every gradient's error
    no worse than the PyTorch bf16 path's (which rounds its norms as HF's Gemma does)."""
    assert_layer_and_head_protocol(
        2, 1024, 1024, 8, 4, 2816, 32768, "auto", activation="gelu_tanh", norm_offset=1.0
    )
