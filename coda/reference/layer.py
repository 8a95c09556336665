"""A Llama-style layer plus LM head and loss, twice: canonical (HF conventions, differentiated
by torch autograd) and as CODA's kernel sequence F0..F6, B1..B13 (KERNELS.md section 6) built
only from this package's reparameterized references, with a hand-written backward.

The second form is the specification coda's kernels implement; the float64 tests prove it
equals the first, loss and every gradient, on weights converted from the HF layout.

Weights are a dict of (in, out) matrices in HF column order: wq (d, H*hd), wk and wv
(d, Hkv*hd), wo (H*hd, d), wg and wu (d, f), wd (f, d), w_lm (d, V), and gammas g1, g2, gf.
Tokens are rows: x0 is (B*S, d), batch-major; positions restart at 0 in every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coda._validate import check_attention_output
from coda.reference.cross_entropy import (
    ce_from_stats_ref,
    cross_entropy_ref,
    dlogits_ref,
    lse_combine_ref,
    lse_partials_ref,
)
from coda.reference.rmsnorm import (
    final_norm_ref,
    gemm_residual_rms_ref,
    head_rmsnorm_ref,
    norm_bwd_apply_ref,
    norm_corr_ref,
    norm_stat_ref,
    rmsnorm_ref,
    rstd_ref,
    wgrad_gamma_rows_ref,
)
from coda.reference.rope import (
    adjacent_to_hf_columns,
    gemm_rope_ref,
    hf_to_adjacent_columns,
    rope_adjacent_bwd_ref,
    rope_adjacent_ref,
    rope_angles,
    rope_hf_ref,
    rope_table,
)
from coda.reference.swiglu import (
    GLU_REFS,
    dswiglu_ref,
    gemm_swiglu_ref,
    interleave_gate_up,
    mlp_activation_ref,
    split_gate_up,
)


@dataclass(frozen=True)
class LayerShape:
    batch: int
    seq: int
    d: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    eps: float = 1e-5
    rope_base: float = 10000.0
    activation: str = "silu"  # the MLP's: "silu", "gelu_tanh", "relu2", "xielu" (w["act"])
    residual_scale: float = 1.0  # each sublayer's output times it before its add (Granite's)
    qk_norm_after_rope: bool = False  # the QK-norm of the rotated q and k (Hunyuan's)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def random_layer_weights(s: LayerShape, dtype=torch.float64, generator=None) -> dict:
    def mat(i, o):
        return torch.randn(i, o, dtype=dtype, generator=generator) / i**0.5

    def gamma(n):
        return 1 + 0.1 * torch.randn(n, dtype=dtype, generator=generator)

    hd = s.head_dim
    return {
        "wq": mat(s.d, s.heads * hd),
        "wk": mat(s.d, s.kv_heads * hd),
        "wv": mat(s.d, s.kv_heads * hd),
        "wo": mat(s.heads * hd, s.d),
        "wg": mat(s.d, s.ffn),
        "wu": mat(s.d, s.ffn),
        "wd": mat(s.ffn, s.d),
        "w_lm": mat(s.d, s.vocab),
        "g1": gamma(s.d),
        "g2": gamma(s.d),
        "gf": gamma(s.d),
    }


def positions_of(s: LayerShape) -> torch.Tensor:
    return torch.arange(s.seq).repeat(s.batch)


def attention_ref(q, k, v, s: LayerShape, attention=None):
    """Causal GQA attention on token rows: q (M, H*hd), k and v (M, Hkv*hd) -> (M, H*hd).
    ``attention(q, k, v)`` on (B, heads, S, hd) replaces the default causal SDPA."""
    B, S, hd = s.batch, s.seq, s.head_dim

    def heads(t, n):
        return t.reshape(B, S, n, hd).transpose(1, 2)

    if attention is not None:
        qh = heads(q, s.heads)
        o = attention(qh, heads(k, s.kv_heads), heads(v, s.kv_heads))
        check_attention_output(o, qh)
        return o.transpose(1, 2).reshape(B * S, s.heads * hd)
    if B * S == 0:  # no tokens: CUDA SDPA returns None for an empty batch (torch 2.11, run 153)
        return q * 0  # (0, H*hd), still in the graph: every weight gets its (zero) gradient
    rep = s.heads // s.kv_heads
    kk = heads(k, s.kv_heads).repeat_interleave(rep, dim=1)
    vv = heads(v, s.kv_heads).repeat_interleave(rep, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(heads(q, s.heads), kk, vv, is_causal=True)
    return o.transpose(1, 2).reshape(B * S, s.heads * hd)


def decoder_layer_ref(
    x0, w: dict, s: LayerShape, positions=None, attention=None, cs=None, rows: tuple = ()
):
    """The layer in coda's weight layout (w: g1, wqkv, wo, g2, w_il, wd; with Qwen3's QK-norm
    also q_norm, k_norm (hd,) in adjacent order; with Qwen2's QKV bias bqkv (Nqkv,) in wqkv's
    column order; with Llama's O-projection bias bo (d,); with Gemma 2's and 3's norms after
    each sublayer their gains g_attn_out, g_ffn_out (d,); g1, g2 None: no norm before the
    sublayers, EXAONE 4's; with xIELU its numbers act (4,), ``swiglu.xielu_act``),
    differentiable by autograd: the reference path of ``coda.nn.DecoderLayer``. Same math as
    ``llama_layer_ref`` on the converted weights ([I3.4-I3.7]); each sublayer's output times
    ``s.residual_scale`` before its add; ``attention`` as in ``attention_ref``; ``cs``
    (M, hd), the RoPE table of every row (default from positions).
    Returns x2 (M, d), or (*rows, d) with ``rows`` (a tensor of its own, not a view); without
    the MLP's weights (no "w_il": ``DecoderLayer(mlp=)``'s) x1, the attention sublayer's
    output after its residual add."""
    M, hd = x0.shape[0], s.head_dim
    nq, nkv = s.heads * hd, s.kv_heads * hd
    if cs is None:
        pos = positions_of(s) if positions is None else positions
        cs = rope_table(pos, hd, s.rope_base)
    cs = cs.to(device=x0.device, dtype=x0.dtype)
    z = _pre_norm_ref(x0, w["g1"], s.eps) @ w["wqkv"]  # (an fp32 gain: Gemma's rounding)
    if "bqkv" in w:  # Qwen2's q, k, v biases (W_qkv's column order), added before RoPE in
        z = z + w["bqkv"].to(z.dtype)  # the product's dtype (a Linear's under autocast)
    q, k = z[:, :nq].reshape(M, s.heads, hd), z[:, nq : nq + nkv].reshape(M, s.kv_heads, hd)
    norm = "q_norm" in w  # Qwen3's per-head QK-norm (weights in adjacent order), before RoPE
    if norm and not s.qk_norm_after_rope:
        q, k = head_rmsnorm_ref(q, w["q_norm"], s.eps), head_rmsnorm_ref(k, w["k_norm"], s.eps)
    q, k = rope_adjacent_ref(q, cs), rope_adjacent_ref(k, cs)
    if norm and s.qk_norm_after_rope:  # Hunyuan's, of the rotated heads
        q, k = head_rmsnorm_ref(q, w["q_norm"], s.eps), head_rmsnorm_ref(k, w["k_norm"], s.eps)
    q, k = q.flatten(1), k.flatten(1)
    o = attention_ref(q, k, z[:, nq + nkv :], s, attention) @ w["wo"]
    if "bo" in w:  # the O projection's bias (Llama's attention_bias=True), a Linear's
        o = o + w["bo"].to(o.dtype)
    if "g_attn_out" in w:  # Gemma 2's and 3's norm of the sublayer's output, before the add
        o = final_norm_ref(o, w["g_attn_out"], s.eps)
    if s.residual_scale != 1.0:  # Granite's residual multiplier, rounded as HF's layer rounds
        o = o * s.residual_scale
    x1 = x0 + o
    if "w_il" not in w:  # the attention sublayer alone (the MLP a module of its own)
        return x1.view(*rows, x1.shape[1]) if rows else x1
    gu = _pre_norm_ref(x1, w["g2"], s.eps) @ w["w_il"]
    act = w["act"].to(gu.dtype) if "act" in w else None  # (xIELU's, in the MLP's dtype as HF's)
    y = mlp_activation_ref(gu, s.activation, act) @ w["wd"]
    if "g_ffn_out" in w:
        y = final_norm_ref(y, w["g_ffn_out"], s.eps)
    if s.residual_scale != 1.0:
        y = y * s.residual_scale
    if rows:
        x1, y = x1.view(*rows, x1.shape[1]), y.view(*rows, y.shape[1])
    return x1 + y


def _pre_norm_ref(x, g, eps: float):
    """A sublayer's input: normed by ``g``, or as it is without a pre-norm (``g`` None)."""
    return x if g is None else final_norm_ref(x, g, eps)


