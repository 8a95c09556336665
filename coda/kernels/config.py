"""GEMM tile configurations: plain frozen values, so they can be compile keys and records.

The mainloop is quack's SM90 GEMM; which tile shape, cluster and schedule it runs with is ours.
``DEFAULT`` is quack 0.6.5's SM90 default (128 x 192 tile, 2 x 1 cluster, ping-pong: two
consumer warpgroups alternate, so one's epilogue runs under the other's mainloop).

``split_k`` > 1 is Cleave's Split operator with its combine: the K loop of every output tile
is cut into that many parts run by different CTAs, each commits fp32 partials, and the last
one sums them in split order and runs the epilogue once (quack's SERIAL mode: bitwise
deterministic). For GEMMs whose K is much larger than M and N (weight gradients over many
tokens), where the output has too few tiles to fill the GPU. The tile interpreter ignores it:
the sum is the same, up to fp32 reassociation.
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
    split_k: int = 1

    def __post_init__(self):
        if self.tile_m not in (64, 128, 192, 256):
            raise ValueError(f"tile_m must be 64, 128, 192 or 256, got {self.tile_m}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        if not 1 <= self.split_k <= 16:
            raise ValueError(f"split_k must be in [1, 16], got {self.split_k}")

    def grid(self, m: int, n: int) -> tuple[int, int]:
        """(T_M, T_N): output tiles along M and N, ragged last tiles included."""
        return -(-m // self.tile_m), -(-n // self.tile_n)


DEFAULT = GemmConfig()
