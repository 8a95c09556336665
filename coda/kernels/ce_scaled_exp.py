"""The scaled-exp LM-head GEMM: softmax numerators stored with power-of-two row offsets, the
first kernel of the three-GEMM cross-entropy design in benchmarks/NOTES.md (issue 9, "CE-S").

    acc = a @ W_lm                       a = x * gamma_f, W_lm (d x V)
    l   = rstd * acc                     VEC-LD COL rstd (the final norm's deferred row scale)
    k[m, t] = rne(log2 e * max_{n in t} l[m, n])     prepass statistic (TileMaxLog2), per N-tile
    E[m, n] = 2^(l log2 e - k[m, t])     the stored tile (bf16; E <= sqrt 2)
    s[m, t] = sum_{n in t} E[m, n]       RED_m partials
    l_y[m]  = l[m, y_m]                  VEC-ST COL, the exact fp32 target logit

From them, with K[m] = max_t k[m, t]:  lse[m] = ln 2 * (K + log2 sum_t 2^(k - K) s)
(``lse_from_scaled``), and softmax p[m, n] = 2^(k[m, t] - K[m]) * v[m] * E[m, n] with the
per-row v = 2^K e^-lse: a power of two per (row, N-tile) times a per-row fp32 factor. That is
what lets the two backward GEMMs read E itself (scaled per (row, k-tile) on the way into the
mainloop, an A-operand transform; not built yet, NOTES.md) instead of a dlogits tensor.

The tile must cover whole N-tiles of V (tile_n | V): the maximum is over the tile's own
columns, which a ragged last tile would pad with zeros. Oracle: ``scaled_exp_reference``.
Tests: tests/test_ce_scaled_exp.py (float64 through the interpreter, sm_90a compile).
"""

from __future__ import annotations

import math

import torch

from coda.kernels._launch import acc_dtype, example_operands, launch
from coda.kernels.config import GemmConfig
from coda.primitives import ColLoad, ColSelect, RowPartials, TileMaxLog2, epilogue_program, exp2

LOG2E = 1.0 / math.log(2.0)


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


def scaled_exp_config(v: int, config: GemmConfig) -> GemmConfig:
    """``config`` with a tile_n that divides V (192, 128, 256 or 64, in that order of
    preference); raises when none does."""
    from dataclasses import replace

    for tn in (config.tile_n, 192, 128, 256, 64):
        if v % tn == 0:
            return replace(config, tile_n=tn)
    raise ValueError(f"V = {v}: the scaled-exp LM head needs V divisible by 64")


def scaled_exp_logits_kernel(a, w_lm, rstd, target, config: GemmConfig, dry=False):
    """Returns (E bf16 (M, V), sum_exp fp32 (M, T_N), k fp32 (M, T_N), target logit fp32 (M,),
    0 where not selected). ``config.tile_n`` must divide V (``scaled_exp_config``)."""
    M, V = a.shape[0], w_lm.shape[1]
    if V % config.tile_n:
        raise ValueError(f"V = {V} must be a multiple of tile_n = {config.tile_n}")
    t_n = V // config.tile_n
    acc = acc_dtype(a)
    e = torch.empty(M, V, dtype=a.dtype, device=a.device)
    outputs = {
        "sum_exp": torch.empty(M, t_n, dtype=acc, device=a.device),
        "k_tile": torch.empty(M, t_n, dtype=acc, device=a.device),
        "target_logit": torch.zeros(M, dtype=acc, device=a.device),
    }
    operands = {"rstd": rstd, "target": target, "k": config.tile_n}
    compiled = launch(
        scaled_exp_logits,
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


def lse_from_scaled(sum_exp, k):
    """lse[m] = ln 2 * (K + log2 sum_t 2^(k[m, t] - K) s[m, t]), K = max_t k[m, t]: every
    term <= the largest partial, nothing overflows."""
    K = k.amax(dim=1, keepdim=True)
    return math.log(2.0) * (K[:, 0] + torch.log2((torch.exp2(k - K) * sum_exp).sum(dim=1)))


def scaled_exp_reference(a, w_lm, rstd, target, tile_n: int):
    """The kernel's outputs from their definitions, in a's precision (float64 for proofs)."""
    logits = rstd[:, None] * (a @ w_lm)
    M, V = logits.shape
    tiles = logits.view(M, V // tile_n, tile_n)
    k = torch.round(tiles.amax(-1) * LOG2E)
    e = torch.exp2(tiles * LOG2E - k[..., None])
    hit = (target >= 0) & (target < V)
    tl = torch.where(hit, logits.gather(1, target.clamp(0, V - 1).long()[:, None])[:, 0], 0.0)
    return e.reshape(M, V), e.sum(-1), k, tl


def compile_scaled_exp_logits(d: int, v: int, *, config: GemmConfig, m: int = 256) -> int:
    a, w = example_operands(m, d, v)
    return scaled_exp_logits_kernel(
        a, w, torch.empty(m), torch.zeros(m, dtype=torch.int64), config, dry=True
    )
