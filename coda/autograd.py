"""autograd.Functions for the kernel path: a Llama decoder layer and the LM head + loss.

Forward and backward are the kernel sequence of KERNELS.md section 6 (F0..F6, B1..B13): every
op outside attention is a GEMM epilogue or a small AUX reduction; attention is torch SDPA
(flash), its backward taken from the graph it recorded. Weights are coda-layout (in, out)
matrices (``coda.layouts``); tokens are rows, batch-major.

Saved per layer: x0, r0, rotated q/k and v (qkv), the attention graph, o, x1, r1, u. Not
saved: a0, a1, s (recomputed in B4), any norm output, any partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coda.kernels._launch import fused
from coda.kernels.drope import drope_rows, rotation_tables
from coda.kernels.dswiglu import dswiglu_kernel
from coda.kernels.gemm_residual_rms import epilogue_gemm, gemm_residual_rms_kernel
from coda.kernels.gemm_rope import cached_freq_table, gemm_rope_kernel
from coda.kernels.gemm_swiglu import gemm_swiglu_kernel
from coda.kernels.linear_cross_entropy import lm_head_stats_kernel
from coda.kernels.linear_cross_entropy_bwd import (
    final_norm_bwd_normed,
    linear_cross_entropy_bwd_kernel,
    row_scale,
)
from coda.kernels.linear_cross_entropy_chunked import linear_cross_entropy_chunked
from coda.kernels.rmsnorm_bwd import norm_bwd_kernel, norm_corr
from coda.kernels.tuned import config_for
from coda.kernels.wgrad import wgrad, wgrad_gamma_rows
from coda.primitives.aux import ce_loss_from_stats, combine_lse


@dataclass(frozen=True)
class LayerDims:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_base: float


def entry_norm(x, gamma, eps):
    """F0: r = rstd(x) (fp32) and a = x * gamma (bf16): the norm of a layer's input when no
    producing GEMM computed it."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    return (xf * gamma.to(acc)).to(x.dtype), torch.rsqrt(xf.pow(2).mean(-1) + eps)


