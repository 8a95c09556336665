"""GEMM tile configurations: plain frozen values, so they can be compile keys and records.

The mainloop is quack's SM90 GEMM; which tile shape, cluster and schedule it runs with is ours.
``DEFAULT`` is quack 0.6.5's SM90 default (128 x 192 tile, 2 x 1 cluster, ping-pong: two
consumer warpgroups alternate, so one's epilogue runs under the other's mainloop).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmConfig:
    tile_m: int = 128
    tile_n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True
    max_swizzle_size: int = 8

    def __post_init__(self):
        if self.tile_m not in (64, 128, 192, 256):
            raise ValueError(f"tile_m must be 64, 128, 192 or 256, got {self.tile_m}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")

    def grid(self, m: int, n: int) -> tuple[int, int]:
        """(T_M, T_N): output tiles along M and N, ragged last tiles included."""
        return -(-m // self.tile_m), -(-n // self.tile_n)


DEFAULT = GemmConfig()