def llama_layer_ref(x0, w: dict, s: LayerShape):
    """Canonical layer forward in HF conventions; returns x2."""
    M, hd = x0.shape[0], s.head_dim
    theta = rope_angles(positions_of(s), hd, s.rope_base)
    y1 = rmsnorm_ref(x0, w["g1"], s.eps)
    q = rope_hf_ref((y1 @ w["wq"]).view(M, s.heads, hd), theta).flatten(1)
    k = rope_hf_ref((y1 @ w["wk"]).view(M, s.kv_heads, hd), theta).flatten(1)
    x1 = x0 + attention_ref(q, k, y1 @ w["wv"], s) @ w["wo"]
    y2 = rmsnorm_ref(x1, w["g2"], s.eps)
    sw = GLU_REFS[s.activation](y2 @ w["wg"], y2 @ w["wu"])
    return x1 + sw @ w["wd"]


def lm_head_loss_ref(x2, w: dict, target, s: LayerShape, ignore_index=-100):
    logits = rmsnorm_ref(x2, w["gf"], s.eps) @ w["w_lm"]
    return cross_entropy_ref(logits, target, ignore_index)


def to_coda_layout(w: dict, s: LayerShape) -> dict:
    """HF (in, out) weights -> coda's: W_qkv with q, k in adjacent-pair order; W_il."""
    hd = s.head_dim
    wqkv = torch.cat(
        [
            hf_to_adjacent_columns(w["wq"], s.heads, hd),
            hf_to_adjacent_columns(w["wk"], s.kv_heads, hd),
            w["wv"],
        ],
        dim=1,
    )
    out = {k: v for k, v in w.items() if k not in ("wq", "wk", "wv", "wg", "wu")}
    return {**out, "wqkv": wqkv, "w_il": interleave_gate_up(w["wg"], w["wu"])}