def final_norm(x, gamma, eps):
    """The final norm before the LM head: y = x * rstd * gamma rounded once (as
    ``F.rms_norm``), and rstd. The LM head takes y, not the deferred-scale x * gamma: the loss
    gradient then enters its GEMMs unscaled, rounded exactly as PyTorch rounds it (folding
    rstd into it rounds the gradient's dominant one-hot entries at other points)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(acc)
    r = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * r[:, None] * gamma.to(acc)).to(x.dtype), r


def _heads(t, dims: LayerDims, n):
    return t.view(dims.batch, dims.seq, n, dims.head_dim).transpose(1, 2)


class DecoderLayerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x0, g1, w_qkv, w_o, g2, w_il, w_d, positions, dims: LayerDims):
        M, d = x0.shape
        H, Hkv, hd = dims.heads, dims.kv_heads, dims.head_dim
        f = w_d.shape[0]
        freq = cached_freq_table(hd, H + Hkv, Hkv, dims.rope_base, x0.device)
        pos = positions.float()
        a0, r0 = fused(entry_norm)(x0, g1, dims.eps)  # F0
        qkv = gemm_rope_kernel(a0, w_qkv, r0, pos, freq, config_for(M, d, w_qkv.shape[1]))  # F1
        t = _heads(qkv, dims, H + 2 * Hkv)
        with torch.enable_grad():  # F2: flash attention; its graph is its backward
            q, k, v = (
                p.detach().requires_grad_() for p in (t[:, :H], t[:, H : H + Hkv], t[:, H + Hkv :])
            )
            o4 = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o = o4.detach().transpose(1, 2).reshape(M, H * hd)
        x1, a1, r1 = gemm_residual_rms_kernel(
            o, w_o, x0, g2, dims.eps, config_for(M, H * hd, d)
        )  # F3 + A1
        s, u = gemm_swiglu_kernel(a1, w_il, r1, True, config_for(M, d, 2 * f))  # F4
        # F5: residual add only; this boundary's norm is the next layer's F0, so its partials
        # are not reduced (no AUX)
        x2, _, _ = epilogue_gemm(s, w_d, x1, None, config_for(M, f, d))
        ctx.save_for_backward(x0, r0, qkv, o, x1, r1, u, g1, w_qkv, w_o, g2, w_il, w_d, pos)
        ctx.attn = (q, k, v, o4)
        ctx.dims = dims
        return x2

    @staticmethod
    def backward(ctx, dx2):
        x0, r0, qkv, o, x1, r1, u, g1, w_qkv, w_o, g2, w_il, w_d, pos = ctx.saved_tensors
        dims = ctx.dims
        M, d = x0.shape
        H, Hkv, hd = dims.heads, dims.kv_heads, dims.head_dim
        f = w_d.shape[0]
        dx2 = dx2.contiguous()
        dz1, s, stat1 = dswiglu_kernel(dx2, w_d, u, r1, config_for(M, d, f))  # B4
        dw_d = wgrad(s, dx2)  # B5
        corr1 = norm_corr(r1, stat1, d)  # A6
        dx1, dg2 = norm_bwd_kernel(
            dz1, w_il, x1, g2, corr1, dx2, config_for(M, 2 * f, d)
        )  # B6 + A7
        dw_il = wgrad_gamma_rows(x1, dz1, g2, config_for(d, M, 2 * f))  # B7
        do = dx1 @ w_o.t()  # B8
        dw_o = wgrad(o, dx1)  # B9
        q, k, v, o4 = ctx.attn
        do4 = do.view(dims.batch, dims.seq, H, hd).transpose(1, 2)
        dq, dk, dv = torch.autograd.grad(o4, (q, k, v), do4)  # B10
        dqkv = torch.empty_like(qkv)
        t = _heads(dqkv, dims, H + 2 * Hkv)
        t[:, :H], t[:, H : H + Hkv], t[:, H + Hkv :] = dq, dk, dv
        freq = cached_freq_table(hd, 1, 0, dims.rope_base, x0.device)
        cos, sin = rotation_tables(pos, freq[0::2], freq[1::2], hd, r0.dtype)
        dz0, corr0 = fused(drope_rows)(dqkv, qkv, r0, cos, sin, H + Hkv, hd, d)  # B11
        dx0, dg1 = norm_bwd_kernel(
            dz0, w_qkv, x0, g1, corr0, dx1, config_for(M, w_qkv.shape[1], d)
        )  # B12 + A9
        dw_qkv = wgrad_gamma_rows(x0, dz0, g1, config_for(d, M, w_qkv.shape[1]))  # B13
        ctx.attn = None
        return (dx0, dg1.to(g1.dtype), dw_qkv, dw_o, dg2.to(g2.dtype), dw_il, dw_d, None, None)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Final RMSNorm + LM head + cross-entropy, logits never stored whole.

    ``method="recompute"`` (CE-A, the pure-epilogue program): F6 keeps only (lse, target
    logit); the backward recomputes the logits chunk by chunk over the vocabulary (4 GEMMs,
    least memory). ``method="chunked"`` (CE-C): the forward also forms the g = 1 gradients,
    chunk by chunk over tokens, and the backward scales them (3 GEMMs; "mean"/"sum" only)."""

    @staticmethod
    def forward(ctx, x2, gf, w_lm, target, eps, ignore_index, reduction, chunk, method):
        M, d = x2.shape
        y, r = fused(final_norm)(x2, gf, eps)
        ones = torch.ones_like(r)  # the row scale is already in y
        cfg = config_for(M, d, w_lm.shape[1])
        ctx.method = method
        if method == "chunked":
            weight = row_scale(target, ignore_index, reduction, torch.ones((), device=x2.device))
            rows = max(128, (2**28 // (2 * w_lm.shape[1])) // 128 * 128)  # 256 MiB of logits
            lse, tl, G, S, dw = linear_cross_entropy_chunked(
                y, w_lm, ones, target, weight, rows, cfg
            )
            dx2, dgf = fused(final_norm_bwd_normed)(G.to(r.dtype), S, x2, gf, r)
            ctx.save_for_backward(dx2, dgf, dw)
            return ce_loss_from_stats(lse, tl, target, ignore_index, reduction)
        parts, tl = lm_head_stats_kernel(y, w_lm, ones, target, cfg)  # F6
        lse = combine_lse(parts)  # A3
        ctx.save_for_backward(x2, y, r, lse, tl, target, gf, w_lm)
        ctx.cfg = (ignore_index, reduction, chunk, cfg)
        return ce_loss_from_stats(lse, tl, target, ignore_index, reduction)

    @staticmethod
    def backward(ctx, g):
        if ctx.method == "chunked":
            dx2, dgf, dw = ctx.saved_tensors
            gf_dtype = dx2.dtype
            return (
                dx2 * g.to(dx2.dtype),
                (dgf * g).to(gf_dtype),
                dw * g.to(dw.dtype),
                None,
                None,
                None,
                None,
                None,
                None,
            )
        x2, y, r, lse, tl, target, gf, w_lm = ctx.saved_tensors
        ignore_index, reduction, chunk, cfg = ctx.cfg
        scale = row_scale(target, ignore_index, reduction, g)
        G, S, dw = linear_cross_entropy_bwd_kernel(
            y, w_lm, torch.ones_like(r), lse, tl, target, scale, chunk, cfg
        )  # B1 + B3 + B2
        dx2, dgf = fused(final_norm_bwd_normed)(G, S, x2, gf, r)  # A4 + A5
        return dx2, dgf.to(gf.dtype), dw, None, None, None, None, None, None
