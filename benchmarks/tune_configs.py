"""Sweep tile configs for every epilogue GEMM of the layer, forward and backward, and the LM
head (M = 16384 tokens unless the shape says otherwise) and print the winners as
``coda/kernels/tuned.py`` entries.

For each shape and candidate config: quack's raw GEMM (identity epilogue) and the coda
epilogue kernel that runs at that shape in the layer, next to cuBLAS. The winner minimizes the
coda kernel's time. Run by ``gpu_suite.py --tune``; ``CODA_TUNE_ONLY=name,name`` (prefixes of
the GEMM names below, e.g. ``dswiglu,wgrad``) restricts the sweep, and
``CODA_TUNE_SHAPES=tag,tag`` (``d2048``, ``1b``, ``qwen3``, ...) its shapes;
``CODA_TUNE_WIDE=1`` widens the candidates (``WIDE``). The layer's GEMMs and CE-S's
time their candidates round-robin beside cuBLAS (``interleaved``: the median of three rounds,
with their spread and the clock), not one after the other: in sequence each tile meets the
clock the one before it left at the power cap, and a 2-4 % winner swapped between two runs
(NOTES, session 50; the row passes and the closed ``ce_grad_dw_final`` probe still time in
sequence). The sweep also times B11's Triton row passes at each launch shape (``row_pass_*``,
for ``row_passes.TUNED``), CE-S's two gradient GEMMs at each of their candidate configs
(``ce_grad_*``) and its logits GEMM at each of its own (``ce_logits``).

Shapes: the layer benchmark's (head_dim 128, ffn = 8d/3 rounded to 256) at d = 2048, 4096,
8192, the 1B-shaped model's layer (d = 2048, 32/8 heads of 64, ffn 8192) as ``..._1b``, and
Qwen3-0.6B's (d = 1024, 16/8 heads of 128, ffn 3072) as ``..._qwen3``, the d=1024 demo
model's (8/4 heads of 128, ffn 2816, V = 8192) as ``..._demo`` at its own 8 x 1024 tokens.
"""

from __future__ import annotations

import functools
import os
import statistics

import torch

from benchmarks._common import SKIPPED, bench, interleaved, out_of_time, progress, selected
from benchmarks.bench_forward import HIDDEN, VOCABS, ffn, heads
from coda import _quack
from coda.kernels import dswiglu as dsw
from coda.kernels import gemm_residual_rms as grr
from coda.kernels import gemm_rmsnorm_gemm as rg
from coda.kernels import gemm_rope as rp
from coda.kernels import gemm_swiglu as sw
from coda.kernels import linear_cross_entropy as lce
from coda.kernels import rmsnorm_bwd as nb
from coda.kernels import tuned
from coda.kernels import wgrad as wg
from coda.kernels.config import GemmConfig

M = 16384
# (128 x 256 ping-pong is not among them: quack 0.6.5 rejects a ping-pong tile over 208 wide)
CANDIDATES = [
    GemmConfig(128, 192, 2, 1, True),
    GemmConfig(128, 128, 2, 1, True),
    GemmConfig(128, 192, 1, 2, True),
    GemmConfig(256, 128, 2, 1, False),
    GemmConfig(256, 192, 2, 1, False),
]
# ``CODA_TUNE_WIDE=1`` adds these: the cooperative 256 x 128 tile on a 1 x 2 cluster that
# cuBLAS picks for the norm-backward dgrads' shapes, 128 x 256 cooperative tiles, the 128 x 128
# ping-pong tile on a 1 x 2 cluster and a single-CTA 128 x 192 one. (Dropped after 29 round-robin
# sweeps of layer GEMMs, runs 219-226, where neither came within 2.5 % of the best: the narrow
# 128 x 64 ping-pong tile, 1.24-2.23x the best, and 256 x 128 cooperative on one CTA, 1.035x+.)
WIDE = [
    GemmConfig(256, 128, 1, 2, False),
    GemmConfig(128, 256, 2, 1, False),
    GemmConfig(128, 256, 1, 2, False),
    GemmConfig(128, 128, 1, 2, True),
    GemmConfig(128, 192, 1, 1, True),
]
# weight gradients (K = 16384 tokens against a d x N output): also split-K (Cleave's Split)
SPLIT_K = [
    GemmConfig(128, 192, 2, 1, True, split_k=2),
    GemmConfig(128, 192, 2, 1, False, split_k=2),
    GemmConfig(128, 128, 2, 1, True, split_k=2),
]


