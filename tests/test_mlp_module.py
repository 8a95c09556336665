"""``DecoderLayer(mlp=)``: a layer whose second sublayer is a module of its own (a mixture of
experts: ``coda.autograd_sublayer``). Built around a plain-torch SwiGLU made of a coda layer's
own norm and MLP weights, it must equal that layer, in float64 on the CPU, on both paths
(the kernel path's GEMMs through the tile interpreter): output, the input's gradient and
every weight's, over random shapes with and without QK-norm, biases and a branch
multiplier. Its option rules are refused, named."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import rel_err
from torch import nn

import coda
import coda.nn as cnn
from coda import layouts
from coda.reference.rmsnorm import rmsnorm_ref

F64 = torch.float64


class SwiGLUBlock(nn.Module):
    """RMSNorm then SwiGLU in plain torch, from a coda layer's ``ffn_norm``, ``w_il`` and
    ``w_d`` (HF's layouts: the canonical MLP, not coda's kernels or reference)."""

    def __init__(self, layer, eps: float):
        super().__init__()
        gate, up = layouts.gate_up_weight_to_hf(layer.w_il.detach())
        self.norm = nn.Parameter(layer.ffn_norm.detach().clone())
        self.gate, self.up = nn.Parameter(gate.clone()), nn.Parameter(up.clone())
        self.down = nn.Parameter(layer.w_d.detach().t().clone())
        self.eps = eps

    def forward(self, x1):
        h = rmsnorm_ref(x1, self.norm, self.eps)
        return (nn.functional.silu(h @ self.gate.t()) * (h @ self.up.t())) @ self.down.t()


ATTENTION = ("attention_norm", "w_qkv", "w_o", "q_norm", "k_norm", "bias_qkv")


@pytest.mark.parametrize("seed", range(6))
def test_a_layer_with_an_mlp_module_equals_the_layer_float64(seed):
    rng = random.Random(seed)
    Hkv = rng.choice([1, 2])
    H, hd = Hkv * rng.choice([1, 2]), rng.choice([2, 6, 16])
    d, f = rng.randrange(3, 50), rng.randrange(1, 40)
    B, S = rng.choice([1, 2]), rng.choice([2, 5, 13])
    # seeds 1, 4: Qwen3's QK-norm (4: Hunyuan's, after RoPE); 2, 5: Qwen2's biases; 3, 5:
    # Granite's branch multiplier
    opts = dict(qk_norm=seed in (1, 4), qkv_bias=seed in (2, 5), qk_norm_after_rope=seed == 4)
    opts.update(residual_scale=0.22 if seed in (3, 5) else 1.0, eps=rng.choice([1e-5, 1e-2]))
    torch.manual_seed(seed)
    own = cnn.DecoderLayer(d, H, Hkv, f, head_dim=hd, dtype=F64, **opts)
    with torch.no_grad():
        for gam in (own.attention_norm, own.ffn_norm, own.q_norm, own.k_norm):
            if gam is not None:
                gam.add_(0.3 * torch.randn_like(gam))
        if own.qkv_bias:
            own.bias_qkv.copy_(torch.randn_like(own.bias_qkv))
    ext = cnn.DecoderLayer(
        d, H, Hkv, 0, head_dim=hd, dtype=F64, mlp=SwiGLUBlock(own, opts["eps"]), **opts
    )
    assert ext.mlp_module and ext.ffn_norm is None and ext.w_il is None and ext.w_d is None
    ext.load_state_dict(
        {n: t for n, t in own.state_dict().items() if n in ATTENTION}
        | ext.mlp.state_dict(prefix="mlp.")
    )
    x = torch.randn(B, S, d, dtype=F64, requires_grad=True)
    dy = torch.randn(B, S, d, dtype=F64)

    def step(layer, run):
        for p in (*layer.parameters(), x):
            p.grad = None
        out = run(layer)
        out.backward(dy)
        return out.detach(), x.grad.clone(), {n: p.grad for n, p in layer.named_parameters()}

    out_r, dx_r, g_r = step(own, lambda m: m(x))
    block_grads = {"ffn_norm": "mlp.norm"}
    for run in (lambda m: m(x), lambda m: m._kernel_forward(x)):  # reference, kernel path
        out, dx, g = step(ext, run)
        assert rel_err(out, out_r) < 1e-12
        assert rel_err(dx, dx_r) < 1e-11
        floor = max(float(t.abs().max()) for t in g_r.values())
        for name in [n for n in ATTENTION if n in g_r] + list(block_grads):
            assert rel_err(g[block_grads.get(name, name)], g_r[name], floor=floor) < 1e-11, name
        assert rel_err(g["mlp.down"], g_r["w_d"].t(), floor=floor) < 1e-11
        gate, up = layouts.gate_up_weight_to_hf(g_r["w_il"])
        assert rel_err(g["mlp.gate"], gate, floor=floor) < 1e-11
        assert rel_err(g["mlp.up"], up, floor=floor) < 1e-11


def test_an_mlp_module_takes_its_rules_named():
    block = nn.Identity()
    with pytest.raises(coda.CodaInputError, match=r"mlp: expected an nn\.Module"):
        cnn.DecoderLayer(16, 2, 1, 0, mlp=lambda x: x)
    with pytest.raises(coda.CodaInputError, match="ffn: must be 0 with mlp"):
        cnn.DecoderLayer(16, 2, 1, 8, mlp=block)
    for bad in (dict(activation="gelu_tanh"), dict(post_norms=True), dict(o_bias=True)):
        with pytest.raises(coda.CodaInputError, match="mlp .* is not supported"):
            cnn.DecoderLayer(16, 2, 1, 0, mlp=block, **bad)
    assert "mlp=<module>" in repr(cnn.DecoderLayer(16, 2, 1, 0, mlp=block))
