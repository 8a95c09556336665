"""Tile configurations chosen per GEMM shape, measured once on an H200 and recorded.

The mainloop is quack's; which tile shape, cluster and schedule it runs is ours to pick. Each
entry maps a (K, N) GEMM shape of the Llama layer (M = 16384 tokens) to the config whose coda
epilogue kernel ran fastest in ``benchmarks/tune_configs.py``; other shapes use ``DEFAULT``.
Record: benchmarks/results/ (the "tuning" section of the record named in ``SOURCE``).
"""

from __future__ import annotations

from coda.kernels.config import DEFAULT, GemmConfig

SOURCE = "untuned"
TUNED: dict[tuple[int, int], GemmConfig] = {}


def config_for(m: int, k: int, n: int) -> GemmConfig:
    """The tuned config for a (K, N) GEMM, else quack's SM90 default. M does not change the
    choice: every tuned shape has M >= 16384 tokens."""
    return TUNED.get((k, n), DEFAULT)
