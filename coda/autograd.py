"""autograd.Functions for the kernel path: a Llama decoder layer and the LM head + loss.

Forward and backward are the kernel sequence of docs/KERNELS.md (section 6), whose step
labels the code below cites: every op outside attention is a GEMM epilogue or a small AUX
reduction. Per layer (x0 in, x2 out; "epi" = in the GEMM's epilogue):

    F0   a0 = x0 * gamma1, r0                    row kernel (``norm_rows.norm_rows``)
    F1   q, k, v = RoPE(r0 * (a0 @ W_qkv))        epi: row scale, RoPE [, Qwen3's QK-norm
                                                  or Qwen2's bias; Hunyuan's QK-norm after
                                                  RoPE: unit gains, then q, k times theirs]
    F2   o = attention(q, k, v)                   pluggable (SDPA by default)
    F3   x1 = x0 + o @ W_o; a1 = x1 * gamma2      epi: residual, norm input, sum of squares
                                                  [, Llama's O-projection bias]
    A1   r1 from F3's partials                    row kernel
    F4   s = SwiGLU(r1 * (a1 @ W_il)), u kept     epi: row scale, SwiGLU (GeGLU; relu^2 without
                                                  a gate: W_il = W_up), u
    F5   x2 = x1 + s @ W_d                        epi: residual (the next layer's F0 is its norm)
                                                  [F3, F5: a branch multiplier c, x + c acc]
    B4   dz1, s = dSwiGLU(dx2 @ W_d^T)            epi: dSwiGLU, s again, the norm statistic
    B5   dW_d = s^T dx2                           cuBLAS
    A6   corr1 from B4's partials                 row kernel
    B6   dx1 = norm backward of dz1 @ W_il^T      epi: + dx2 (residual); A7: dgamma2
    B7   dW_il = gamma2 (rows) * (x1^T dz1)       epi: row scale
    B8   do = dx1 @ W_o^T;  B9  dW_o = o^T dx1    cuBLAS [; the bias's gradient: dx1's
                                                  column sums]
    B10  dq, dk, dv                               attention's own backward
    B11  dz0 from dq, dk, dv; A8: corr0           row kernel: dRoPE [, QK-norm's backward
                                                  or the bias's gradient]
    B12  dx0 = norm backward of dz0 @ W_qkv^T     epi: + dx1 (residual); A9: dgamma1
    B13  dW_qkv = gamma1 (rows) * (x0^T dz0)      epi: row scale

The LM head + loss (final norm, logits never stored whole) is F6 / B1-B3 with A3-A5, by
method (``LinearCrossEntropyFunction`` below).

A layer is three Functions, one per fusion boundary (``AttentionInput``: F0-F1 / B11-B13;
``AttentionOutput``: F3 / B8-B9; ``MLP``: F4-F5 / B4-B7), composed by ``decoder_layer``
around a pluggable attention callable (SDPA by default) that autograd differentiates; a
layer whose sublayers end in a norm (Gemma 2's and 3's) swaps the last two for
``coda.autograd_post_norm``'s.
Weights are coda-layout (in, out) matrices (``coda.layouts``); tokens are rows, batch-major.

Saved per layer: x0, r0, rotated q/k and v (qkv), what attention saves, o, x1, r1, u. Not
saved: a0, a1, s (recomputed in B4), any norm output, any partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from coda._autograd_support import (  # noqa: F401 (checkpoint_first_pass: coda.autograd's)
    backward_can_follow,
    checkpoint_first_pass,
    differentiable_once,
    root_float_use,
    stand_in,
)
from coda._validate import check_attention_output
from coda.kernels import library as lib
from coda.kernels._launch import acc_dtype, fused, unit_rows
from coda.kernels.ce_scaled_exp import chunk_rows_scaled
from coda.kernels.drope import cached_head_rotation
from coda.kernels.drope import cached_rotation as _rotation
from coda.kernels.final_norm_rows import head_norm_backward
from coda.kernels.gemm_rope import cached_freq_table, f1_rows, lean_z_cols
from coda.kernels.linear_cross_entropy import logits_row_sum, softcap_rows
from coda.kernels.linear_cross_entropy_bwd import (
    ce_grad_weights,
    final_norm_bwd_normed,
    row_scale,
    weight_grad_from_acc,
)
from coda.kernels.linear_cross_entropy_chunked import chunk_rows
from coda.kernels.loss_rows import ce_loss_from_stats, ce_row_weights
from coda.kernels.qk_norm import epilogue_rows, is_per_head, qk_norm_config
from coda.kernels.rmsnorm_bwd import norm_corr
from coda.kernels.tuned import config_for
from coda.kernels.wgrad import wgrad
from coda.primitives.aux import combine_lse


@dataclass(frozen=True)
class LayerDims:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_base: float
    activation: str = "silu"  # the MLP's: "silu" (SwiGLU), "gelu_tanh" (GeGLU), "relu2" (no gate)
    residual_scale: float = 1.0  # each branch's multiplier before its residual add (Granite's)
    qk_norm_after_rope: bool = False  # the QK-norm of the rotated q and k (Hunyuan's)


def sdpa_causal(q, k, v):
    """The default attention: causal GQA SDPA (flash on the H200). q (B, H, S, hd), k and v
    (B, Hkv, S, hd) -> (B, H, S, hd). Any callable of this form can replace it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def split_heads(qkv, dims: LayerDims):
    """qkv (M, (H + 2 Hkv) hd) -> q, k, v as (B, heads, S, hd) views, attention's inputs. The
    attention-input Functions return these views, so their backward receives dq, dk, dv as
    attention produced them and reads them in its row pass (no copies into one buffer)."""
    H, Hkv = dims.heads, dims.kv_heads
    t = qkv.view(dims.batch, dims.seq, H + 2 * Hkv, dims.head_dim).transpose(1, 2)
    return t[:, :H], t[:, H : H + Hkv], t[:, H + Hkv :]


