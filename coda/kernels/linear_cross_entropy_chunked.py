"""LM head + cross-entropy forward AND backward in three GEMMs, chunked over tokens
(KERNELS.md section 4, CE-C), against CE-A's four. Measured on the H200 (benchmarks/NOTES.md)
it is the slowest of coda's three: the stored fp32 logits add a pass over M x V that CE-S
(``ce_scaled_exp``, the default) avoids. Its row pass, target entries and dW accumulator are
the ones CE-S shares.

The upstream gradient of a "mean" or "sum" loss is a scalar g, and every gradient is linear
in it, so the forward computes them for g = 1 and the backward only scales (the Liger /
QuACK chunked design). For each chunk of rows R (one chunk of logits live at a time):

    F6'  acc = a[R] @ W_lm                 l = rstd * acc: TILE-ST l in fp32, LSE partials and
                                           the target logit (the loss's stats)
    row  dz~ = rstd * dl, dl = w exp(l - lse) off the target column, 0 on it: pointwise over
         the chunk (read fp32 l, write bf16 dz~); lse is F6''s, from the same fp32 values, so
         p sums to 1 without a pass over the vocabulary, and p has fp32 accuracy (bf16 logits
         would give it an error of |l| 2^-9, PyTorch's own)
    B2'  G[R] = dz~ @ W_lm^T               (quack GEMM, fp32 M x d: no bf16 rounding of dy)
    B3'  dW_lm (+)= a[R]^T @ dz~           quack GEMM whose TMA store reduce-adds the fp32
                                           result into one fp32 dW (the first chunk stores):
                                           no bf16 rounding per chunk, no separate add pass
    hot  the target entries, exact in fp32: dW's added here (``add_target_terms``, shared
         with CE-S), G's left to the backward, which adds them on its way through the final
         norm (``final_norm_rows.head_norm_backward``: G + coef W[y], dh and dgamma in one
         pass), so the returned G is the softmax share and coef the target entries' per-row
         coefficient
then   S = sum_j (G + coef W[:, y])_j a_j / rstd (the final norm's statistic, = sum_n dl_n l_n /
       rstd; one pass over M x d, ``norm_stat``).

Extra memory: one chunk of fp32 logits and its bf16 dz~ (``chunk_rows``: 384 MiB together),
the fp32 G and the fp32 d x V dW, both kept to the backward (which applies g and rounds once).
Tests: tests/test_backward_kernels.py (CPU loop), tests/test_forward_kernels.py (compile).
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, fused, interpret_gemm, launch
from coda.kernels._triton import on_triton
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.linear_cross_entropy_bwd import passthrough
from coda.kernels.target_terms import scatter_rows_triton
from coda.kernels.tuned import config_for
from coda.primitives import ColLoad, ColSelect, OnlineLSE, epilogue_program
from coda.primitives.aux import combine_lse


@epilogue_program(
    inputs=[ColLoad("rstd")],
    sinks=[OnlineLSE("lse"), ColSelect("target_logit", index="target")],
)
def logits_with_stats(acc, rstd):
    logit = acc * rstd
    return {"D": logit, "lse": logit, "target_logit": logit}


def chunk_rows(vocab: int) -> int:
    """Token rows per chunk: 256 MiB of fp32 logits (a multiple of 128, at least 128)."""
    return max(128, (2**28 // (4 * vocab)) // 128 * 128)


def logits_chunk(a, w_lm, rstd, target, config: GemmConfig = DEFAULT, dry=False):
    """F6' on rows ``a``: returns (logits fp32, lse fp32, target logit fp32)."""
    M, V = a.shape[0], w_lm.shape[1]
    logits = a.new_empty(M, V, dtype=acc_dtype(a))
    outputs = {
        "lse": a.new_empty(M, config.grid(M, V)[1], dtype=acc_dtype(a)),
        "target_logit": a.new_zeros(M, dtype=acc_dtype(a)),
    }
    compiled = launch(
        logits_with_stats,
        a,
        w_lm,
        config=config,
        d=logits,
        operands={"rstd": rstd, "target": target},
        outputs=outputs,
        dry=dry,
    )
    if dry:
        return compiled
    return logits, combine_lse(outputs["lse"]), outputs["target_logit"]


def logits_chunk_interpreted(a, w_lm, rstd, target, config: GemmConfig = DEFAULT):
    out = interpret_gemm(
        logits_with_stats,
        a,
        w_lm,
        config=config,
        operands={"rstd": rstd, "target": target},
    )
    logits = out["D"].to(acc_dtype(a))
    return logits, combine_lse(out["lse"]), torch.nan_to_num(out["target_logit"], nan=0.0)


