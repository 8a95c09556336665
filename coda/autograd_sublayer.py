"""The kernel path of a decoder layer whose second sublayer is a module of its own (a mixture
of experts: HF's Mixtral and Qwen-MoE layers), coda's up to the attention's residual add:

    F0-F2 as ``coda.autograd``'s layer (entry norm, QKV GEMM with RoPE [, QK-norm, biases],
          attention)
    F3''  x1 = x0 + c (o @ W_o)      epi: the residual add, nothing more
    backward: B8 + B9 from dx1 (the sublayer's and the residual's gradient, summed by
    autograd), dx1 handed on as the residual's gradient into B12's epilogue, B10-B13.

A pre-norm layer's F3 also forms the MLP's norm statistic and x1 * gamma2 for F4's deferred
row scale; here the module after it reads x1 through its own norm, so F3'' stores x1 alone:
one (M, d) write, no statistic. Where that norm is an RMSNorm of a form coda's kernels take
(HF's MoE layers: ``DecoderLayer.rows_norm``), it runs as one row pass each way:

    N   h = x1 r gamma, rounded once; r = (mean_n x1^2 + eps)^-1/2   (``norm_rows``' final form)
    N'  dx1 += r gamma dh - x1 r^3 mean_n(gamma dh x1); dgamma = sum_m r x1 dh  (``post_norm``'s P2)

No epilogue can finish it: the experts' GEMMs are the model's, so none takes a deferred row
scale, and F3's statistic would only move r's reduction into the epilogue while adding a
write and a read of x1 * gamma; one pass reading x1 and writing h is the least traffic (the
eager norm's fp32 intermediates cost ~7 passes forward, more backward).
"""

from __future__ import annotations

import torch

from coda._autograd_support import differentiable_once, root_float_use
from coda.autograd import LayerDims, attention_block, o_projection_grads
from coda.kernels import library as lib
from coda.kernels.tuned import config_for


class AttentionResidual(torch.autograd.Function):
    """F3'' / B8 + B9: x1 = x0 + c (o @ W_o) in the O projection's epilogue, as a (batch, seq,
    d) tensor of its own (``rows``). Backward: do and dW_o from c dx1; x0's gradient is dx1
    (the residual branch's, which the attention-input Function adds in B12's epilogue)."""

    @staticmethod
    def forward(ctx, o, w_o, x0, rows: tuple, scale: float = 1.0):
        M, K = o.shape
        cfg = config_for("residual", M, K, w_o.shape[1])
        x1 = lib.gemm_residual_add(o, w_o, x0, cfg, rows, scale)
        ctx.save_for_backward(o, w_o)
        ctx.scale = scale
        return x1

    @staticmethod
    def backward(ctx, dx1):
        differentiable_once("AttentionResidual")
        o, w_o = ctx.saved_tensors
        dx1 = dx1.reshape(o.shape[0], w_o.shape[1]).contiguous()
        _, do, dw_o = o_projection_grads(o, w_o, dx1, ctx.scale, ctx.needs_input_grad[1])
        return do, dw_o, dx1, None, None


def attention_sublayer(
    x0, g1, w_qkv, w_o, positions, dims: LayerDims, attention=None, freq=None, qk_norm=None,
    qkv_bias=None, sect=None,
):  # fmt: skip
    """A decoder layer's attention sublayer with its residual add on token rows x0 (M, d):
    ``coda.autograd.decoder_layer``'s arguments without the MLP's (no O-projection bias).
    Returns x1 (batch, seq, d), a tensor of its own, for the caller's second sublayer."""
    o, x0_residual = attention_block(
        x0, g1, w_qkv, positions, dims, attention, freq, qk_norm, qkv_bias, sect
    )
    c = dims.residual_scale
    root_float_use(c)  # (a float the Function reads: see ``root_float_use``)
    return AttentionResidual.apply(o, w_o, x0_residual, (dims.batch, dims.seq), c)


class NormRows(torch.autograd.Function):
    """N / N' (the module docstring): RMSNorm of token rows x (M, d) by ``gain`` (x's dtype,
    or fp32 for a gain applied in fp32), h in x's dtype. Saved: x, r and the gain."""

    @staticmethod
    def forward(ctx, x, gain, eps: float):
        h, r = lib.norm_rows(x, gain, eps, True)
        ctx.save_for_backward(x, r, gain)
        return h

    @staticmethod
    def backward(ctx, dh):
        differentiable_once("NormRows")
        x, r, gain = ctx.saved_tensors
        dx, dgain = lib.post_norm_bwd_rows(dh.contiguous(), x, r, gain)
        return dx, dgain, None


def norm_rows(x, gain, eps: float):
    """RMSNorm of x (..., d) as ``NormRows``, shaped as x."""
    d = x.shape[-1]
    return NormRows.apply(x.reshape(-1, d), gain, eps).view(x.shape)