def pre_norm(x, g, eps: float):
    """F0: (x * g, rstd) by a row pass; without a norm before the sublayer (``g`` None:
    EXAONE 4's layers) (x, 1), its GEMM's row scale 1."""
    if g is None:
        return x, x.new_ones(x.shape[0], dtype=acc_dtype(x))
    return lib.norm_rows(x, g, eps, False)


def _unnormed(x, g, corr):
    """The norm backward's operands for a sublayer without a pre-norm (``g`` None): gain 1 and
    statistic 0, so that B6's / B12's epilogue forms dx = dA + dres; else as given."""
    if g is not None:
        return g, corr
    return x.new_ones(x.shape[1]), torch.zeros_like(corr)


def _entry_norm_backward(x0, g1, w_qkv, dz0, corr0, dres, want_dw: bool = True):
    """B12 + A9 and B13, shared by both attention-input Functions: dx0 = the norm-backward
    dgrad of dz~0 through W_qkv (with the residual gradient ``dres`` added in its epilogue),
    dgamma1, and dW_qkv = gamma1 (rows) * (x0^T dz~0), or None without ``want_dw`` (W_qkv
    frozen: its GEMM skipped). Returns (dx0, dg1, dW_qkv); dg1 None without an entry norm
    (``g1`` None)."""
    M, d = x0.shape
    dres = None if dres is None else dres.contiguous()
    g, corr = _unnormed(x0, g1, corr0)
    dx0, dg1 = lib.norm_bwd(
        dz0, w_qkv, x0, g, corr, dres, config_for("norm_bwd", M, w_qkv.shape[1], d)
    )
    # B13 (its tile, keyed by d and N, chosen inside ``wgrad``)
    dw_qkv = lib.wgrad_gamma_rows(x0, dz0, g) if want_dw else None
    return dx0, None if g1 is None else dg1, dw_qkv


class AttentionInput(torch.autograd.Function):
    """F0 + F1 / B11 + B12 + B13: entry norm, QKV GEMM with the deferred row scale and RoPE
    in its epilogue; backward: dRoPE and the norm statistic, the norm-backward dgrad GEMM
    (with the residual gradient added in its epilogue) and the gamma-row wgrad.

    Returns (q, k, v, x0 again): q, k, v are views of the QKV GEMM's output (``split_heads``);
    the last output is the residual branch, so the gradient that
    reaches the layer's input through the residual arrives here too and is added inside
    B12's epilogue instead of by a separate add."""

    @staticmethod
    def forward(ctx, x0, g1, w_qkv, positions, freq, dims: LayerDims):
        M, d = x0.shape
        pos = positions.float()
        a0, r0 = pre_norm(x0, g1, dims.eps)  # F0
        qkv = lib.gemm_rope(
            a0, w_qkv, r0, pos, freq, config_for("rope", M, d, w_qkv.shape[1])
        )  # F1
        ctx.save_for_backward(x0, r0, qkv, g1, w_qkv, pos, freq)
        ctx.dims = dims
        return (*split_heads(qkv, dims), x0.view_as(x0))

    @staticmethod
    def backward(ctx, dq, dk, dv, dres):
        differentiable_once("AttentionInput")
        x0, r0, qkv, g1, w_qkv, pos, freq = ctx.saved_tensors
        dims = ctx.dims
        d = x0.shape[1]
        hd = dims.head_dim
        cos, sin = cached_head_rotation(pos, freq, hd, r0.dtype)
        dz0, corr0 = lib.drope_rows(dq, dk, dv, qkv, r0, cos, sin, d)  # B11
        want_dw = ctx.needs_input_grad[2]
        dx0, dg1, dw_qkv = _entry_norm_backward(x0, g1, w_qkv, dz0, corr0, dres, want_dw)
        return dx0, dg1, dw_qkv, None, None, None


