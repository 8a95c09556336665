"""What coda's hand-written Triton kernels (``row_passes``, ``target_terms``) share: where they
run, their jit wrapper, their accumulator type, and their compile for sm_90 without a GPU.

They run on CUDA tensors, and on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``
set before triton is imported: how CI tests them); elsewhere their callers take the torch
form of the same pass.
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl


@functools.cache
def interpreted() -> bool:
    """True in Triton's interpreter mode (fixed when triton is imported, so read once)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_triton(t: torch.Tensor) -> bool:
    """Whether a pass over ``t`` runs its Triton kernel (else its torch form)."""
    return t.is_cuda or interpreted()


@functools.cache
def kernel(fn):
    """``fn`` (a plain function written in ``triton.language``) as a Triton kernel: compiled
    for the GPU, or interpreted, by the mode triton was imported in."""
    return triton.jit(fn)


def acc_type(t: torch.Tensor):
    """The kernels' accumulator type for inputs like ``t``: fp32, or fp64 for float64 (the
    CPU proofs), as ``_launch.acc_dtype``."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def compile_sm90(fn, pointers: dict, consts: dict, num_warps: int = 4, arch: int = 90) -> int:
    """Compile ``fn`` for ``sm_{arch}`` without a GPU (Triton ships ptxas): the CPU compile
    test. ``pointers``: each pointer argument's Triton type ("*bf16", ...); ``consts``: the
    constexpr arguments; every other argument is an i32. Returns the cubin's size in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        name: "constexpr" if name in consts else pointers.get(name, "i32")
        for name in inspect.signature(fn).parameters
    }
    src = ASTSource(fn=triton.jit(fn), signature=sig, constexprs=consts)
    target = GPUTarget("cuda", arch, 32)
    return len(triton.compile(src, target=target, options={"num_warps": num_warps}).asm["cubin"])
