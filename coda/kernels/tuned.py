"""Tile configurations chosen per GEMM shape, measured once on an H200 and recorded.

The mainloop is quack's; which tile shape, cluster and schedule it runs is ours to pick. Each
entry maps a (K, N) GEMM shape of the Llama layer (M = 16384 tokens) to the config whose coda
epilogue kernel ran fastest in ``benchmarks/tune_configs.py``; other shapes use ``DEFAULT``.
Record: benchmarks/results/ (the "tuning" section of the record named in ``SOURCE``).
"""

from __future__ import annotations

from coda.kernels.config import DEFAULT, GemmConfig

SOURCE = (
    "benchmarks/results/2026-11-29_h200_tuning.json (commit 3bd391b); "
    "2026-11-30_h200_run11.json tuning_winners (commit 162ba43: dSwiGLU); "
    "2026-11-30_h200_run20.json (commit 48a17cc: the 1B-shaped layer)"
)
_PP, _COOP = True, False
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


def config_for(m: int, k: int, n: int) -> GemmConfig:
    """The tuned config for a (K, N) GEMM, else quack's SM90 default. M does not change the
    choice: every tuned shape has M >= 16384 tokens."""
    return TUNED.get((k, n), DEFAULT)
