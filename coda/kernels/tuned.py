"""Tile configurations chosen per kernel and GEMM shape, measured once on an H200 and recorded.

The mainloop is quack's; which tile shape, cluster and schedule it runs is ours to pick. Each
entry maps a kernel and the two GEMM dimensions that do not grow with the token count to the
config whose coda epilogue kernel ran fastest at that shape in ``benchmarks/tune_configs.py``
(at 16384 tokens; the d = 1024 demo model's at its own 8192): (kernel, K, N) where the tokens
are M, (kernel, M, N) = (kernel, d, N) for the weight gradient, whose K they are (``key``). So
one entry serves every token count, and two layers whose GEMMs differ only in d keep their
own tiles (Qwen3-0.6B's and the d = 2048 layer's QKV weight gradients are both 4096 wide). The
kernel is part of the key because the best tile belongs to the epilogue as much as to the
shape: dSwiGLU's "widen" epilogue runs 2x slower on the tile a plain GEMM of its shape
prefers, and two kernels can meet at one pair (keyed by tokens, the d = 1024 demo's QKV weight
gradient met the 1B layer's down projection at (8192, 2048)). A key without an entry runs the
kernel's own default (``DEFAULTS``), else quack's SM90 default.
Record: benchmarks/results/ (the "tuning" section of the records named in ``SOURCE``).
"""

from __future__ import annotations

from coda.kernels.config import DEFAULT, GemmConfig

SOURCE = (
    "benchmarks/results/2026-11-29_h200_tuning.json (commit 3bd391b); "
    "2026-11-30_h200_run11.json tuning_winners (commit 162ba43: dSwiGLU); "
    "2026-11-30_h200_run20.json (commit 48a17cc: the 1B-shaped layer); "
    "2026-12-01_h200_run32.json (commit 1c0a545: Qwen3-0.6B's layer, the d=1024 demo model's); "
    "2026-12-01_h200_run37.json (commit 94c79f8: the d=4096 layer's backward); "
    "2026-12-01_h200_run38.json (commit b2587ea: the d=2048 layer's backward); "
    "2026-12-04_h200_run219.json (commit 79aa222: the down projections, round-robin); "
    "2026-12-04_h200_run221.json and run222 (commit 94a4bdb: the 1B-shaped and d=2048 layers); "
    "2026-12-04_h200_run228.json and run229 (commit 9299c03: Qwen3-0.6B's and the demo's layers); "
    "2026-12-04_h200_run230.json (commit e6711ff: Qwen3-0.6B's QKV row-scale GEMM)"
)

# The epilogue kernels a GEMM runs, by the name a lookup gives (``config_for``'s ``kernel``).
KERNELS = (
    "rope",  # F1: QKV + deferred row scale + RoPE (gemm_rope)
    "scale_rows",  # the deferred row scale only (QK-norm's F1, gemm_rmsnorm_gemm's GEMM2)
    "residual",  # O / down projection + residual (+ norm partials): gemm_residual(_rms)
    "swiglu",  # F4: gate/up + row scale + SwiGLU
    "dswiglu",  # B4: the down projection's dgrad + dSwiGLU
    "norm_bwd",  # B6 / B12: the norm-backward dgrad (+ residual gradient)
    "wgrad",  # B7 / B13: the gamma-row weight gradient (K = tokens)
    "lm_head",  # the LM head's logits GEMM with the CE statistics
    "passthrough",  # a plain GEMM (CE-C's per-chunk gradient GEMMs)
)

_PP, _COOP = True, False
# dSwiGLU's "widen" epilogue (a 2 x tile_n tile of u in, of dz~ out) runs 1.3-2.1x slower on
# quack's 128 x 192 default than on 128 x 128 tiles at every shape swept (Qwen3 0.516 -> 0.269
# ms, the demo 0.266 -> 0.128 ms: run 32; d = 4096 3.118 -> 2.434: run 37), and 128 x 128 won at
# d = 2048 and the 1B shape too (run 11)
DSWIGLU = GemmConfig(128, 128, 2, 1, _PP)
DEFAULTS: dict[str, GemmConfig] = {"dswiglu": DSWIGLU}