def softmax_grad_rows(dz, logits, lse, target, rstd, weight, label_smoothing=0.0, z_loss=0.0):
    """The row pass, pointwise: dz = rstd * dl (written into ``dz``, a.dtype) from the fp32
    logits, dl = w * ((1 + 2 z lse) exp(l - lse) - eps / V) (z-loss z, label smoothing eps),
    and 0 in each row's target column (``add_target_terms`` adds that entry exactly). Rows with
    w = 0 (ignored) give zeros."""
    V = logits.shape[1]
    lse = lse[:, None]
    p = torch.exp(logits - lse)
    if z_loss:
        p = p * (1.0 + 2.0 * z_loss * lse)
    cols = torch.arange(V, device=logits.device)
    dl = weight[:, None] * (p - label_smoothing / V)
    dz.copy_(torch.where(cols[None, :] == target[:, None], 0.0, rstd[:, None] * dl))


def target_coef(tl, lse, rstd, weight, label_smoothing=0.0, z_loss=0.0, shift=0.0):
    """The target entry's gradient per row, r w (alpha p_y - (1 - eps) - shift), in fp32 from
    the exact target logit: alpha (p_y - 1) = alpha expm1(l_y - lse) has no cancellation
    when p_y is near 1 (a confident model), where a bf16 p_y minus 1 would keep none of it."""
    alpha = 1.0 + 2.0 * z_loss * lse if z_loss else 1.0
    return rstd * weight * (alpha * torch.expm1(tl - lse) + (alpha - 1.0 + label_smoothing - shift))


def add_target_terms(dw_t, a, target, coef):
    """The target entries' share of dW, added in fp32 outside the GEMMs (whose operands hold 0
    there): dW^T[y_m] += coef_m a_m. Their share of dL/da, coef_m W[:, y_m], is added by the
    final norm's backward on its way through G (``final_norm_rows.head_norm_backward``).

    Why: a bf16 target entry is the one large value of its row, and on near-uniform rows
    (early training) all rows' entries are nearly the same number, so their roundings add up
    coherently in dX and dW instead of averaging out; PyTorch's bf16 dlogits round them too,
    so the comparison went either way depending on the upstream gradient's mantissa. Exact
    here, these terms are never the larger error. ``dw_t``: a (V, d) view of the fp32 dW
    accumulator; the sums run in a fixed order (sorted by target), so deterministically. Rows
    whose target is ignored (or padding) have weight 0, so coef 0: their clamped index adds 0."""
    if on_triton(a):  # the same as a Triton kernel (``target_terms``)
        return scatter_rows_triton(dw_t, a, target, coef)
    return add_target_terms_torch(dw_t, a, target, coef)


def add_target_terms_torch(dw_t, a, target, coef):
    """``add_target_terms`` in torch: the CPU path, and the Triton kernel's oracle."""
    y = target.clamp(0, dw_t.shape[0] - 1).long()
    dw_t.index_put_((y,), coef[:, None] * a.to(dw_t.dtype), accumulate=True)


def norm_stat(G, a, rstd, coef, target_logit):
    """S[m] = sum_j (G + coef W[:, y])[m, j] a[m, j] / rstd[m] from the softmax share G: its
    row dot plus the target entry's, coef l_y / rstd (l_y = rstd W[:, y] . a), accumulated
    in fp32 (float64 for proofs)."""
    acc = torch.float64 if G.dtype == torch.float64 else torch.float32
    return norm_stat_from_dot((G.to(acc) * a.to(acc)).sum(-1), rstd, coef, target_logit)


def norm_stat_from_dot(dot, rstd, coef, target_logit):
    """``norm_stat`` given the softmax share's row dot, sum_j G[m, j] a[m, j] (CE-S sums it
    in its dX GEMM's epilogue)."""
    return (dot + coef * target_logit / rstd) / rstd


def g_config(rows: int, v: int, d: int) -> GemmConfig:
    """Tile config of B2' (rows x d, K = V)."""
    return config_for("passthrough", rows, v, d)


def dw_config(d: int, rows: int, v: int) -> GemmConfig:
    """Tile config of B3' (d x V, K = rows): the LM head's tuned config for its shape."""
    return config_for("passthrough", d, rows, v)


def dw_gemm(a, dz, dw, rows: int):
    """B3's operands (A, B, D, config) for dW (+)= a^T @ dz~, D written row-major: dw (d, V)
    row-major as is, or, when dw is the (d, V) view of a (V, d) buffer (an HF weight's
    layout), its transpose dz~^T @ a into that buffer. ``rows``: the chunk's K."""
    d, V = dw.shape
    if dw.stride(0) == 1 and dw.stride(1) != 1:
        return dz.t(), a, dw.t(), dw_config(V, rows, d)
    return a.t(), dz, dw, dw_config(d, rows, V)