# (suffix, d, ffn, heads, kv heads, head_dim, vocabularies, tokens M)
SHAPES = [(f"_d{d}", d, ffn(d), *heads(d), 128, VOCABS, M) for d in HIDDEN] + [
    ("_1b", 2048, 8192, 32, 8, 64, (), M),
    # Qwen3-0.6B's layer (d = 1024, 16/8 heads of 128, ffn 3072): untuned so far; its N = d
    # outputs leave the default 192-wide tile a ragged sixth column tile (1152 for 1024)
    ("_qwen3", 1024, 3072, 16, 8, 128, (), M),
    # the d=1024 demo model's layer and LM head (8/4 heads of 128, ffn 2816, V = 8192): its
    # GEMMs ran 1.30x torch.compile's cuBLAS ones (run 30; its dSwiGLU 275 us against ~120 for
    # cuBLAS's dgrad + Inductor's SwiGLU backward); the same ragged 192-wide tile. Swept at the
    # demo's own 8 x 1024 tokens: at K = d = 1024 the tile count sets the waves
    ("_demo", 1024, 2816, 8, 4, 128, (8192,), 8192),
]


# the shapes whose layer norms q and k per head (Qwen3's QK-norm)
QK_NORM_TAGS = frozenset({"_qwen3"})


def _tags() -> list[str]:
    """The shape tags named in ``CODA_TUNE_SHAPES`` (none: every shape)."""
    return selected("CODA_TUNE_SHAPES", [s[0].lstrip("_") for s in SHAPES])


def layer_gemms():
    """(name, K, N, kernel(a, w, cfg), M) for the layer's GEMMs and the LM head."""
    out = []
    tags = _tags()
    for tag, d, f, H, Hkv, hd, vocabs, M in SHAPES:
        if tags and tag.lstrip("_") not in tags:
            continue
        r = torch.rand(M, device="cuda") + 0.5
        pos = (torch.arange(M, device="cuda") % 4096).float()
        freq = rp.rope_freq_table(hd, H + Hkv, Hkv, device="cuda")
        res = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        gamma = torch.ones(d, device="cuda", dtype=torch.bfloat16)
        # the QKV GEMM as the layer runs it: with QK-norm (Qwen3) the row scale alone, RoPE
        # after the head norms (``qk_norm``); without it, the deferred scale and RoPE in one
        # (operands bound as defaults: the sweep calls each kernel after the loop moved on)
        if tag in QK_NORM_TAGS:
            qkv_name = f"qkv_scale_rows{tag}"

            def qkv(a, w, c, r=r):
                return rg.gemm_scale_rows_kernel(a, w, r, c)
        else:
            qkv_name = f"qkv_rope{tag}"

            def qkv(a, w, c, r=r, pos=pos, freq=freq):
                return rp.gemm_rope_kernel(a, w, r, pos, freq, c)

        fwd = [
            (qkv_name, d, (H + 2 * Hkv) * hd, qkv),
            (
                f"o_proj{tag}",
                H * hd,
                d,
                lambda a, w, c, res=res, g=gamma: grr.epilogue_gemm(a, w, res, g, c),
            ),
            (
                f"gate_up_swiglu{tag}",
                d,
                2 * f,
                lambda a, w, c, r=r: sw.gemm_swiglu_kernel(a, w, r, True, c),
            ),
            (  # the layer's down projection: the residual add alone (its norm is the next
                # layer's entry norm, which computes its own statistic: ``residual_add``)
                f"down_proj{tag}",
                f,
                d,
                lambda a, w, c, res=res: grr.epilogue_gemm(a, w, res, None, c, stats=False),
            ),
        ]
        out += [(*g, M) for g in fwd]
        out += backward_gemms(tag, M, d, f, H * hd, Hkv * hd, r)
        for V in vocabs:
            t = torch.randint(0, V, (M,), device="cuda")
            out.append(
                (
                    f"lm_head_ce{tag}_V{V}",
                    d,
                    V,
                    lambda a, w, c, r=r, t=t: lce.lm_head_stats_kernel(a, w, r, t, c),
                    M,
                )
            )
    return out