TUNED: dict[tuple[str, int, int], GemmConfig] = {
    # d = 2048 (16/8 heads of 128, f = 5632; forward swept 2026-11-29, backward in run 38)
    ("rope", 2048, 4096): GemmConfig(128, 192, 1, 2, _PP),
    ("residual", 2048, 2048): GemmConfig(128, 192, 2, 1, _PP),  # O proj (the 1B's too)
    # (gate/up + SwiGLU at 2048 x 11264: quack's default, 1.128 vs 1.145 ms on run 38's 1 x 2
    # cluster, round-robin in run 222; run 38 had read 1.120 against 1.168 in sequence)
    # down proj, the residual add alone (run 219, round-robin: 0.565 vs 0.587 ms, every round
    # under the old tile's; runs 38-218 swept it with the O projection's heavier epilogue)
    ("residual", 5632, 2048): GemmConfig(128, 256, 2, 1, _COOP),
    ("lm_head", 2048, 32768): GemmConfig(128, 192, 2, 1, _PP),
    ("lm_head", 2048, 128256): GemmConfig(128, 192, 2, 1, _PP),
    ("wgrad", 2048, 4096): GemmConfig(128, 256, 2, 1, _COOP),  # QKV: 0.384 vs 0.398 (run 222)
    ("wgrad", 2048, 11264): GemmConfig(256, 192, 2, 1, _COOP),  # gate/up (run 38: -6 %)
    # round-robin in run 222, each beyond the three rounds' spread of the tile it replaced
    ("dswiglu", 2048, 5632): GemmConfig(128, 128, 1, 2, _PP),  # 0.709 vs 0.723 ms
    ("norm_bwd", 4096, 2048): GemmConfig(128, 128, 1, 2, _PP),  # QKV (B12): 0.443 vs 0.451
    # the Llama-3.2-1B-shaped layer (d = 2048, 32/8 heads of 64, f = 8192; run 20: each winner
    # 1-3 % under the default config; the gate/up norm-backward keeps the default). Two tiles
    # chosen inside the patched HF step at the power cap (run 111, benchmarks/
    # probe_gemm_in_step.py): 3 % faster per call than the alone sweep's pick in that run, at
    # the edge of run-to-run spread (the old tiles read 786 and 1600 us in run 110)
    ("residual", 8192, 2048): GemmConfig(128, 256, 1, 2, _COOP),  # down proj: 785 vs 809 us
    ("wgrad", 2048, 16384): GemmConfig(128, 256, 2, 1, _COOP),  # gate/up: 1561 vs 1613 us
    ("rope", 2048, 3072): GemmConfig(128, 192, 1, 2, _PP),
    ("swiglu", 2048, 16384): GemmConfig(128, 192, 1, 2, _PP),
    ("norm_bwd", 3072, 2048): GemmConfig(128, 128, 1, 2, _PP),  # QKV (B12; run 221: -2.9 %)
    ("wgrad", 2048, 3072): GemmConfig(256, 192, 2, 1, _COOP),  # QKV
    # Qwen3-0.6B's layer (d = 1024, 16/8 heads of 128, f = 3072; run 32: N = d = 1024 outputs
    # leave the 192-wide default a ragged sixth column tile, 128 divides them)
    ("residual", 2048, 1024): GemmConfig(128, 128, 1, 2, _PP),  # O proj (run 228: -2 %)
    ("residual", 3072, 1024): GemmConfig(128, 128, 2, 1, _PP),  # down proj
    # QKV with QK-norm: the row scale alone (run 230, round-robin: 0.203 vs 0.209 ms, every
    # round under quack's default 2 x 1 cluster)
    ("scale_rows", 1024, 4096): GemmConfig(128, 192, 1, 2, _PP),
    ("swiglu", 1024, 6144): GemmConfig(128, 192, 1, 2, _PP),
    ("norm_bwd", 6144, 1024): GemmConfig(128, 128, 2, 1, _PP),  # gate/up (B6)
    ("norm_bwd", 4096, 1024): GemmConfig(128, 128, 1, 2, _PP),  # QKV (B12; run 228: -2.7 %)
    ("wgrad", 1024, 6144): GemmConfig(256, 192, 2, 1, _COOP),  # gate/up
    ("wgrad", 1024, 4096): GemmConfig(256, 128, 2, 1, _COOP),  # QKV (1.28x)
    # the d = 1024 demo model's (8/4 heads of 128, f = 2816, M = 8192 tokens; run 32)
    # (the 1 x 2 cluster of each 128 x 128 tile: round-robin in run 229, every round under)
    ("rope", 1024, 2048): GemmConfig(128, 128, 1, 2, _PP),  # 0.054 vs 0.055 ms
    ("residual", 1024, 1024): GemmConfig(128, 128, 1, 2, _PP),  # O proj: 0.035 vs 0.036
    ("swiglu", 1024, 5632): GemmConfig(128, 192, 1, 2, _PP),
    ("residual", 2816, 1024): GemmConfig(128, 128, 1, 2, _PP),  # down proj: 0.070 vs 0.073
    ("dswiglu", 1024, 2816): GemmConfig(128, 128, 1, 2, _PP),  # 0.123 vs 0.124
    ("norm_bwd", 5632, 1024): GemmConfig(128, 128, 1, 2, _PP),  # gate/up (B6): 0.149 vs 0.153
    ("norm_bwd", 2048, 1024): GemmConfig(128, 128, 2, 1, _PP),  # QKV (B12)
    ("wgrad", 1024, 5632): GemmConfig(256, 192, 2, 1, _COOP),  # gate/up
    ("wgrad", 1024, 2048): GemmConfig(128, 128, 2, 1, _PP),  # QKV (1.30x)
    # d = 4096 (32/8 heads of 128, f = 11008; the backward swept in run 37: the gate/up wgrad
    # 4.19 -> 3.97 ms, under cuBLAS's 4.15; every other backward GEMM within 1.5 % of default)
    ("rope", 4096, 6144): GemmConfig(128, 192, 2, 1, _PP),
    ("residual", 4096, 4096): GemmConfig(128, 192, 1, 2, _PP),  # O proj
    ("swiglu", 4096, 22016): GemmConfig(128, 192, 2, 1, _PP),
    # down proj, the residual add alone (run 219: 2.193 vs 2.226 ms, every round under)
    ("residual", 11008, 4096): GemmConfig(128, 256, 2, 1, _COOP),
    ("wgrad", 4096, 22016): GemmConfig(256, 192, 2, 1, _COOP),  # gate/up
    # QKV: the tile it ran on while the key held tokens, not d (Qwen3's gate/up entry)
    ("wgrad", 4096, 6144): GemmConfig(256, 192, 2, 1, _COOP),
    ("lm_head", 4096, 32768): GemmConfig(128, 192, 2, 1, _PP),
    ("lm_head", 4096, 128256): GemmConfig(128, 192, 2, 1, _PP),
    # d = 8192 (64/8 heads of 128, f = 22016)
    ("rope", 8192, 10240): GemmConfig(128, 192, 1, 2, _PP),
    ("residual", 8192, 8192): GemmConfig(128, 192, 2, 1, _PP),
    ("swiglu", 8192, 44032): GemmConfig(256, 192, 2, 1, _COOP),
    ("residual", 22016, 8192): GemmConfig(128, 192, 2, 1, _PP),
    ("lm_head", 8192, 32768): GemmConfig(128, 192, 2, 1, _PP),
    ("lm_head", 8192, 128256): GemmConfig(256, 192, 2, 1, _COOP),
}


# kernels whose K is the token count (the weight gradients): keyed by (M, N) instead of (K, N)
TOKENS_IN_K = frozenset({"wgrad"})


def key(kernel: str, m: int, k: int, n: int) -> tuple[str, int, int]:
    """``TUNED``'s key for ``kernel``'s (M, K, N) GEMM: the kernel and the two dimensions that
    do not grow with the token count."""
    return (kernel, m if kernel in TOKENS_IN_K else k, n)


def config_for(kernel: str, m: int, k: int, n: int) -> GemmConfig:
    """The tuned config of ``kernel`` for an (M, K, N) GEMM, else the kernel's default; the
    token count (M, or K for a weight gradient) does not change the choice."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: must be one of {KERNELS}, got {kernel!r}")
    return TUNED.get(key(kernel, m, k, n)) or DEFAULTS.get(kernel, DEFAULT)