def linear_cross_entropy_chunked(
    a,
    w_lm,
    rstd,
    target,
    weight,
    rows: int = 4096,
    config: GemmConfig = DEFAULT,
    interpreted: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    want_dw: bool = True,
):
    """Forward stats and g = 1 gradients. Returns (lse, target_logit, G (M x d), coef (M,), S,
    dW_lm): G the softmax share of dL/da, whose target entries G + coef W[:, y] adds (the
    backward does, ``head_norm_backward``), S the final norm's statistic, dW_lm complete,
    fp32 in w_lm's layout (rounded once, with the upstream gradient, by
    ``weight_grad_from_acc``). ``weight`` is the per-row loss weight (1/M_valid or 1; 0 on
    ignored rows). Without ``want_dw`` (a frozen weight) dW's GEMMs are not run and dW_lm is
    an empty (d, 0) tensor: no V x d accumulator."""
    M, d = a.shape
    V = w_lm.shape[1]
    lse = a.new_empty(M, dtype=acc_dtype(a))
    tl = torch.empty_like(lse)
    G = a.new_empty(M, d, dtype=acc_dtype(a))
    coefs = torch.empty_like(lse)
    dz = a.new_empty(min(rows, M), V)
    # dW sums one partial product per token chunk in fp32 (the GEMM reduce-adds its fp32 tile
    # into it); the backward rounds it to w_lm's dtype once, with the upstream gradient, in
    # w_lm's layout (``weight_grad_from_acc``). The accumulator is (V, d)-major whatever w_lm's
    # layout: the target entries' scatter-add (``add_target_terms``) then writes whole rows of
    # it. Into a (d, V) row-major buffer the same scatter ran on a transposed view, which
    # index_put_ makes contiguous and copies back, twice a V x d fp32 pass per token chunk
    # (H200, run 19: 382 ms against CE-S's 92 at d=4096, V=128256)
    dw = a.new_empty(V if want_dw else 0, d, dtype=acc_dtype(a)).t()
    row_kernel = softmax_grad_rows if interpreted else fused(softmax_grad_rows)
    chunk = logits_chunk_interpreted if interpreted else logits_chunk
    for r0 in range(0, M, rows):
        R = slice(r0, min(r0 + rows, M))
        dzr = dz[: R.stop - r0]
        logits, lse[R], tl[R] = chunk(a[R], w_lm, rstd[R], target[R], config)
        row_kernel(
            dzr,
            logits,
            lse[R],
            target[R],
            rstd[R],
            weight[R].to(lse.dtype),
            label_smoothing,
            z_loss,
        )
        del logits
        # B2': G[R] = dz~ @ W_lm^T, stored in fp32 (a bf16 G would carry the same rounding
        # as PyTorch's dy and tie its dx error instead of beating it)
        launch(passthrough, dzr, w_lm.t(), config=g_config(rows, V, d), d=G[R])
        # B3': dW (+)= a[R]^T @ dz~ (or its transpose), fp32 reduce-add by the TMA store after
        # chunk 0
        if want_dw:
            A, B, D, cfg = dw_gemm(a[R], dzr, dw, rows)
            launch(passthrough, A, B, config=cfg, d=D, add_to_output=r0 > 0)
        coefs[R] = target_coef(
            tl[R],
            lse[R],
            rstd[R],
            weight[R].to(lse.dtype),
            label_smoothing,
            z_loss,
            label_smoothing / V,
        )
        if want_dw:
            add_target_terms(dw.t(), a[R], target[R], coefs[R])
    S = (norm_stat if interpreted else fused(norm_stat))(G, a, rstd, coefs, tl)
    return lse, tl, G, coefs, S, dw


def compile_logits_chunk(d, v, *, w_major="n", config=DEFAULT, m=256) -> int:
    a, w = example_operands(m, d, v, w_major)
    return logits_chunk(a, w, torch.empty(m), torch.zeros(m, dtype=torch.int64), config, dry=True)


def compile_g(d, v, *, m=256) -> int:
    """B2': G (m x d, fp32) = dz~ @ W_lm^T, W_lm (d, V) row-major entering K-major."""
    dz = torch.empty(m, v, dtype=torch.bfloat16)
    w = torch.empty(d, v, dtype=torch.bfloat16)
    G = torch.empty(m, d, dtype=torch.float32)
    return launch(passthrough, dz, w.t(), config=g_config(m, v, d), d=G, dry=True)


def compile_dw(d, v, *, accumulate: bool, m=256, hf_layout: bool = False) -> int:
    """B3': the fp32 dW (d x V) = a^T @ dz~ with a (m, d) row-major entering as an M-major A
    operand; ``accumulate``: the reduce-add store of chunks after the first. ``hf_layout``:
    its transpose (V x d) = dz~^T @ a, dz~ entering M-major (an HF weight)."""
    a = torch.empty(m, d, dtype=torch.bfloat16)
    dz = torch.empty(m, v, dtype=torch.bfloat16)
    dw = torch.empty(v, d).t() if hf_layout else torch.empty(d, v)
    A, B, D, config = dw_gemm(a, dz, dw, m)
    return launch(passthrough, A, B, config=config, d=D, add_to_output=accumulate, dry=True)
