"""What coda's modules share: autograd-friendly dtype casts, the kernel path's TMA rules, and
the loading of state dicts saved under a parameter's former name."""

from __future__ import annotations

import torch


def in_dtype(dtype, *tensors):
    """``tensors`` cast to ``dtype`` (autocast's per-call casts, differentiable), each left as
    it is when already in it: a no-op ``.to`` still costs ~1 us of host time per tensor (None,
    an absent weight, stays None)."""
    return tuple(t if t is None or t.dtype == dtype else t.to(dtype) for t in tensors)


def norm_gains(gains: tuple, dtype, offset: float = 0.0, fp32: bool = False, cast: bool = True):
    """RMSNorm ``gains`` as coda's kernels apply them (``cast``: in the compute ``dtype``; else
    as they are, as HF's norms take their weights) or, for a norm whose gain is applied in
    fp32 (``offset`` 1: Gemma's 1 + w; ``fp32``: OLMo's w), the fp32 (float64 for float64
    compute) sum ``offset + gain``, differentiable (the gain's gradient is the sum's)."""
    if not (offset or fp32):
        return in_dtype(dtype, *gains) if cast else gains
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return tuple(None if g is None else g.to(acc) + offset for g in gains)


def tma_rule(**dims) -> str | None:
    """The kernel path's GEMMs read and write rows through the TMA: 16-byte rows, so every
    K and N is a multiple of 8 bf16 elements. Returns the first broken rule, or None."""
    for name, n in dims.items():
        if n % 8:
            return f"{name} = {n} is not a multiple of 8 (the TMA needs 16-byte rows in bf16)"
    return None


def tma_aligned(rows):
    """``rows`` itself where its base address is 16-byte aligned (the TMA's rule), else a copy
    (the allocator aligns it; differentiable). The fused ops refuse such a tensor, naming the
    rule; a module takes any activation, as ``nn.Linear`` does, a contiguous view at an odd
    offset of a flat buffer included (``DecoderLayer``: its input is the O projection's
    residual operand; ``LMHeadLoss`` never hands its input to a GEMM). One pointer read a
    call; none while torch.compile traces (a fake tensor has no address)."""
    if torch.compiler.is_compiling() or rows.data_ptr() % 16 == 0:
        return rows
    return rows.clone()


class FormerNames:
    """Mixin for a module whose parameters were renamed: ``load_state_dict`` also takes a
    state dict saved under the former names (``RENAMED``: {old: new}); a dict holding both
    names is left for ``load_state_dict`` to report."""

    RENAMED: dict = {}

    def _load_from_state_dict(self, state_dict, prefix, *args):
        for old, new in self.RENAMED.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args)