def backward_gemms(tag, M, d, f, q_cols, kv_cols, r):
    """The backward's epilogue GEMMs at the layer's shapes (their operands built here: a
    kernel's own layouts, the sweep's (a, w) only set the raw GEMM's FLOPs beside it):
    B4 dSwiGLU (dx2 @ W_d^T), B6/B12 norm-backward dgrads (dz~ @ W^T with the residual
    gradient), B7/B13 gamma-row wgrads ((h^T dz~) scaled by gamma)."""

    def bf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    nqkv = q_cols + 2 * kv_cols
    dx2, w_d, u = bf(M, d), bf(f, d), bf(M, 2 * f)
    dz1, w_il, x1, g = bf(M, 2 * f), bf(d, 2 * f), bf(M, d), bf(d)
    dz0, w_qkv = bf(M, nqkv), bf(d, nqkv)
    corr = torch.randn(M, device="cuda")
    return [
        (f"dswiglu{tag}", d, f, lambda a, w, c: dsw.dswiglu_kernel(dx2, w_d, u, r, c), M),
        (
            f"norm_bwd_gate_up{tag}",
            2 * f,
            d,
            lambda a, w, c: nb.norm_bwd_kernel(dz1, w_il, x1, g, corr, dx2, c),
            M,
        ),
        (
            f"norm_bwd_qkv{tag}",
            nqkv,
            d,
            lambda a, w, c: nb.norm_bwd_kernel(dz0, w_qkv, x1, g, corr, dx2, c),
            M,
        ),
        # weight gradients: output (d, N), K = M tokens (the raw GEMM gets d rows)
        (f"wgrad_gate_up{tag}", M, 2 * f, lambda a, w, c: wg.wgrad_gamma_rows(x1, dz1, g, c), d),
        (f"wgrad_qkv{tag}", M, nqkv, lambda a, w, c: wg.wgrad_gamma_rows(x1, dz0, g, c), d),
    ]


