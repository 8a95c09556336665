"""The range rule of a loss's targets, checked without a host sync: every target in
[0, vocab) or equal to ``ignore_index``.

On CUDA tensors it is one Triton launch whose programs each check a block of targets and stop
the kernel with a device-side assertion where one breaks the rule, so the next synchronizing
call raises ("coda: target out of range", as PyTorch's cross-entropy does with its own); the
torch form of the same rule (``target_rule_torch``: five elementwise kernels, a reduction and
``torch._assert_async``) costs eight launches, ~20 us of GPU time and ~0.1 ms of host time
an LM-head call (benchmarks/NOTES.md, session 43). On the CPU the rule is checked on the
host and names the first bad value (``CodaInputError``); under a torch.compile trace the
torch form is traced (Inductor fuses it). Triton's interpreter compiles no assertions, so
CI checks that the kernel's sm_90 code holds one (``target_rule_ptx``) and that it passes
valid targets in the interpreter; the H200 tests its failure.
"""

from __future__ import annotations

import torch
import triton.language as tl

from coda._validate import CodaInputError, check_target_tensor
from coda.kernels._triton import cdiv, cubin_sm90, kernel

BLOCK = 4096  # targets a program checks
TRITON = True  # False: the torch form on the GPU too (the benchmarks' same-run comparison)
MESSAGE = "coda: target out of range [0, vocab) and not ignore_index"


def _target_rule_kernel(t_ptr, n, vocab, ignore_index, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t = tl.load(t_ptr + offs, mask=offs < n, other=0)
    ok = ((t >= 0) & (t < vocab)) | (t == ignore_index)
    tl.device_assert(ok, "coda: target out of range [0, vocab) and not ignore_index")  # MESSAGE


def _breaking(t: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """Which targets break the rule (the torch form)."""
    return ((t < 0) | (t >= vocab)) & (t != ignore_index)


def target_rule_torch(t: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The rule as torch ops and an asynchronous assertion (the trace's form)."""
    torch._assert_async(~_breaking(t, vocab, ignore_index).any(), f"{MESSAGE} (vocab {vocab})")


def checked_targets(target, shape, vocab: int, ignore_index: int) -> torch.Tensor:
    """A loss's targets by every rule: a tensor of ``shape``, int32 or int64
    (``_validate.check_target_tensor``), each in [0, vocab) or == ignore_index. Returns them
    flattened."""
    t = check_target_tensor(target, shape)
    check_target_range(t, vocab, ignore_index)
    return t


def check_target_range(t: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The values' rule on flattened targets (CPU: named on the host; GPU: one launch)."""
    if torch.compiler.is_compiling():
        target_rule_torch(t, vocab, ignore_index)
    elif t.device.type == "cpu":  # on the host (also under Triton's interpreter, whose
        bad = _breaking(t, vocab, ignore_index)  # assertions are no-ops)
        if bool(bad.any()):
            raise CodaInputError(
                f"target: values must be in [0, {vocab}) or ignore_index ({ignore_index}); "
                f"got {int(t[bad][0])}"
            )
    elif TRITON and t.is_cuda and t.is_contiguous():
        launch_target_rule(t, vocab, ignore_index)
    else:
        target_rule_torch(t, vocab, ignore_index)


def launch_target_rule(t: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """The Triton kernel over contiguous targets (CUDA, or CPU in Triton's interpreter)."""
    n = t.numel()
    if n:
        kernel(_target_rule_kernel, debug=True)[(cdiv(n, BLOCK),)](
            t, n, vocab, ignore_index, BLOCK=BLOCK
        )


def target_rule_ptx(dtype: str = "*i64", arch: int = 90) -> str:
    """The kernel compiled for sm_90 without a GPU, as the launch compiles it (assertions in):
    its PTX, which calls ``__assertfail`` (the CPU compile test)."""
    consts = {"BLOCK": BLOCK}
    return cubin_sm90(
        _target_rule_kernel, {"t_ptr": dtype}, consts, arch=arch, part="ptx", debug=True
    )