class AttentionInputBias(torch.autograd.Function):
    """``AttentionInput`` for a QKV projection with a bias (Qwen2's q, k and v): F1 adds the
    bias before RoPE and also stores z = rstd0 * acc without it (as its even and odd columns;
    only its first 16 bytes a row where no backward reads it, ``train`` False) for B11, whose
    statistic reads z in place of the rotated output (which a large bias would leave with few
    bits of z); B11 also returns the bias's gradient, the column sums of the gradient before
    the rotation. With ``sect`` (Qwen2-VL's multimodal RoPE: ``gemm_rope.mrope_section_table``)
    ``positions`` is (3, M), the time, height and width rows."""

    @staticmethod
    def forward(ctx, x0, g1, w_qkv, bias_qkv, positions, freq, dims: LayerDims, train, sect=None):
        M, d = x0.shape
        pos = positions.float()
        a0, r0 = pre_norm(x0, g1, dims.eps)  # F0
        N = w_qkv.shape[1]
        z_cols = N if train else lean_z_cols(N)  # (no backward: z's store clipped to one row)
        row, mrope = f1_rows(pos, sect)
        cfg = config_for("rope", M, d, N)
        qkv, *z = lib.gemm_rope_bias(a0, w_qkv, r0, row, freq, bias_qkv, cfg, z_cols, *mrope)  # F1
        if not train:  # (no backward reads this run's z)
            z = [stand_in((M, N // 2), qkv) for _ in range(2)]
        ctx.save_for_backward(x0, r0, *z, g1, w_qkv, pos, freq)
        ctx.dims, ctx.b_dtype, ctx.sect = dims, bias_qkv.dtype, sect
        return (*split_heads(qkv, dims), x0.view_as(x0))

    @staticmethod
    def backward(ctx, dq, dk, dv, dres):
        differentiable_once("AttentionInputBias")
        x0, r0, z_even, z_odd, g1, w_qkv, pos, freq = ctx.saved_tensors
        cos, sin = _rotation(pos, freq, ctx.dims.head_dim, r0.dtype, ctx.sect)
        d = x0.shape[1]
        dz0, corr0, db = lib.drope_bias_rows(dq, dk, dv, z_even, z_odd, r0, cos, sin, d)  # B11
        want_dw = ctx.needs_input_grad[2]
        dx0, dg1, dw_qkv = _entry_norm_backward(x0, g1, w_qkv, dz0, corr0, dres, want_dw)
        db = db.to(ctx.b_dtype) if ctx.needs_input_grad[3] else None
        return dx0, dg1, dw_qkv, db, None, None, None, None, None


class AttentionInputQKNorm(torch.autograd.Function):
    """``AttentionInput`` for QK-norm (``coda.kernels.qk_norm``): Qwen3's per head, or
    OLMo's over the whole q and k projections (weights of n_q hd, n_k hd).

    Forward: F1 with the head norms and RoPE in its epilogue (the head statistic in a
    prepass), also storing z = rstd0 * acc on the q and k columns (as its even and odd
    columns; on v columns z is v) and the statistic s for the backward when ``train`` (a
    backward can run); when head_dim divides no tile width (``qk_norm_config``), and for
    OLMo's norm, F1 without rotation and one row pass instead. Backward: the norms' backward
    and dRoPE in one row pass (with the entry norm's statistic), then B12 and B13 as in
    ``AttentionInput``. With ``dims.qk_norm_after_rope`` (Hunyuan's norm of the rotated
    heads) the gains follow the rotation in the same epilogue and row pass: a rotation keeps
    each head's sum of squares, so the statistic is F1's, and each product is rounded once.
    ``sect``: multimodal RoPE (Qwen3-VL's), as ``AttentionInputBias``'s."""

    @staticmethod
    def forward(
        ctx, x0, g1, w_qkv, q_norm, k_norm, positions, freq, dims: LayerDims, train, sect=None
    ):
        M, d = x0.shape
        hd, n_q, n_k = dims.head_dim, dims.heads, dims.kv_heads
        pos = positions.float()
        row, mrope = f1_rows(pos, sect)
        a0, r0 = pre_norm(x0, g1, dims.eps)  # F0
        # (OLMo's norm spans the tiles: a row pass)
        cfg = qk_norm_config(hd) if is_per_head(q_norm, k_norm, hd) else None
        n_rot = (n_q + n_k) * hd
        post = dims.qk_norm_after_rope  # (Hunyuan's: the gains after RoPE)
        if cfg is not None:  # F1 with QK-norm and RoPE in the epilogue
            head_w, plain, post_w = epilogue_rows(q_norm, k_norm, n_q, n_k, n_k, r0.dtype, post)
            # z kept on the q and k columns only (on v columns it is the stored v, which
            # attention keeps anyway), unless that width breaks the TMA store's 16-byte rows
            z_cols = n_rot if n_rot % 16 == 0 else w_qkv.shape[1]
            if train:
                qkv, z_even, z_odd, s = lib.gemm_qk_norm_rope_keep_z(
                    a0, w_qkv, r0, row, freq, head_w, plain, hd, dims.eps, cfg, z_cols, *mrope,
                    post_w=post_w,
                )  # fmt: skip
                s = s[:, : n_q + n_k]  # the v heads' statistic is computed and unused
            else:  # no backward reads this run's z and s: not stored
                qkv = lib.gemm_qk_norm_rope(
                    a0, w_qkv, r0, row, freq, head_w, plain, hd, dims.eps, cfg, *mrope,
                    post_w=post_w,
                )  # fmt: skip
                z_even, z_odd = (stand_in((M, z_cols // 2), qkv) for _ in range(2))
                s = stand_in((M, n_q + n_k), r0)
        else:  # F1 without rotation, then the head norms and RoPE as a row pass
            z = lib.gemm_scale_rows(a0, w_qkv, r0, config_for("scale_rows", M, d, w_qkv.shape[1]))
            cos, sin = _rotation(pos, freq, hd, r0.dtype, sect)
            qkv, s = lib.qk_norm_rows(z, q_norm, k_norm, cos, sin, n_q, n_k, hd, dims.eps, post)
            z_even, z_odd = z[:, :n_rot], None  # z's q and k columns whole
        # qkv (the attention input, whose v columns are z there) shares storage with the q, k,
        # v views attention saves: keeping it costs no memory
        ctx.save_for_backward(x0, r0, z_even, z_odd, s, qkv, g1, w_qkv, q_norm, k_norm, pos, freq)
        ctx.dims, ctx.sect = dims, sect
        return (*split_heads(qkv, dims), x0.view_as(x0))

    @staticmethod
    def backward(ctx, dq, dk, dv, dres):
        differentiable_once("AttentionInputQKNorm")
        x0, r0, z_even, z_odd, s, qkv, g1, w_qkv, q_norm, k_norm, pos, freq = ctx.saved_tensors
        dims = ctx.dims
        cos, sin = _rotation(pos, freq, dims.head_dim, r0.dtype, ctx.sect)
        d = x0.shape[1]
        z_v = qkv[:, (dims.heads + dims.kv_heads) * dims.head_dim :]  # z on the v columns
        # B11 with the head norms' backward (z_odd None: z saved whole, the row-pass forward)
        dz0, corr0, dqn, dkn = lib.dqk_norm_rows(
            dq, dk, dv, z_even, z_odd, z_v, s, r0, cos, sin, q_norm, k_norm, d,
            dims.qk_norm_after_rope,
        )  # fmt: skip
        want_dw = ctx.needs_input_grad[2]
        dx0, dg1, dw_qkv = _entry_norm_backward(x0, g1, w_qkv, dz0, corr0, dres, want_dw)
        return (
            dx0,
            dg1,
            dw_qkv,
            dqn.to(q_norm.dtype),
            dkn.to(k_norm.dtype),
            *(None,) * 5,
        )


class AttentionOutput(torch.autograd.Function):
    """F3 + A1 / B8 + B9: O projection + residual, with the next norm's statistics and
    x1 * gamma2 in its epilogue. Returns (x1, a1, r1); a1 and r1 feed the MLP's GEMM and carry
    no gradient of their own (the MLP's backward takes the norm's backward whole, B6).
    ``bias_o``: the O projection's bias (d,) (Llama's ``attention_bias=True``), or None.
    ``scale``: the branch's multiplier c, x1 = x0 + c (o @ W_o) (Granite's; not with a bias);
    the backward scales dx1 by c once, rounded as HF's layer rounds it, for both GEMMs."""

    @staticmethod
    def forward(ctx, o, w_o, x0, g2, eps: float, bias_o=None, scale: float = 1.0):
        M, K = o.shape
        cfg = config_for("residual", M, K, w_o.shape[1])
        x1, a1, r1 = lib.gemm_residual_rms(o, w_o, x0, g2, eps, cfg, bias_o, scale)
        ctx.mark_non_differentiable(a1, r1)
        # no zero gradients for a1 and r1: autograd would otherwise fill an (M, d) and an (M,)
        # tensor of zeros for them at every backward (0.36 ms of a Llama-1B step, run 116)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(o, w_o)
        ctx.scale = scale
        return x1, a1, r1

    @staticmethod
    def backward(ctx, dx1, _da1, _dr1):
        differentiable_once("AttentionOutput")
        if dx1 is None:  # x1 did not reach the loss
            return (None,) * 7
        o, w_o = ctx.saved_tensors
        dx1 = dx1.contiguous()
        dy, do, dw_o = o_projection_grads(o, w_o, dx1, ctx.scale, ctx.needs_input_grad[1])
        db_o = dy.sum(0) if ctx.needs_input_grad[5] else None  # (fp32 accumulation)
        return do, dw_o, dx1, None, None, db_o, None  # dx1: the residual's gradient (to x0)


def o_projection_grads(o, w_o, dx1, scale: float, want_dw: bool):
    """B8 + B9 from the residual stream's gradient dx1 (M, d) of x1 = x0 + c (o @ W_o):
    (dy = c dx1, the projection's output gradient; do; dW_o, or None where W_o is frozen)."""
    dy = dx1 if scale == 1.0 else dx1 * scale
    return dy, dy @ w_o.t(), wgrad(o, dy) if want_dw else None


class MLP(torch.autograd.Function):
    """F4 + F5 / B4..B7: gate/up GEMM with the deferred row scale and SwiGLU (``activation``
    "silu"; "gelu_tanh": GeGLU) in its epilogue
    (the unscaled pre-activation kept for backward when ``train``: a backward can run), down
    projection + residual; backward: dSwiGLU and the norm statistic in the down projection's
    dgrad epilogue, the norm-backward dgrad GEMM with the residual gradient in its epilogue,
    and the two weight gradients.
    ``rows``: the output's leading dimensions, (batch, seq): the layer's output is a tensor of
    its own, not a view (FSDP2 warns of a module output that is a view: an in-place op on it
    would skip the pre-backward hook). ``scale``: the branch's multiplier, as
    ``AttentionOutput``'s."""

    @staticmethod
    def forward(
        ctx, x1, a1, r1, g2, w_il, w_d, rows: tuple, train: bool, activation="silu", scale=1.0,
        act=None,
    ):  # fmt: skip
        M, d = x1.shape
        f = w_d.shape[0]
        s, u = gated_up(a1, r1, w_il, train, activation, act)
        # F5: the residual add alone (no statistic): this boundary's norm is the next
        # layer's F0, which computes its own
        x2 = lib.gemm_residual_add(s, w_d, x1, config_for("residual", M, f, d), rows, scale)
        ctx.save_for_backward(x1, r1, u, g2, w_il, w_d, act)
        ctx.activation, ctx.scale = activation, scale
        return x2

    @staticmethod
    def backward(ctx, dx2):
        differentiable_once("MLP")
        x1, r1, u, g2, w_il, w_d, act = ctx.saved_tensors
        dx2 = dx2.reshape(x1.shape).contiguous()
        want = ctx.needs_input_grad[4:6]
        d_down = dx2 if ctx.scale == 1.0 else dx2 * ctx.scale
        dx1, dg2, dw_il, dw_d, d_act = mlp_grads(
            x1, r1, u, g2, w_il, w_d, d_down, dx2, ctx.activation, want, act
        )
        return dx1, None, None, dg2, dw_il, dw_d, None, None, None, None, d_act


def gated_up(a1, r1, w_il, train: bool, activation: str, act=None):
    """F4: s = GLU(r1 * (a1 @ W_il)) and, when ``train`` (a backward can run), the unscaled
    pre-activation u dSwiGLU reads (B4); else a stand-in for u (no 2f-wide store). ``act``:
    the activation's numbers (xIELU's (4,) tensor, ``reference.swiglu.xielu_act``) or None."""
    M, d = a1.shape
    cfg = config_for("swiglu", M, d, w_il.shape[1])
    if train:
        return lib.gemm_swiglu(a1, w_il, r1, cfg, activation, act)
    s = lib.gemm_swiglu_only(a1, w_il, r1, cfg, activation, act)
    return s, stand_in((M, w_il.shape[1]), a1)


def mlp_grads(x1, r1, u, g2, w_il, w_d, d_down, dres, activation: str, want=(1, 1), act=None):
    """B4-B7 from the down projection's output gradient ``d_down`` and the residual's ``dres``
    (both dx2, unless a norm follows the projection): (dx1, dgamma2, dW_il, dW_d, d_act), a
    weight's gradient None where ``want`` (W_il's, W_d's) says it is frozen; ``g2`` None: no
    norm before the MLP (``r1`` ones), dgamma2 None; d_act the gradient of xIELU's numbers
    ``act`` (a_p's and a_n's; beta and eps are constants: 0), else None."""
    M, d = x1.shape
    f = w_d.shape[0]
    cfg, d_act = config_for("dswiglu", M, d, f), None
    if act is None:
        dz1, s, stat1 = lib.dswiglu(d_down, w_d, u, r1, cfg, activation)
    else:
        dz1, s, stat1, coef = lib.dxielu(d_down, w_d, u, r1, act, cfg)
        d_act = torch.cat([coef.sum((1, 2)), act.new_zeros(2)])
    dw_d = wgrad(s, d_down) if want[1] else None  # B5
    g, corr1 = _unnormed(x1, g2, norm_corr(r1, stat1, d))  # A6
    dx1, dg2 = lib.norm_bwd(
        dz1, w_il, x1, g, corr1, dres, config_for("norm_bwd", M, w_il.shape[1], d)
    )  # B6 + A7 (K: 2f, f without a gate)
    dw_il = lib.wgrad_gamma_rows(x1, dz1, g) if want[0] else None  # B7
    return dx1, None if g2 is None else dg2, dw_il, dw_d, d_act


def decoder_layer(
    x0,
    g1,
    w_qkv,
    w_o,
    g2,
    w_il,
    w_d,
    positions,
    dims: LayerDims,
    attention=None,
    freq=None,
    qk_norm=None,
    qkv_bias=None,
    o_bias=None,
    sect=None,
    act=None,
):
    """One decoder layer on token rows x0 (M, d) as the composition of the kernel-path
    Functions, with ``attention`` (default ``sdpa_causal``) between them, differentiated by
    its own autograd. ``freq``: the RoPE epilogue's per-column frequency table (default: from
    ``dims.rope_base``); ``qk_norm``: Qwen3's (q_norm, k_norm) head-norm weights, or None;
    ``qkv_bias``: Qwen2's QKV bias (Nqkv,) in W_qkv's column order, or None (not both);
    ``o_bias``: the O projection's bias (d,) (Llama's ``attention_bias=True``), or None;
    ``sect``: multimodal RoPE's section flags, ``positions`` then (3, M) (with ``qkv_bias`` or
    ``qk_norm``); ``act``: the MLP activation's numbers (xIELU's: ``gated_up``), or None.
    Returns x2 (batch, seq, d), a tensor of its own (not a view of an (M, d) one). Where no
    backward reads this run's tensors (``torch.no_grad``, inference mode, nothing requiring a
    gradient, either kind of activation checkpointing's first pass: ``backward_can_follow``),
    the GEMMs store nothing only a backward reads (SwiGLU's pre-activation, the bias form's
    and QK-norm's z, QK-norm's statistic)."""
    o, x0_residual = attention_block(
        x0, g1, w_qkv, positions, dims, attention, freq, qk_norm, qkv_bias, sect
    )
    c = dims.residual_scale
    root_float_use(c)  # (a float the Functions below read: see ``root_float_use``)
    x1, a1, r1 = AttentionOutput.apply(o, w_o, x0_residual, g2, dims.eps, o_bias, c)
    train = backward_can_follow(x1, a1, r1, g2, w_il, w_d)  # (attention may own weights)
    rows = (dims.batch, dims.seq)
    return MLP.apply(x1, a1, r1, g2, w_il, w_d, rows, train, dims.activation, c, act)


def attention_block(
    x0, g1, w_qkv, positions, dims: LayerDims, attention, freq, qk_norm, qkv_bias, sect
):
    """F0-F2 (``decoder_layer``'s arguments): the attention-input Function of the layer's
    form, then attention. Returns (o (M, H hd), x0 as the residual branch)."""
    H, Hkv, hd = dims.heads, dims.kv_heads, dims.head_dim
    root_float_use(dims.eps)
    if freq is None:
        freq = cached_freq_table(hd, H + Hkv, Hkv, dims.rope_base, x0.device)
    if qk_norm is not None:  # (Hunyuan's after RoPE: ``dims.qk_norm_after_rope``)
        train = backward_can_follow(x0, g1, w_qkv, *qk_norm)
        q, k, v, x0_residual = AttentionInputQKNorm.apply(
            x0, g1, w_qkv, *qk_norm, positions, freq, dims, train, sect
        )
    elif qkv_bias is not None:
        train = backward_can_follow(x0, g1, w_qkv, qkv_bias)
        q, k, v, x0_residual = AttentionInputBias.apply(
            x0, g1, w_qkv, qkv_bias, positions, freq, dims, train, sect
        )
    else:
        q, k, v, x0_residual = AttentionInput.apply(x0, g1, w_qkv, positions, freq, dims)
    o4 = (attention or sdpa_causal)(q, k, v)
    if attention is not None:
        check_attention_output(o4, q)
    return o4.transpose(1, 2).reshape(x0.shape[0], H * hd), x0_residual


class Embedding(torch.autograd.Function):
    """Token embedding: torch's gather forward; backward one sorted scatter of the output's
    gradient rows into a zeroed table (``coda.kernels.embedding``), deterministic.
    ``padding_idx``: -1 for none (its row receives no gradient, as in ``nn.Embedding``)."""

    @staticmethod
    def forward(ctx, tokens, weight, padding_idx: int):
        ctx.save_for_backward(tokens)
        ctx.vocab, ctx.padding_idx = weight.shape[0], padding_idx
        return F.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, g):
        differentiable_once("Embedding")
        (tokens,) = ctx.saved_tensors
        d = g.shape[-1]
        flat = tokens.reshape(-1)
        dw = lib.embedding_backward(flat, g.reshape(-1, d), ctx.vocab, ctx.padding_idx)
        return None, dw, None


LM_HEAD_METHODS = ("auto", "recompute", "chunked", "scaled_exp")  # LinearCrossEntropyFunction's


def resolve_lm_head_method(method: str, vocab: int, needs_grad: bool = True) -> str:
    """The LM-head program that runs. "auto": CE-S ("scaled_exp", the fastest on the H200 at
    every measured shape, with and without a logit soft-cap: benchmarks/NOTES.md) where it
    applies (vocab a multiple of 128), else "recompute". Without gradients (an evaluation
    loss) always "recompute": its forward is one GEMM, where the three-GEMM programs would
    form gradients for nothing."""
    if not needs_grad:
        return "recompute"
    if method != "auto":
        return method
    return "scaled_exp" if vocab % 128 == 0 else "recompute"


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Final RMSNorm + LM head + cross-entropy, logits never stored whole.

    ``method="recompute"`` (CE-A, the pure-epilogue program): F6 keeps only (lse, target
    logit); the backward recomputes the logits chunk by chunk over the vocabulary (4 GEMMs,
    least memory). ``method="chunked"`` (CE-C): the forward also forms the g = 1 gradients,
    chunk by chunk over tokens, and the backward scales them (3 GEMMs; with reduction "none"
    the recompute program runs). ``method="scaled_exp"`` (CE-S): as chunked, but the dX and
    dW GEMMs read the forward's stored softmax numerators E through an A-operand transform
    (``kernels/ce_scaled_exp.py``): no pass over the logits outside the GEMMs. ``method``
    arrives resolved by the caller (``resolve_lm_head_method``), never "auto"."""

    @staticmethod
    def forward(
        ctx, x2, gf, w_lm, target, eps, ignore_index, reduction, chunk, method, smooth, z_loss,
        softcap=None,
    ):  # fmt: skip
        assert method != "auto", "resolve_lm_head_method first"
        M, d = x2.shape
        V = w_lm.shape[1]
        # the GEMMs' weight in x2's dtype; the gradient returns in w_lm's own (under autocast
        # an fp32 weight gets the three-GEMM programs' fp32 accumulator, never rounded to bf16)
        w = w_lm if w_lm.dtype == x2.dtype else w_lm.to(x2.dtype)
        y, r = lib.norm_rows(x2, gf, eps, True)
        ones = unit_rows(M, r.dtype, r.device)  # the row scale is already in y
        cfg = config_for("lm_head", M, d, V)
        if method in ("chunked", "scaled_exp") and reduction == "none":
            # per-token losses need per-token weights in dW and dgamma, which the chunked
            # program (gradients formed at weight 1 in the forward) cannot apply
            method = "recompute"
        ctx.method = method
        logit_sum = logits_row_sum(y, w) if smooth else None
        stats = dict(logit_sum=logit_sum, vocab=V, label_smoothing=smooth, z_loss=z_loss)
        if method in ("chunked", "scaled_exp"):
            weight = ce_row_weights(target, ignore_index, reduction, r.dtype)  # at g = 1
            if method == "chunked":
                rows, op = chunk_rows(V), lib.lm_head_chunked
            else:
                rows, op = chunk_rows_scaled(V), lib.lm_head_scaled
            ctx.want_dw = ctx.needs_input_grad[2]  # (a frozen LM head: no dW GEMM at all)
            lse, tl, G, coef, S, dw_acc = op(
                y, w, ones, target, weight, rows, cfg, smooth, z_loss, ctx.want_dw, softcap
            )
            # kept unrounded (G, coef and dW in fp32): the backward adds G's target entries
            # and applies the upstream gradient before the one rounding to bf16
            # (the target entries read w_lm itself: under autocast no bf16 copy is kept)
            ctx.save_for_backward(G, coef, S, target, x2, gf, r, dw_acc, w_lm)
            capped = tl if softcap is None else softcap_rows(tl, softcap)  # (l_y uncapped)
            return ce_loss_from_stats(lse, capped, target, ignore_index, reduction, **stats)
        parts, tl = lib.lm_head_stats(y, w, ones, target, cfg, softcap)  # F6
        lse = combine_lse(parts)  # A3
        ctx.save_for_backward(x2, y, r, ones, lse, tl, target, gf, w)
        ctx.w_dtype = w_lm.dtype
        ctx.cfg = (ignore_index, reduction, chunk, cfg, smooth, z_loss, softcap)
        capped = tl if softcap is None else softcap_rows(tl, softcap)  # (F6 keeps l_y uncapped)
        return ce_loss_from_stats(lse, capped, target, ignore_index, reduction, **stats)

    @staticmethod
    def backward(ctx, g):
        differentiable_once("LinearCrossEntropyFunction")
        nones = (None,) * 9
        if ctx.method in ("chunked", "scaled_exp"):
            G, coef, S, target, x2, gf, r, dw_acc, w_lm = ctx.saved_tensors
            dx2, dgf = head_norm_backward(G, coef, S, target, w_lm, x2, gf, r, g)
            dw = weight_grad_from_acc(dw_acc, g, w_lm) if ctx.want_dw else None
            return dx2, dgf, dw, *nones  # dgf in gf's dtype already (one rounding)
        x2, y, r, ones, lse, tl, target, gf, w = ctx.saved_tensors
        ignore_index, reduction, chunk, cfg, smooth, z_loss, softcap = ctx.cfg
        scale = row_scale(target, ignore_index, reduction, g)
        p_scale, hot, shift = ce_grad_weights(scale, lse, w.shape[1], smooth, z_loss)
        want_dw = ctx.needs_input_grad[2]  # (a frozen LM head: no B3)
        G, S, dw = lib.lm_head_bwd(
            y, w, ones, lse, tl, target, p_scale, chunk, cfg,
            hot=hot, shift=shift, want_dw=want_dw, softcap=softcap,
        )  # B1 + B3 + B2  # fmt: skip
        dx2, dgf = fused(final_norm_bwd_normed)(G, S, x2, gf, r)  # A4 + A5
        return dx2, dgf.to(gf.dtype), dw.to(ctx.w_dtype) if want_dw else None, *nones
