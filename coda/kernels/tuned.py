"""Tile configurations chosen per GEMM shape, measured once on an H200 and recorded.

The mainloop is quack's; which tile shape, cluster and schedule it runs is ours to pick. Each
entry maps a (K, N) GEMM shape of a Llama-style layer to the config whose coda epilogue kernel
ran fastest in ``benchmarks/tune_configs.py`` (M = 16384 tokens; the d = 1024 demo model's at
its own 8192); other shapes use ``DEFAULT``, dSwiGLU its own ``DSWIGLU`` (below).
Record: benchmarks/results/ (the "tuning" section of the record named in ``SOURCE``).
"""

from __future__ import annotations

from coda.kernels.config import DEFAULT, GemmConfig

SOURCE = (
    "benchmarks/results/2026-11-29_h200_tuning.json (commit 3bd391b); "
    "2026-11-30_h200_run11.json tuning_winners (commit 162ba43: dSwiGLU); "
    "2026-11-30_h200_run20.json (commit 48a17cc: the 1B-shaped layer); "
    "2026-12-01_h200_run32.json (commit 1c0a545: Qwen3-0.6B's layer, the d=1024 demo model's)"
)
_PP, _COOP = True, False
# dSwiGLU (B4) off the table: its "widen" epilogue (a 2 x tile_n tile of u in, of dz~ out)
# runs 1.9-2.1x slower on quack's 128 x 192 default than on 128 x 128 tiles at every shape
# swept (Qwen3 0.516 -> 0.269 ms, the demo 0.266 -> 0.128 ms; run 32), and 128 x 128 won at
# d = 2048 and the 1B shape too (run 11)
DSWIGLU = GemmConfig(128, 128, 2, 1, _PP)
TUNED: dict[tuple[int, int], GemmConfig] = {
    # d = 2048 (16/8 heads, f = 5632)
    (2048, 4096): GemmConfig(128, 192, 1, 2, _PP),  # QKV + RoPE
    (2048, 2048): GemmConfig(128, 192, 2, 1, _PP),  # O proj + residual + norm partials
    (2048, 11264): GemmConfig(128, 128, 2, 1, _PP),  # gate/up + SwiGLU
    (5632, 2048): GemmConfig(128, 192, 2, 1, _PP),  # down proj + residual + norm partials
    (2048, 32768): GemmConfig(128, 192, 2, 1, _PP),  # LM head + CE
    (2048, 128256): GemmConfig(128, 192, 2, 1, _PP),
    # backward: B4 dSwiGLU (dx2 @ W_d^T + dSwiGLU), K = d, N = ffn; the sweep's winner, 0.724
    # ms at d = 2048, ffn 5632 (layer bench; cuBLAS 0.583 in that run) and 1.137 ms at ffn 8192 (1B)
    (2048, 5632): GemmConfig(128, 128, 2, 1, _PP),
    (2048, 8192): GemmConfig(128, 128, 2, 1, _PP),
    # the Llama-3.2-1B-shaped layer (d = 2048, 32/8 heads of 64, f = 8192; run 20: each winner
    # 1-3 % under the default config; down proj and the gate/up norm-backward keep the default)
    (2048, 3072): GemmConfig(128, 192, 1, 2, _PP),  # QKV + RoPE
    (2048, 16384): GemmConfig(128, 192, 1, 2, _PP),  # gate/up + SwiGLU
    (3072, 2048): GemmConfig(128, 128, 2, 1, _PP),  # QKV norm-backward dgrad (B12)
    (16384, 16384): GemmConfig(256, 128, 2, 1, _COOP),  # gate/up gamma-row wgrad, K = tokens
    (16384, 3072): GemmConfig(256, 192, 2, 1, _COOP),  # QKV gamma-row wgrad, K = tokens
    # Qwen3-0.6B's layer (d = 1024, 16/8 heads of 128, f = 3072; run 32: N = d = 1024 outputs
    # leave the 192-wide default a ragged sixth column tile, 128 divides them)
    (2048, 1024): GemmConfig(128, 128, 2, 1, _PP),  # O proj (and the demo's QKV norm-bwd)
    (3072, 1024): GemmConfig(128, 128, 2, 1, _PP),  # down proj
    (1024, 6144): GemmConfig(128, 192, 1, 2, _PP),  # gate/up + SwiGLU
    (6144, 1024): GemmConfig(128, 128, 2, 1, _PP),  # gate/up norm-backward dgrad (B6)
    (4096, 1024): GemmConfig(128, 128, 2, 1, _PP),  # QKV norm-backward dgrad (B12)
    (16384, 6144): GemmConfig(256, 192, 2, 1, _COOP),  # gate/up gamma-row wgrad
    (16384, 4096): GemmConfig(256, 128, 2, 1, _COOP),  # QKV gamma-row wgrad (1.28x)
    # the d = 1024 demo model's (8/4 heads of 128, f = 2816, M = 8192 tokens; run 32)
    (1024, 2048): GemmConfig(128, 128, 2, 1, _PP),  # QKV + RoPE
    (1024, 1024): GemmConfig(128, 128, 2, 1, _PP),  # O proj
    (1024, 5632): GemmConfig(128, 192, 1, 2, _PP),  # gate/up + SwiGLU
    (2816, 1024): GemmConfig(128, 128, 2, 1, _PP),  # down proj
    (5632, 1024): GemmConfig(128, 128, 2, 1, _PP),  # gate/up norm-backward dgrad (B6)
    (8192, 5632): GemmConfig(256, 192, 2, 1, _COOP),  # gate/up gamma-row wgrad
    (8192, 2048): GemmConfig(128, 128, 2, 1, _PP),  # QKV gamma-row wgrad (1.30x)
    # d = 4096 (32/8 heads, f = 11008)
    (4096, 6144): GemmConfig(128, 192, 2, 1, _PP),
    (4096, 4096): GemmConfig(128, 192, 1, 2, _PP),
    (4096, 22016): GemmConfig(128, 192, 2, 1, _PP),
    (11008, 4096): GemmConfig(128, 192, 1, 2, _PP),
    (4096, 32768): GemmConfig(128, 192, 2, 1, _PP),
    (4096, 128256): GemmConfig(128, 192, 2, 1, _PP),
    # d = 8192 (64/8 heads, f = 22016)
    (8192, 10240): GemmConfig(128, 192, 1, 2, _PP),
    (8192, 8192): GemmConfig(128, 192, 2, 1, _PP),
    (8192, 44032): GemmConfig(256, 192, 2, 1, _COOP),
    (22016, 8192): GemmConfig(128, 192, 2, 1, _PP),
    (8192, 32768): GemmConfig(128, 192, 2, 1, _PP),
    (8192, 128256): GemmConfig(256, 192, 2, 1, _COOP),
}


def config_for(m: int, k: int, n: int, default: GemmConfig = DEFAULT) -> GemmConfig:
    """The tuned config for a (K, N) GEMM, else ``default`` (quack's SM90 default unless the
    kernel has its own). M does not change the choice: every tuned shape has M >= 8192."""
    return TUNED.get((k, n), default)