def row_pass_rows(only) -> list[dict]:
    """B11's Triton passes (``coda.kernels.row_passes``) at each launch shape of
    ``LAUNCH_SHAPES``, at the swept layers' shapes and token counts: drope for every layer, the
    QK-norm pass too for head_dim 128 (Qwen3's), each beside its traffic time at 4.8 TB/s."""
    from coda.kernels import row_passes as rpk

    tags = _tags()
    rows = []
    for tag, d, _f, H, Hkv, hd, _v, M in SHAPES:
        if tags and tag.lstrip("_") not in tags:
            continue
        S = min(M, 4096)
        B = M // S
        nh, N = H + 2 * Hkv, (H + 2 * Hkv) * hd

        def bf(*s):
            return torch.randn(*s, device="cuda", dtype=torch.bfloat16)

        grads = bf(B, S, nh, hd).transpose(1, 2)  # attention's gradient layout
        dq, dk, dv = grads[:, :H], grads[:, H : H + Hkv], grads[:, H + Hkv :]
        rstd = torch.rand(M, device="cuda") + 0.5
        theta = torch.randn(M, hd // 2, device="cuda")
        cos, sin = theta.cos(), theta.sin()
        qkv, z = bf(M, N), bf(M, N)
        n_rot = (H + Hkv) * hd  # z kept on the q and k columns, v read from qkv
        z_even, z_odd = z[:, 0:n_rot:2].contiguous(), z[:, 1:n_rot:2].contiguous()
        s_head = torch.rand(M, H + Hkv, device="cuda") + 0.5
        qn, kn = bf(hd), bf(hd)
        drope_args = (dq, dk, dv, qkv, rstd, cos, sin, H + Hkv, hd, d)
        z_v = qkv[:, n_rot:]
        qk_args = (dq, dk, dv, z_even, z_odd, z_v, s_head, rstd, cos, sin, qn, kn, H, Hkv, hd, d)
        passes = {
            "drope": lambda sh: rpk.drope_heads_triton(*drope_args, shape=sh),
            "dqk_norm": lambda sh: rpk.dqk_norm_rope_heads_triton(*qk_args, shape=sh),
        }
        traffic = 3 * M * N * 2  # head gradients and the saved tensor in, dz~0 out (bf16)
        for name, fn in passes.items():
            if only and not any(f"row_pass_{name}".startswith(p) for p in only):
                continue
            for shape in rpk.LAUNCH_SHAPES:
                if out_of_time():
                    rows.append({"name": f"row_pass_{name}{tag}", **SKIPPED})
                    break
                t = bench(lambda fn=fn, shape=shape: fn(shape))
                rows.append(
                    {
                        "name": f"row_pass_{name}{tag}",
                        "M": M,
                        "N": N,
                        "head_dim": hd,
                        "rows_per_program": shape[0],
                        "warps": shape[1],
                        **t,
                        "traffic_ms": traffic / 4.8e12 * 1e3,
                        "default": shape == rpk.launch_shape(name, hd),
                    }
                )
    return rows


@functools.lru_cache(maxsize=None)
def _dw_final_program():
    """A probe for the LM head's last dW chunk deferred to the backward (NOTES.md, session 17's
    lead for issue 9): dW = g ((u (.) E')^T @ xs + C) written in the weight's bf16, C CE-S's
    fp32 accumulator of the other chunks loaded as a tile, in place of today's reduce-add
    GEMM and the cast pass after it. Not used by coda: whether a cooperative epilogue that
    loads a tile pays here is what ``ce_grad_dw_final`` measures first."""
    from coda.kernels.ce_scaled_exp import STRIP
    from coda.primitives import ColLoad, ScaleA, TileC, epilogue_program

    @epilogue_program(
        inputs=[TileC(), ColLoad("g")], a_transform=ScaleA("u", rows=STRIP, cols=1, tile_k=STRIP)
    )
    def scaled_grad_dw_final(acc, c, g):
        return {"D": (acc + c) * g}

    return scaled_grad_dw_final


def dw_probe(e, xs, u, acc, g, out, config, dry=False):
    """The probe: ``out`` (V, d) = g ((u (.) e)^T @ xs + acc), g a 0-dim tensor (as the
    backward receives it) spread over the rows here, as its share of the call; ``dry``: only
    compile (the compile count)."""
    from coda.kernels._launch import launch

    operands = {"u": u, "g": g.to(acc.dtype).expand(acc.shape[0]).contiguous()}
    program = _dw_final_program()
    compiled = launch(program, e.t(), xs, config=config, d=out, c=acc, operands=operands, dry=dry)
    return compiled if dry else out


def dw_current(cse, e, xs, u, acc, g, like):
    """Today's last chunk: the reduce-adding dW GEMM into ``acc`` (default config), then
    ``weight_grad_from_acc``'s cast with g; (V, d), ``like`` being a (V, d) weight's view."""
    from coda.kernels.linear_cross_entropy_bwd import weight_grad_from_acc

    cse.scaled_grad_dw_kernel(e, xs, u, acc, accumulate=True)
    return weight_grad_from_acc(acc.t(), g, like).t()


def dw_final_pair(cse, e, xs, u, acc, g, like, config):
    """(probe, current) from the same accumulator (which ``dw_current`` then holds). Either
    device: on the CPU both run through the tile interpreter (the probe program's CPU test)."""
    out = torch.empty(acc.shape, device=acc.device, dtype=like.dtype)
    return dw_probe(e, xs, u, acc, g, out, config), dw_current(cse, e, xs, u, acc, g, like)


def dw_final_rows(cse, e, xs, u, acc, shape) -> list[dict]:
    """``ce_grad_dw_final``: the probe at each config beside the path it would replace, and
    the largest difference between their bf16 results (each from the same accumulator)."""
    V, d = acc.shape
    g = torch.tensor(0.5, device=acc.device)
    like = torch.empty(V, d, device=acc.device, dtype=torch.bfloat16).t()  # a weight's view
    out = torch.empty(V, d, device=acc.device, dtype=torch.bfloat16)
    start = acc.clone()
    t_now = bench(lambda: dw_current(cse, e, xs, u, acc, g, like))["ms"]
    rows = []
    for cfg in cse.GRAD_CANDIDATES:
        if out_of_time():
            rows.append({"name": "ce_grad_dw_final", **SKIPPED})
            break
        try:
            t = bench(lambda cfg=cfg: dw_probe(e, xs, u, acc, g, out, cfg))["ms"]
            acc.copy_(start)
            mine, now = dw_final_pair(cse, e, xs, u, acc, g, like, cfg)
            diff = (mine.float() - now.float()).abs().max().item()
        except Exception as ex:  # a config quack rejects is recorded and skipped
            error = {"config": cfg.__dict__, "error": repr(ex)[:200]}
            rows.append({"name": "ce_grad_dw_final", **error})
            continue
        row = {"name": "ce_grad_dw_final", **shape, "config": cfg.__dict__, "kernel_ms": t}
        rows.append(progress({**row, "reduce_add_and_cast_ms": t_now, "max_abs_diff": diff}))
    return rows


# CE-S's gradient GEMMs, (d, V, token rows per chunk): the LM-head bench's d = 2048 call
# (one chunk), the 1B model's head, d = 4096 (chunks of 1 GiB of E)
CE_GRAD_SHAPES = ((2048, 32768, 16384), (2048, 128256, 4096), (4096, 128256, 4096))


def verdict(rounds: dict, entry) -> dict:
    """Whether a sweep's fastest tile should replace the table's entry: ``rounds`` maps each
    swept config to its kernel's round times (``interleaved``), ``entry`` is the config the
    table serves today. "enter" only where every round of the best beat every round of the
    entry (session 51's rule: a 1-3 % winner inside the rounds' spread swapped between runs);
    "keep" otherwise, and where the entry is the best; "unswept" where the entry was not
    among the candidates (no same-run comparison)."""
    best = min(rounds, key=lambda c: statistics.median(rounds[c]))
    out = {"best": best, "entry": entry}
    if entry not in rounds:
        return {**out, "advice": "unswept"}
    beyond = best != entry and max(rounds[best]) < min(rounds[entry])
    return {**out, "advice": "enter" if beyond else "keep"}


def kernel_timing(t: dict) -> dict:
    """A swept kernel's row fields from its ``interleaved`` timing: the median of the rounds,
    the rounds, their spread and the clock of the median round."""
    keep = {"kernel_ms": "ms", "rounds_ms": "rounds_ms", "spread": "spread", "sm_mhz": "sm_mhz"}
    return {field: t.get(key) for field, key in keep.items()}


def ce_grad_rows(only) -> list[dict]:
    """CE-S's dX and dW GEMMs (``ce_scaled_exp``: E through the A-operand transform) at each
    config of ``GRAD_CANDIDATES``, beside cuBLAS's plain GEMM of the same shape."""
    from coda.kernels import ce_scaled_exp as cse

    rows = []
    for d, V, C in CE_GRAD_SHAPES:
        bf = torch.bfloat16
        e = torch.rand(C, V, device="cuda", dtype=bf)
        w = torch.randn(d, V, device="cuda", dtype=bf) * d**-0.5
        u = torch.exp2(-torch.randint(0, 4, (V // cse.STRIP, C), device="cuda").float()).to(bf)
        c = torch.rand(C, device="cuda")
        xs = torch.randn(C, d, device="cuda", dtype=bf)
        g = torch.empty(C, d, device="cuda")
        dw_t = torch.zeros(V, d, device="cuda")
        gemms = {
            "ce_grad_dx": (
                lambda cfg: cse.scaled_grad_dx_kernel(e, w, u, c, xs, g, config=cfg),
                lambda: e @ w.t(),
            ),
            "ce_grad_dw": (
                lambda cfg: cse.scaled_grad_dw_kernel(e, xs, u, dw_t, True, config=cfg),
                lambda: e.t() @ xs,
            ),
        }
        for name, (kernel, cublas) in gemms.items():
            if only and not any(name.startswith(p) for p in only):
                continue
            if out_of_time():
                rows.append({"name": name, **SKIPPED})
                continue
            fns = {"cublas": cublas}
            for cfg in cse.GRAD_CANDIDATES:
                try:  # (compiled here, outside the timing)
                    kernel(cfg)
                except Exception as ex:  # a config quack rejects is recorded and skipped
                    rows.append({"name": name, "config": cfg.__dict__, "error": repr(ex)[:200]})
                    continue
                fns[cfg] = lambda cfg=cfg: kernel(cfg)
            timed = interleaved(fns)  # round-robin, as ``ce_logits_rows``
            default = cse.dx_config(d) if name == "ce_grad_dx" else cse.dw_config(d)
            for cfg in list(fns)[1:]:
                t = timed[cfg]
                row = {"name": name, "d": d, "V": V, "rows": C, "config": cfg.__dict__}
                row |= {**kernel_timing(t), "cublas_ms": timed["cublas"]["ms"]}
                rows.append({**row, "default": cfg == default})
        if not only or any("ce_grad_dw_final".startswith(p) for p in only):
            rows += dw_final_rows(cse, e, xs, u, dw_t, {"d": d, "V": V, "rows": C})
        e = w = u = xs = g = dw_t = None
    return rows


def ce_logits_lse(cse, a, w, r, t, cfg):
    """CE-S's GEMM1 at ``cfg`` and the lse its partials give (``lse_from_scaled``): what the
    program computes, whatever the tile (the sweep compares each tile's to the default's)."""
    from coda.kernels.ce_scaled_rows import lse_from_scaled

    _, sum_exp, k, _ = cse.scaled_exp_logits_kernel(a, w, r, t, cfg)
    return lse_from_scaled(sum_exp, k)


def ce_logits_rows(only) -> list[dict]:
    """CE-S's GEMM1 (``scaled_exp_logits``: E, its sums, the tile maxima, the target logit) at
    each config of ``LOGITS_CANDIDATES`` whose tile_n divides V, at the token chunk the
    driver runs, beside cuBLAS's plain GEMM and the default tile's (``scaled_exp_config`` of
    the tuned "lm_head" tile), with each lse's largest difference from the default's. The
    tiles are timed round-robin (``interleaved``: the median of its rounds, their spread and
    the clock): timed one after the other, the d = 4096 winner swapped between two runs
    (runs 214-215, 2-4 % either way), more than a tile's own spread."""
    from coda.kernels import ce_scaled_exp as cse

    rows = []
    for d, V, C in CE_GRAD_SHAPES:
        if out_of_time():
            rows.append({"name": "ce_logits", **SKIPPED})
            break
        a = torch.randn(C, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d, V, device="cuda", dtype=torch.bfloat16) * d**-0.5
        r = torch.rand(C, device="cuda") + 0.5
        t = torch.randint(0, V, (C,), device="cuda")
        default = cse.scaled_exp_config(V, tuned.config_for("lm_head", C, d, V))
        ref = ce_logits_lse(cse, a, w, r, t, default)
        shape = {"d": d, "V": V, "rows": C}
        fns, errs = {"cublas": lambda: a @ w}, {}
        for cfg in [c for c in cse.LOGITS_CANDIDATES if V % c.tile_n == 0]:
            try:
                errs[cfg] = float((ce_logits_lse(cse, a, w, r, t, cfg) - ref).abs().max())
            except Exception as ex:  # a config quack rejects is recorded and skipped
                rows.append({"name": "ce_logits", "config": cfg.__dict__, "error": repr(ex)[:200]})
                continue
            fns[cfg] = lambda cfg=cfg: cse.scaled_exp_logits_kernel(a, w, r, t, cfg)
        timed = interleaved(fns)
        for cfg, err in errs.items():
            row = {"name": "ce_logits", **shape, "config": cfg.__dict__}
            row |= {**kernel_timing(timed[cfg]), "cublas_ms": timed["cublas"]["ms"]}
            rows.append(progress({**row, "default": cfg == default, "lse_diff": err}))
        a = w = None
    return rows


# the sweep's GEMM names (by prefix) -> the kernel their ``tuned.TUNED`` entries are keyed by
KERNEL_OF = {
    "qkv_rope": "rope",
    "qkv_scale_rows": "scale_rows",
    "o_proj": "residual",
    "gate_up_swiglu": "swiglu",
    "down_proj": "residual",
    "dswiglu": "dswiglu",
    "norm_bwd": "norm_bwd",
    "wgrad": "wgrad",
    "lm_head_ce": "lm_head",
}


def tuned_kernel(name: str) -> str:
    """The ``tuned.KERNELS`` name a swept GEMM's winner is entered under."""
    return next(k for p, k in KERNEL_OF.items() if name.startswith(p))


def candidates(name: str, entry: GemmConfig, wide: bool = False) -> list[GemmConfig]:
    """The configs swept for the layer GEMM ``name``: ``CANDIDATES`` (with ``WIDE``, and
    split-K for a weight gradient), and the table's ``entry`` first when none of them is it,
    so that every sweep times what the table serves today beside its rivals (run 324 read
    "unswept" for four of eleven d = 2048 GEMMs, whose tuned tiles lay outside the list)."""
    pool = CANDIDATES + (WIDE if wide else []) + (SPLIT_K if name.startswith("wgrad") else [])
    return pool if entry in pool else [entry, *pool]


def run() -> list[dict]:
    only = [p for p in os.environ.get("CODA_TUNE_ONLY", "").split(",") if p]
    rows = row_pass_rows(only) if not only or any(p.startswith("row_pass") for p in only) else []
    if not only or any(p.startswith("ce_grad") for p in only):
        rows += ce_grad_rows(only)
    if not only or any(p.startswith("ce_logits") for p in only):
        rows += ce_logits_rows(only)
    raw = _quack.identity_mod()
    for name, K, N, kernel, m in layer_gemms():
        if only and not any(name.startswith(p) for p in only):
            continue
        if out_of_time():  # the suite's budget: what was swept stays in the record
            rows.append({"name": name, **SKIPPED})
            continue
        a = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) * K**-0.5
        out = torch.empty(m, N, device="cuda", dtype=torch.bfloat16)
        entry = tuned.config_for(tuned_kernel(name), m, K, N)
        fns, swept = {"cublas": lambda: a @ w}, []
        for cfg in candidates(name, entry, os.environ.get("CODA_TUNE_WIDE") == "1"):
            pair = {
                (cfg, "raw"): lambda cfg=cfg: _quack.run_epi_gemm(raw, a, w, out, None, {}, cfg),
                (cfg, "kernel"): lambda cfg=cfg: kernel(a, w, cfg),
            }
            try:  # (compiled here, outside the timing)
                for fn in pair.values():
                    fn()
            except Exception as e:  # a config quack rejects for this epilogue is skipped
                rows.append({"name": name, "config": cfg.__dict__, "error": repr(e)[:200]})
                continue
            fns |= pair
            swept.append(cfg)
        # round-robin (``interleaved``): timed in sequence, a tile meets the clock the one
        # before it left, and 2-4 % winners swapped between runs (runs 214-216, ``ce_logits``)
        timed = interleaved(fns)
        t_mm = timed["cublas"]["ms"]
        for cfg in swept:
            shape = {"name": name, "M": m, "K": K, "N": N, "config": cfg.__dict__}
            timing = {"raw_ms": timed[cfg, "raw"]["ms"], **kernel_timing(timed[cfg, "kernel"])}
            rows.append(progress({**shape, **timing, "cublas_ms": t_mm}))
        if swept:
            kernel_name = tuned_kernel(name)
            v = verdict({c: timed[c, "kernel"]["rounds_ms"] for c in swept}, entry)
            rows.append({"name": f"{name}/verdict", "advice": v["advice"],
                         "best": v["best"].__dict__, "entry": entry.__dict__})  # fmt: skip
            cfg, t_k = v["best"], timed[v["best"], "kernel"]["ms"]
            split = f", split_k={cfg.split_k}" if cfg.split_k > 1 else ""
            print(
                f"    {tuned.key(kernel_name, m, K, N)}: "
                f"GemmConfig({cfg.tile_m}, {cfg.tile_n}, {cfg.cluster_m}, "
                f"{cfg.cluster_n}, {cfg.pingpong}{split}),  # {name}: {v['advice']}; kernel "
                f"{t_k:.4f} ms, raw {timed[cfg, 'raw']['ms']:.4f}, cuBLAS {t_mm:.4f}",
                flush=True,
            )
    return rows


if __name__ == "__main__":  # python benchmarks/tune_configs.py [rows.json]
    import json
    import sys

    rows = run()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
