"""Launch an epilogue program on quack's SM90 GEMM, or only compile it (``dry=True``), or
run it through the tile interpreter on the CPU (``interpret_gemm``).

Every kernel builds its buffers and calls ``launch``; the compile tests call the same kernel
function on small CPU tensors with ``dry=True``, so what CI compiles is exactly what runs."""

from __future__ import annotations

import functools

from coda import _quack
from coda.kernels.config import GemmConfig
from coda.primitives.lowering import epi_args, lower


def launch(
    program,
    x,
    w,
    *,
    config: GemmConfig,
    d=None,
    c=None,
    operands=None,
    outputs=None,
    dry: bool = False,
    add_to_output: bool = False,
):
    """acc = x @ w (x (M, K) either major, w (K, N) either major); run ``program`` on it.
    ``add_to_output``: D += the program's D (TMA reduce-add store; no C operand).
    Returns the number of compiles done when ``dry`` (0 on a jit-cache hit), else None."""
    args = epi_args(program, operands or {}, outputs or {})
    if dry:
        return _quack.compile_only(lower(program), x, w, d, c, args, config, add_to_output)
    _quack.run_epi_gemm(lower(program), x, w, d, c, args, config, add_to_output=add_to_output)
    return None


def interpret_gemm(program, x, w, *, config: GemmConfig, operands=None, out_dtype=None):
    """The CPU twin of ``launch``: acc = x @ w in float64 for float64 inputs (algebra proofs),
    else float32 (as the kernel's accumulator), then ``program`` through the tile interpreter
    on ``config``'s tile grid. Returns every output the program declares."""
    import torch

    from coda.primitives.interpreter import interpret

    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    return interpret(
        program,
        x.to(dt) @ w.to(dt),
        operands or {},
        tile_m=config.tile_m,
        tile_n=config.tile_n,
        out_dtype=out_dtype,
    )


def example_operands(m: int, k: int, n: int, w_major: str = "n", dtype=None):
    """Small CPU bf16 x (m, k) and w (k, n) with w n-major or k-major, for dry compiles."""
    import torch

    dtype = dtype or torch.bfloat16
    x = torch.empty(m, k, dtype=dtype)
    w = torch.empty(k, n, dtype=dtype) if w_major == "n" else torch.empty(n, k, dtype=dtype).t()
    return x, w


@functools.cache
def fused(fn):
    """A row kernel (F0, B11, the final-norm apply, CE-C's softmax gradient) compiled by
    torch.compile: its elementwise ops and row reductions become one or two Triton kernels
    instead of one pass over memory per torch op."""
    import torch

    return torch.compile(fn, dynamic=True)
