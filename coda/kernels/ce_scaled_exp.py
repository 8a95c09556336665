"""CE-S, the three-GEMM LM head + cross-entropy (issue 9; design and traffic model in
benchmarks/NOTES.md): softmax numerators stored with power-of-two row offsets, read back by
the two gradient GEMMs through an A-operand transform. GEMM1:

    acc = a @ W_lm                       a = x * gamma_f, W_lm (d x V)
    l   = rstd * acc                     VEC-LD COL rstd (the final norm's deferred row scale)
    k[m, t] = rne(log2 e * max_{n in t} l[m, n])     prepass statistic (TileMaxLog2), per N-tile
    E[m, n] = 2^(l log2 e - k[m, t])     the stored tile (bf16; E <= sqrt 2)
    s[m, t] = sum_{n in t} E[m, n]       RED_m partials
    l_y[m]  = l[m, y_m]                  VEC-ST COL, the exact fp32 target logit

From them, with K[m] = max_t k[m, t]:  lse[m] = ln 2 * (K + log2 sum_t 2^(k - K) s)
(``lse_from_scaled``), and softmax p[m, n] = 2^(k[m, t] - K[m]) * v[m] * E[m, n] with the
per-row v = 2^K e^-lse: a power of two per (row, N-tile) times a per-row fp32 factor. So
the gradient GEMMs read E itself, scaled per (row, 64 columns) on its way into the mainloop
(``ScaleA``), instead of a dlogits tensor (the glue's three row passes, each a torch form
and a Triton pass: ``ce_scaled_rows``, with ``lse_from_scaled``):

    glue  u[b, m] = 2^(k[m, t(b)] - K[m]) (bf16 strip, ``strip_u``), c = r w v (``scaled_glue``),
          xs = c a (``row_scaled``), and E' = E with each row's target entry zeroed, so that
          u v E' = alpha p off the target
    dX    G = c (.) ((u (.) E') @ W^T)        fp32, the final norm's backward follows;
          sum_j G[m, j] a[m, j]               TILE-LD a, RED_m: the norm statistic's row dot
    dW    dW^T (+)= (u (.) E')^T @ xs         fp32, TMA reduce-add over token chunks
    hot   dW^T[y_m] += h_m a_m with h = r w (alpha p_y - (1 - eps)) in fp32
          (``add_target_terms``), and G's share G[m] += h_m W[:, y_m] in the backward, on its
          way through the final norm (``final_norm_rows.head_norm_backward``): the one large
          entry per row never rounded to bf16

GEMM1's tile must cover whole N-tiles of V (tile_n | V): the maximum is over the tile's own
columns, which a ragged last tile would pad with zeros; the strips need V % 128 == 0.
Oracles: ``coda.reference.cross_entropy.scaled_exp_logits_ref`` (GEMM1) and autograd
through the canonical loss (the method). Tests: tests/test_ce_scaled_exp.py (float64
through the interpreter, sm_90a compile); GPU: the LM-head tests' "scaled_exp" cases. The
default LM-head program since the H200 measured it fastest of coda's three (benchmarks/NOTES.md,
session 5); with the exact target entries ("hot" above) it passes CODA's protocol for any
upstream gradient there (session 6: dW 0.90x PyTorch's error, geometric mean of 200 cases).
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, launch
from coda.kernels.ce_scaled_rows import (
    STRIP,
    glue_pass,
    norm_stat_rows,
    norm_stat_rows_torch,
    row_scaled,
    row_scaled_torch,
    scaled_glue,
    strip_u,
)
from coda.kernels.config import GemmConfig
from coda.kernels.linear_cross_entropy import capped_with_slope
from coda.kernels.linear_cross_entropy_chunked import add_target_terms
from coda.primitives import (
    ColLoad,
    ColSelect,
    RowPartials,
    ScaleA,
    TileLoad,
    TileMaxLog2,
    epilogue_program,
    exp2,
    sigmoid,
)
from coda.primitives.vocabulary import LOG2E


def _row_logits(acc, rstd):
    return {"k": acc * rstd}


@epilogue_program(
    inputs=[ColLoad("rstd"), TileMaxLog2("k", out="k_tile")],
    sinks=[RowPartials("sum_exp"), ColSelect("target_logit", index="target")],
    prepass=_row_logits,
)
def scaled_exp_logits(acc, rstd, k):
    logit = acc * rstd
    e = exp2(logit * LOG2E - k)
    return {"D": e, "sum_exp": e, "target_logit": logit}


# -- GEMM1 with a logit soft-cap (Gemma 2's): the numerators of the capped logits
# z = c tanh(l / c) = c (2 s - 1), s = sigmoid(2 l / c) (``capped_logits_lse_target``'s form);
# the sum is of 2^(z log2 e - k), the stored tile that times the slope dz/dl = 4 s (1 - s), so
# the gradient GEMMs read dl's softmax share as before; the target's l_y stays uncapped (the
# driver caps it for p_y and the loss, and scales its coefficient by the target's slope)
def _capped_row_logits(acc, rstd, cap):
    return {"k": cap * (2.0 * sigmoid(acc * rstd * (2.0 / cap)) - 1.0)}


@epilogue_program(
    inputs=[ColLoad("rstd"), ColLoad("cap"), TileMaxLog2("k", out="k_tile")],
    sinks=[RowPartials("sum_exp"), ColSelect("target_logit", index="target")],
    prepass=_capped_row_logits,
)
def capped_scaled_exp_logits(acc, rstd, cap, k):
    logit = acc * rstd
    s = sigmoid(logit * (2.0 / cap))
    e = exp2(cap * (2.0 * s - 1.0) * LOG2E - k)
    return {"D": e * (4.0 * s * (1.0 - s)), "sum_exp": e, "target_logit": logit}


def scaled_exp_config(v: int, config: GemmConfig) -> GemmConfig:
    """``config`` with a tile_n that divides V and is a multiple of the strip's 64 columns
    (its own, else 192, 128, 256 or 64, in that order); raises when none does."""
    from dataclasses import replace

    for tn in (config.tile_n, 192, 128, 256, 64):
        if v % tn == 0 and tn % STRIP == 0:
            return replace(config, tile_n=tn)
    raise ValueError(f"V = {v}: the scaled-exp LM head needs V divisible by 64")


# what ``benchmarks/tune_configs.py`` sweeps for GEMM1 (``ce_logits``): GEMM1's tile is the
# CE-C statistics GEMM's tuned one through ``scaled_exp_config`` (at V = 32768, where 192 does
# not divide V, 128 x 128 ping-pong). Swept twice on the H200 (runs 214, 215): at d = 2048 that
# tile was the fastest both times; at d = 4096, V = 128256 the winner swapped between 128 x 256
# cooperative and 128 x 192 ping-pong (2-4 % either way), and the LM head timed with the former
# ran 1 ms slower: the tuned tile stays
LOGITS_CANDIDATES = tuple(
    GemmConfig(128, tn, cm, cn, True) for tn in (128, 192) for cm, cn in ((2, 1), (1, 2))
) + tuple(
    GemmConfig(tm, tn, cm, cn, False)  # (ping-pong tiles stop at 208 wide in quack 0.6.5)
    for tm, tn, cm, cn in ((128, 256, 2, 1), (128, 256, 1, 2), (256, 128, 2, 1), (256, 192, 2, 1))
)


def scaled_exp_logits_kernel(a, w_lm, rstd, target, config: GemmConfig, dry=False, softcap=None):
    """Returns (E bf16 (M, V), sum_exp fp32 (M, T_N), k fp32 (M, T_N), target logit fp32 (M,),
    0 where not selected). ``config.tile_n`` must divide V (``scaled_exp_config``).
    ``softcap`` c: the capped program (E times each entry's slope; the sums and k of the
    capped logits; the target logit uncapped)."""
    M, V = a.shape[0], w_lm.shape[1]
    if V % config.tile_n:
        raise ValueError(f"V = {V} must be a multiple of tile_n = {config.tile_n}")
    t_n = V // config.tile_n
    acc = acc_dtype(a)
    e = a.new_empty(M, V)
    outputs = {
        "sum_exp": a.new_empty(M, t_n, dtype=acc),
        "k_tile": a.new_empty(M, t_n, dtype=acc),
        "target_logit": a.new_zeros(M, dtype=acc),
    }
    operands = {"rstd": rstd, "target": target, "k": config.tile_n}
    program = scaled_exp_logits
    if softcap is not None:  # (the cap as a per-row operand, as the recompute program's)
        operands["cap"], program = rstd.new_full((M,), softcap, dtype=acc), capped_scaled_exp_logits
    compiled = launch(
        program,
        a,
        w_lm,
        config=config,
        d=e,
        operands=operands,
        outputs=outputs,
        dry=dry,
    )
    if dry:
        return compiled
    return e, outputs["sum_exp"], outputs["k_tile"], outputs["target_logit"]


# -- the two gradient GEMMs, reading E through an A-operand transform -----------------------------
# The glue gives, per row m, the softmax gradient's E' (E with the target entry zeroed) and a
# strip u[b, m] = 2^(k[m, t(b)] - K[m]) per 64-column block b of the vocabulary (exact powers of
# two, bf16), so that dl = c_m * u * E' / r_m with c the per-row fp32 factor r w v.


@epilogue_program(
    inputs=[ColLoad("row_scale"), TileLoad("a")],
    sinks=[RowPartials("stat")],
    a_transform=ScaleA("u", tile_k=STRIP),
)
def scaled_grad_dx(acc, row_scale, a):
    """G = c (.) ((u (.) E') @ W^T), c the per-row scale: dX before the final norm, fp32; and
    the final norm's statistic's softmax share sum_j G[m, j] a[m, j] as RED_m partials (a: the
    GEMMs' normed operand, the tile congruent with G's)."""
    g = acc * row_scale
    return {"D": g, "stat": g * a}


@epilogue_program(a_transform=ScaleA("u", rows=STRIP, cols=1, tile_k=STRIP))
def scaled_grad_dw(acc):
    """dW^T (+)= (u (.) E')^T @ xs, xs = c (.) a: the weight gradient in (V, d) layout."""
    return {"D": acc}


def _grad_tile_n(d: int) -> int:
    """The gradient GEMMs' tile_n over d: 192 where it divides d (quack's own pipeline's
    choice), else 256, else 128. Their A operand (E) passes through the mainloop's transform
    once per output tile, so a wide tile transforms each E tile fewer times (d / tile_n): at
    128 they ran 9-15 % slower than the logits GEMM of the same FLOPs (run 23); at 256, 4-10 %
    over cuBLAS's plain GEMM (run 24's sweep, ``benchmarks/tune_configs.py`` ce_grad_*)."""
    return next((tn for tn in (192, 256) if d % tn == 0), 128)


# what ``benchmarks/tune_configs.py`` sweeps for the two gradient GEMMs (tile_m 128: the
# strip's row blocks; cooperative: quack's A transform has no ping-pong schedule)
GRAD_CANDIDATES = tuple(
    GemmConfig(128, tn, cm, cn, False) for tn in (128, 256) for cm, cn in ((2, 1), (1, 2), (1, 1))
)


def dx_config(d: int) -> GemmConfig:
    """dX GEMM (rows x d, K = V): tile_m 128 (the strip's row blocks), tile_n over d,
    cooperative (quack's A transform has no ping-pong schedule)."""
    return GemmConfig(128, _grad_tile_n(d), 2, 1, False)


def dw_config(d: int) -> GemmConfig:
    """dW GEMM (V x d, K = rows): a 2 x 1 cluster, 1-3 % faster than 1 x 2 at every swept
    shape (run 24)."""
    return GemmConfig(128, _grad_tile_n(d), 2, 1, False)


def dx_partials(d: int) -> int:
    """Row-dot partials per row of the dX GEMM at its config: one per N-tile of d."""
    return dx_config(d).grid(0, d)[1]


def scaled_grad_dx_kernel(e, w_lm, u, c, a, out, stat=None, dry=False, config=None):
    """out (rows, d) fp32 = c (.) ((u (.) e) @ w_lm^T); e (rows, V) bf16, u (V / 64, rows), a
    (rows, d) the normed operand. Returns the epilogue's (rows, T) partials of sum_j out[m, j]
    a[m, j] (fp32, one per N-tile of d; ``stat`` to write them into), the final norm's
    statistic's softmax share (the compile count when ``dry``). ``config``: instead of
    ``dx_config``'s (the sweep)."""
    config = config or dx_config(w_lm.shape[0])
    if stat is None:
        stat = out.new_empty(out.shape[0], config.grid(*out.shape)[1])
    compiled = launch(
        scaled_grad_dx,
        e,
        w_lm.t(),
        config=config,
        d=out,
        operands={"row_scale": c, "u": u, "a": a},
        outputs={"stat": stat},
        dry=dry,
    )
    return compiled if dry else stat


def scaled_grad_dw_kernel(e, xs, u, out, accumulate: bool, dry=False, config=None):
    """out (V, d) fp32 (+)= (u^T (.) e^T) @ xs; ``accumulate``: TMA reduce-add into out.
    ``config``: instead of ``dw_config``'s (the sweep)."""
    return launch(
        scaled_grad_dw,
        e.t(),
        xs,
        config=config or dw_config(xs.shape[1]),
        d=out,
        operands={"u": u},
        add_to_output=accumulate,
        dry=dry,
    )


# -- the chunked driver (the same contract as CE-C's; its row passes: ce_scaled_rows) --------------
# Bytes of E (bf16, rows x V) stored per token chunk: the memory / time trade of CE-S. Each
# chunk after the first reduce-adds its dW into the fp32 V x d accumulator (8 V d bytes of
# traffic: 8.4 GB at d = 8192, V = 128256); a larger budget means fewer chunks. Measured at
# 1 GiB (benchmarks/NOTES.md: "CE-S on the H200"); lm_head_train also times 2 GiB and 512
# MiB, which saved only 0.08 GiB at d = 4096 (the backward's dW cast, the fp32 accumulator and
# its bf16 copy at once, holds nearly the same peak) for 3.4 % more time (run 338, session 84).
E_CHUNK_BYTES = 2**30


def chunk_rows_scaled(vocab: int) -> int:
    """Token rows per chunk: ~``E_CHUNK_BYTES`` of bf16 E (a multiple of 128, at least 128)."""
    return max(128, (E_CHUNK_BYTES // (2 * vocab)) // 128 * 128)


def linear_cross_entropy_scaled(
    a,
    w_lm,
    rstd,
    target,
    weight,
    rows: int = 4096,
    config: GemmConfig | None = None,
    interpreted: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    want_dw: bool = True,
    softcap: float | None = None,
):
    """CE-S, forward stats and g = 1 gradients in three GEMMs per token chunk (GEMM1 storing
    E, dX and dW reading E through the A-operand transform). Returns (lse, target_logit,
    G (M x d, fp32, the softmax share), coef, S, dW_lm) as ``linear_cross_entropy_chunked``
    does (G + coef W[:, y] is dL/da: the backward adds the target entries; S the final norm's
    statistic, ``norm_stat``, with its row dot summed in dX's epilogue), dW_lm the fp32
    accumulator as a (d, V) view of its (V, d) storage (without ``want_dw``, a frozen weight:
    no dW GEMM, an empty (d, 0) dW_lm).
    ``softcap`` c: of the logits z = c tanh(l / c) (``capped_scaled_exp_logits``; the target
    logit returned uncapped, its coefficient the gradient's w.r.t. the uncapped l_y; not with
    label smoothing).
    ``weight``: the per-row loss weight (1/M_valid or 1; 0 on ignored rows). V must be a
    multiple of 128."""
    from coda._validate import CodaInputError

    M, d = a.shape
    V = w_lm.shape[1]
    if V % 128:
        raise CodaInputError(f"w_lm: method 'scaled_exp' needs V % 128 == 0, got V = {V}")
    cfg = scaled_exp_config(V, config or GemmConfig())
    acc = acc_dtype(a)
    rows = max(128, rows // 128 * 128)
    # one unpadded chunk: its per-row results are the call's (no copies into whole-call rows)
    whole = 0 < M <= rows and M % 128 == 0
    if not whole:
        lse = a.new_empty(M, dtype=acc)
        y_logit, coefs = torch.empty_like(lse), torch.empty_like(lse)
    G = a.new_empty(M, d, dtype=acc)
    # the row dot sum_j G a's partials, per N-tile of d, as dX's epilogue writes them
    dot = a.new_empty(M, dx_partials(d), dtype=acc)
    # dW^T, summed over chunks in fp32
    dw_t = a.new_empty(V if want_dw else 0, d, dtype=acc)
    if label_smoothing:  # the uniform -eps/V of every dl: rank-1 in both gradients and S
        shift = label_smoothing / V
        smooth_sum = a.new_zeros(d, dtype=acc)  # sum_m r w a: dW's share
        w_sum = w_lm.sum(1, dtype=acc)  # W's row sums: G's share, and the dot's (a . w_sum)
    glue = scaled_glue if interpreted else glue_pass
    row_index = torch.arange(min(rows, -(-M // 128) * 128), device=a.device)
    for r0 in range(0, M, rows):
        n = min(rows, M - r0)
        C = -(-n // 128) * 128  # the strips' row blocks: pad the chunk to whole 128-row tiles
        R = slice(r0, r0 + n)
        a_c, r_c, t_c, w_c = a[R], rstd[R], target[R], weight[R].to(acc)
        if C != n:  # zero rows of weight 0: no loss, no gradient
            a_c = torch.cat([a_c, a_c.new_zeros(C - n, d)])
            r_c = torch.cat([r_c, r_c.new_ones(C - n)])
            t_c = torch.cat([t_c, t_c.new_full((C - n,), -1)])
            w_c = torch.cat([w_c, w_c.new_zeros(C - n)])
        e, sum_exp, k, tl_c = scaled_exp_logits_kernel(a_c, w_lm, r_c, t_c, cfg, softcap=softcap)
        if softcap is None:
            lse_c, K, c, coef = glue(sum_exp, k, tl_c, r_c, w_c, z_loss, label_smoothing)
        else:  # p_y from the capped target logit, its coefficient times the slope there
            z_y, slope = capped_with_slope(tl_c, softcap)
            lse_c, K, c, coef = glue(sum_exp, k, z_y, r_c, w_c, z_loss, 0.0)
            coef = coef * slope
        xs = row_scaled_torch(a_c, c) if interpreted else row_scaled(a_c, c)
        u = strip_u(k, K, cfg.tile_n, a.dtype)
        # E' = E with each row's target entry zeroed (ignored and padded rows have c = 0, so
        # their clamped entry may be zeroed too: no mask, no boolean indexing, no host sync)
        # (the zero is a device scalar: a Python 0 is a host-to-device copy, which a CUDA graph
        # capture refuses)
        e.index_put_((row_index[:C], t_c.clamp(0, V - 1).long()), e.new_zeros(()))
        # dX (and its row dot's partials) straight into the call's rows, but a padded last chunk
        G_c = G[R] if C == n else a.new_empty(C, d, dtype=acc)
        dot_c = dot[R] if C == n else dot.new_empty(C, dot.shape[1])
        scaled_grad_dx_kernel(e, w_lm, u, c, a_c, G_c, dot_c)
        if want_dw:  # then the target entries' share, exact in fp32 (G's: in the backward)
            scaled_grad_dw_kernel(e, xs, u, dw_t, accumulate=r0 > 0)
            add_target_terms(dw_t, a_c, t_c, coef)
        # the chunk's E (1 GiB) let go before the next chunk's is made: held by the name until
        # rebound, two were alive at once (1 GiB more at d = 4096, V = 128256: session 83)
        del e, xs
        if whole:
            lse, y_logit, coefs = lse_c, tl_c, coef
        else:
            lse[R], y_logit[R], coefs[R] = lse_c[:n], tl_c[:n], coef[:n]
        if C != n:
            G[R], dot[R] = G_c[:n], dot_c[:n]
        if label_smoothing:  # (the row dot's share: into its first partial)
            a_f = a_c.to(acc)
            smooth_sum += (r_c * w_c) @ a_f
            dot[R, 0] -= shift * (r_c * w_c * (a_f @ w_sum))[:n]
    if label_smoothing:
        G -= shift * (rstd * weight.to(acc))[:, None] * w_sum[None, :]
        if want_dw:
            dw_t -= shift * smooth_sum[None, :]
    # the norm's statistic from dX's epilogue partials: no pass over G
    S = (norm_stat_rows_torch if interpreted else norm_stat_rows)(dot, rstd, coefs, y_logit)
    return lse, y_logit, G, coefs, S, dw_t.t()


def compile_scaled_grad_dx(d: int, v: int, *, m: int = 256, config=None) -> int:
    e = torch.empty(m, v, dtype=torch.bfloat16)
    w = torch.empty(d, v, dtype=torch.bfloat16)
    u = torch.empty(v // STRIP, m, dtype=torch.bfloat16)
    a = torch.empty(m, d, dtype=torch.bfloat16)
    out = torch.empty(m, d, dtype=torch.float32)
    return scaled_grad_dx_kernel(e, w, u, torch.empty(m), a, out, dry=True, config=config)


def compile_scaled_grad_dw(d: int, v: int, *, accumulate: bool, m: int = 256, config=None) -> int:
    e = torch.empty(m, v, dtype=torch.bfloat16)
    xs = torch.empty(m, d, dtype=torch.bfloat16)
    u = torch.empty(v // STRIP, m, dtype=torch.bfloat16)
    out = torch.empty(v, d, dtype=torch.float32)
    return scaled_grad_dw_kernel(e, xs, u, out, accumulate, dry=True, config=config)


def compile_scaled_exp_logits(
    d: int, v: int, *, config: GemmConfig, m: int = 256, capped: bool = False
) -> int:
    a, w = example_operands(m, d, v)
    softcap = 30.0 if capped else None
    return scaled_exp_logits_kernel(
        a, w, torch.empty(m), torch.zeros(m, dtype=torch.int64), config, dry=True, softcap=softcap
    )
