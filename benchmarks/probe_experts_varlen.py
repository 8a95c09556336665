"""Probe: do coda's epilogue programs compile on quack's grouped (varlen) mainloop, as a
mixture-of-experts layer's two expert GEMMs would run them? (session 83, NOTES.md: "Design,
not built: coda's own experts")

The (token, expert) slots sorted by expert make one varlen GEMM per projection: ``cu_seqlens_m``
(E + 1 int32 offsets) splits the slot rows into experts, each multiplying its own (K, N) slice
of a (E, K, N) weight. Three GEMMs are compiled for sm_90a at a small shape, no GPU needed:

- gate/up: F4's program (the row scale, SwiGLU, the pre-activations stored) over the token
  rows gathered by slot (``A_idx``), the row scale one per slot, rank-1 under varlen;
- down: ``scale_rows`` (z = s (acc)), the routing weight as each slot's row scale;
- the down projection's dgrad with B4's dSwiGLU program (the pre-activations read as the C
  operand, the gate/up gradient and h's recompute stored, the statistic's partials), over
  the output gradient's token rows gathered by slot.

Each prints the number of kernel compiles it did (``_quack.count_compiles``, which accepts
the driver's refusal of quack's occupancy query after the compile on a GPU-less machine).

    CUTE_DSL_ARCH=sm_90a QUACK_ARCH=90 python benchmarks/probe_experts_varlen.py
"""

from __future__ import annotations

import torch

E, TOKENS, SLOTS, D, F = 4, 512, 1024, 256, 128  # experts, tokens, slots (top-2), widths


def compile_varlen(program, a, w, d, operands, outputs, a_idx=None, c=None) -> int:
    """Compiles ``program`` on quack's varlen GEMM (``a`` rows gathered by ``a_idx`` where
    given; ``c`` the C operand) for every expert's (K, N) slice of ``w`` (E, K, N); returns
    the compiles done."""
    from coda import _quack
    from coda.kernels._launch import epi_args
    from coda.primitives.lowering import lower

    cu_seqlens = torch.arange(0, SLOTS + 1, SLOTS // E, dtype=torch.int32)
    return _quack.count_compiles(
        lambda: lower(program).gemm(
            a,
            w,
            d,
            c,
            epi_args=epi_args(program, operands, outputs),
            b_kn=True,
            tile_M=128,
            tile_N=128,
            cluster_M=1,
            cluster_N=1,
            persistent=True,
            cu_seqlens_m=cu_seqlens,
            A_idx=a_idx,
            _launch=False,
        )
    )


def compile_expert_gemms() -> dict:
    """{GEMM: compiles done} for the expert GEMMs at the probe's shape."""
    from coda.kernels import dswiglu
    from coda.kernels.config import GemmConfig
    from coda.kernels.gemm_rmsnorm_gemm import scale_rows
    from coda.kernels.gemm_swiglu import program_for

    bf = torch.bfloat16
    tile_n = GemmConfig(tile_m=128, tile_n=128).grid(SLOTS, F)[1]
    x = torch.empty(TOKENS, D, dtype=bf)
    slot_token = torch.zeros(SLOTS, dtype=torch.int32)
    u = torch.empty(SLOTS, 2 * F, dtype=bf)
    h = torch.empty(SLOTS, F, dtype=bf)
    return {
        "gate/up + SwiGLU, gathered varlen": compile_varlen(
            program_for(True, "silu"),
            x,
            torch.empty(E, D, 2 * F, dtype=bf),
            u,
            {"rstd": torch.empty(SLOTS)},
            {"s": h},
            a_idx=slot_token,
        ),
        "down + routing-weight row scale, varlen": compile_varlen(
            scale_rows,
            h,
            torch.empty(E, F, D, dtype=bf),
            torch.empty(SLOTS, D, dtype=bf),
            {"scale": torch.empty(SLOTS)},
            {},
        ),
        "down dgrad + dSwiGLU, gathered varlen": compile_varlen(
            dswiglu.program_for("silu"),
            x,
            torch.empty(E, D, F, dtype=bf),
            torch.empty_like(u),
            {"rstd": torch.empty(SLOTS)},
            {"s": torch.empty_like(h), "stat": torch.empty(SLOTS, tile_n)},
            a_idx=slot_token,
            c=u,
        ),
    }


def main() -> None:
    for name, compiles in compile_expert_gemms().items():
        print(f"{name}: {compiles} compile(s)")


if __name__ == "__main__":
    main()