def from_coda_grads(g: dict, s: LayerShape) -> dict:
    """coda-layout weight gradients -> HF layout (exact permutations)."""
    hd, nq, nkv = s.head_dim, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = {k: v for k, v in g.items() if k not in ("wqkv", "w_il")}
    out["wq"] = adjacent_to_hf_columns(g["wqkv"][:, :nq], s.heads, hd)
    out["wk"] = adjacent_to_hf_columns(g["wqkv"][:, nq : nq + nkv], s.kv_heads, hd)
    out["wv"] = g["wqkv"][:, nq + nkv :]
    out["wg"], out["wu"] = split_gate_up(g["w_il"])
    return out


def coda_layer_sequence_ref(x0, w: dict, target, s: LayerShape, tile_n: int = 128):
    """CODA's sequence, forward and hand-written backward, on coda-layout weights ``w``.
    Returns (loss, dx0, weight grads in coda layout)."""
    M, d, hd = x0.shape[0], s.d, s.head_dim
    nq, nkv = s.heads * hd, s.kv_heads * hd
    cs = rope_table(positions_of(s), hd, s.rope_base).to(x0.dtype)
    # -- forward ----------------------------------------------------------------------------
    r0 = rstd_ref(x0, s.eps)  # F0
    a0 = x0 * w["g1"]
    z = gemm_rope_ref(a0, w["wqkv"], r0, cs, s.heads, s.kv_heads, hd)  # F1
    qkv = z.detach().requires_grad_(True)
    o = attention_ref(qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :], s)  # F2
    x1, a1, r1 = gemm_residual_rms_ref(o.detach(), w["wo"], x0, w["g2"], s.eps)  # F3 + A1
    sw, u1 = gemm_swiglu_ref(a1, w["w_il"], r1, s.activation, w.get("act"))  # F4
    x2, a2, r2 = gemm_residual_rms_ref(sw, w["wd"], x1, w["gf"], s.eps)  # F5 + A2
    acc_lm = a2 @ w["w_lm"]  # F6 (never stored by the kernel)
    logits = r2[:, None] * acc_lm
    lse = lse_combine_ref(lse_partials_ref(logits, tile_n))  # A3
    tl = logits.gather(1, target.clamp(min=0)[:, None])[:, 0]
    loss = ce_from_stats_ref(lse, tl, target)
    # -- backward ---------------------------------------------------------------------------
    g = {}
    dl = dlogits_ref(logits, lse, target)  # B1
    dz_lm = r2[:, None] * dl
    corr2 = norm_corr_ref(r2, norm_stat_ref(dl, acc_lm), d)  # A4
    dx2, g["gf"] = norm_bwd_apply_ref(dz_lm @ w["w_lm"].T, x2, w["gf"], corr2)  # B2 + A5
    g["w_lm"] = a2.T @ dz_lm  # B3
    ds = dx2 @ w["wd"].T  # B4
    s_re, dz1, S1, *d_act = dswiglu_ref(ds, u1, r1, s.activation, w.get("act"))
    g.update({"act": d_act[0]} if d_act else {})  # (xIELU's a_p and a_n)
    g["wd"] = s_re.T @ dx2  # B5
    corr1 = norm_corr_ref(r1, S1, d)  # A6
    dx1, g["g2"] = norm_bwd_apply_ref(dz1 @ w["w_il"].T, x1, w["g2"], corr1, dres=dx2)  # B6, A7
    g["w_il"] = wgrad_gamma_rows_ref(x1, dz1, w["g2"])  # B7
    do = dx1 @ w["wo"].T  # B8
    g["wo"] = o.detach().T @ dx1  # B9
    (dqkv,) = torch.autograd.grad(o, qkv, do)  # B10, attention backward (external)
    dq = rope_adjacent_bwd_ref(dqkv[:, :nq].view(M, s.heads, hd), cs).flatten(1)  # B11
    dk = rope_adjacent_bwd_ref(dqkv[:, nq : nq + nkv].view(M, s.kv_heads, hd), cs).flatten(1)
    S0 = (dqkv * z).sum(-1) / r0  # rotation invariance: sum over rotated = sum over pre-rotation
    dz0 = r0[:, None] * torch.cat([dq, dk, dqkv[:, nq + nkv :]], dim=1)
    corr0 = norm_corr_ref(r0, S0, d)
    dx0, g["g1"] = norm_bwd_apply_ref(dz0 @ w["wqkv"].T, x0, w["g1"], corr0, dres=dx1)  # B12
    g["wqkv"] = wgrad_gamma_rows_ref(x0, dz0, w["g1"])  # B13
    return loss, dx0, g
