"""The kernel path of a decoder layer whose sublayers end in a norm (Gemma 2's and 3's: RMSNorm
of the attention's and the MLP's output before each residual add, beside the two pre-norms):

    F0-F2 as ``coda.autograd``'s layer (entry norm, QKV GEMM with RoPE [, QK-norm], attention)
    F3'  y = o @ W_o, P: y^2's partials           epi: sum of squares (no residual)
    P1   x1 = x0 + r_y * g_attn_out * y; r1, a1 = x1 * gamma2
                                                  row pass (``coda.kernels.post_norm``)
    F4   s = GLU(r1 * (a1 @ W_il)), u kept        as the layer's
    F5'  m = s @ W_d, P: m^2's partials           epi: sum of squares
    P1   x2 = x1 + r_m * g_ffn_out * m            row pass
    backward: P2 (dm, dg_ffn_out from dx2), then B4-B7 with dm into the down projection and
    dx2 as the residual's gradient; P2 (dy, dg_attn_out from dx1), B8-B9 with dy; B10-B13.

Where a pre-norm layer folds its residual add and the next norm's statistic into F3's
epilogue, the norm after a sublayer needs its whole output row first, so one row pass a
sublayer does it: y and m are read once more than in a pre-norm layer, and x1 and x2 are
written by the pass instead of the epilogue. Saved beyond a pre-norm layer's: y, m and their
row statistics. Gains are passed as the layer forms them (Gemma's 1 + w in fp32).
"""

from __future__ import annotations

import torch

from coda._autograd_support import backward_can_follow, differentiable_once
from coda.autograd import LayerDims, attention_block, gated_up, mlp_grads, pre_norm
from coda.kernels import library as lib
from coda.kernels.tuned import config_for
from coda.kernels.wgrad import wgrad


class AttentionOutputPostNorm(torch.autograd.Function):
    """F3' + P1 / P2 + B8 + B9: the O projection storing y and its sum-of-squares partials,
    then one row pass forming x1 = x0 + rmsnorm(y) * g_out and the next (pre-)norm's r1 and
    a1 = x1 * gamma2. Returns (x1, a1, r1), as ``coda.autograd.AttentionOutput``; a1 and r1
    carry no gradient of their own (the MLP's backward takes that norm's whole); without a
    norm before the MLP (``g2`` None) the pass forms x1 alone, and a1, r1 are None."""

    @staticmethod
    def forward(ctx, o, w_o, x0, g_out, g2, eps: float):
        M, K = o.shape
        y, sumsq = lib.gemm_output_sumsq(o, w_o, config_for("residual", M, K, w_o.shape[1]))
        if g2 is None:
            (x1, r_y), a1, r1 = lib.post_norm_rows(y, sumsq, x0, g_out, eps), None, None
        else:
            x1, r_y, a1, r1 = lib.post_norm_next_rows(y, sumsq, x0, g_out, eps, g2)
            ctx.mark_non_differentiable(a1, r1)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(o, w_o, y, r_y, g_out)
        return x1, a1, r1

    @staticmethod
    def backward(ctx, dx1, _da1, _dr1):
        differentiable_once("AttentionOutputPostNorm")
        if dx1 is None:  # x1 did not reach the loss
            return (None,) * 6
        o, w_o, y, r_y, g_out = ctx.saved_tensors
        dx1 = dx1.contiguous()
        dy, dg_out = lib.post_norm_bwd_rows(dx1, y, r_y, g_out)  # P2
        do = dy @ w_o.t()  # B8
        dw_o = wgrad(o, dy) if ctx.needs_input_grad[1] else None  # B9
        return do, dw_o, dx1, dg_out, None, None  # dx1 is also the residual's gradient


class MLPPostNorm(torch.autograd.Function):
    """F4 + F5' + P1 / P2 + B4-B7: ``coda.autograd.MLP`` with the down projection's output
    normed before the residual add (x2 = x1 + rmsnorm(m) * g_out). ``rows``: x2's leading
    dimensions, (batch, seq) (a tensor of its own, not a view). Without a norm before the MLP
    (``g2``, ``a1`` and ``r1`` None) F4 reads x1 itself at row scale 1 (formed here: x1
    passed twice would break a torch.compile trace, whose Functions take distinct tensors)."""

    @staticmethod
    def forward(ctx, x1, a1, r1, g2, w_il, w_d, g_out, eps, rows: tuple, train: bool, act):
        M, d = x1.shape
        f = w_d.shape[0]
        if g2 is None:
            a1, r1 = pre_norm(x1, None, eps)
        s, u = gated_up(a1, r1, w_il, train, act)  # F4
        m, sumsq = lib.gemm_output_sumsq(s, w_d, config_for("residual", M, f, d))  # F5'
        x2, r_m = lib.post_norm_rows(m, sumsq, x1, g_out, eps, rows)  # P1
        ctx.save_for_backward(x1, r1, u, g2, w_il, w_d, m, r_m, g_out)
        ctx.activation = act
        return x2

    @staticmethod
    def backward(ctx, dx2):
        differentiable_once("MLPPostNorm")
        x1, r1, u, g2, w_il, w_d, m, r_m, g_out = ctx.saved_tensors
        dx2 = dx2.reshape(x1.shape).contiguous()
        dm, dg_out = lib.post_norm_bwd_rows(dx2, m, r_m, g_out)  # P2
        want = ctx.needs_input_grad[4:6]
        dx1, dg2, dw_il, dw_d, _ = mlp_grads(
            x1, r1, u, g2, w_il, w_d, dm, dx2, ctx.activation, want
        )
        return dx1, None, None, dg2, dw_il, dw_d, dg_out, None, None, None, None


def post_norm_decoder_layer(
    x0,
    g1,
    w_qkv,
    w_o,
    g2,
    w_il,
    w_d,
    out_gains,
    positions,
    dims: LayerDims,
    attention=None,
    freq=None,
    qk_norm=None,
    sect=None,
    qkv_bias=None,
):
    """``coda.autograd.decoder_layer`` with a norm after each sublayer: ``out_gains`` =
    (g_attn_out, g_ffn_out), the gains of the norms of the attention's and the MLP's outputs;
    ``qkv_bias``: q, k, v biases (GLM-4's), in F1's epilogue as the layer's; ``g1`` and ``g2``
    None: no norms before the sublayers (EXAONE 4's); ``dims.residual_scale`` c (HyperCLOVAX's
    multiplier) folded into the two gains, c norm(y) g = norm(y) (c g), in fp32 (float64 for
    float64 rows). Returns x2 (batch, seq, d), a tensor of its own."""
    o, x0_residual = attention_block(
        x0, g1, w_qkv, positions, dims, attention, freq, qk_norm, qkv_bias, sect
    )
    if dims.residual_scale != 1.0:
        acc = torch.float64 if x0.dtype == torch.float64 else torch.float32
        out_gains = tuple(g.to(acc) * dims.residual_scale for g in out_gains)
    g_attn, g_ffn = out_gains
    x1, a1, r1 = AttentionOutputPostNorm.apply(o, w_o, x0_residual, g_attn, g2, dims.eps)
    train = backward_can_follow(x1, a1, r1, g2, w_il, w_d, g_ffn)
    rows = (dims.batch, dims.seq)
    return MLPPostNorm.apply(
        x1, a1, r1, g2, w_il, w_d, g_ffn, dims.eps, rows, train, dims.activation
    )
