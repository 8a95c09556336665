"""coda: Transformer training ops as GEMM-epilogue programs on Hopper.

Every memory-bound op around a matmul (RMSNorm, residual adds, SwiGLU, RoPE, cross-entropy,
and their backward) runs in the epilogue of quack's SM90 GEMM while the output tile is still
on chip, plus small auxiliary reductions over per-tile partials. On the CPU and non-SM90 GPUs
the same calls run pure-torch references (``coda.env`` says which path ran and why).

Layers, bottom up (imports only go down; ``tests/test_layering.py``): ``coda.reference`` and
``coda.primitives`` -> ``coda.kernels`` -> ``coda.ops``, ``coda.layouts`` and ``coda.autograd``
-> ``coda.nn`` (the training modules) -> ``coda.transformers`` (``apply_coda`` for HF models).
"""

from coda._quack import UnpinnedStackError  # noqa: F401
from coda._validate import CodaInputError  # noqa: F401
from coda.env import CodaReferencePathWarning, UnsupportedDeviceError, last_path  # noqa: F401
from coda.ops import (  # noqa: F401
    ResidualRMS,
    RMSNormGemm,
    SwiGLU,
    gemm_residual_rms,
    gemm_rmsnorm_gemm,
    gemm_rope,
    gemm_swiglu,
    linear_cross_entropy,
)

__version__ = "0.1.0"
