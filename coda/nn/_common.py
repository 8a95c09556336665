"""What coda's modules share: autograd-friendly dtype casts, the kernel path's TMA rule, and
the loading of state dicts saved under a parameter's former name."""

from __future__ import annotations


def in_dtype(dtype, *tensors):
    """``tensors`` cast to ``dtype`` (autocast's per-call casts, differentiable), each left as
    it is when already in it: a no-op ``.to`` still costs ~1 us of host time per tensor."""
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


def tma_rule(**dims) -> str | None:
    """The kernel path's GEMMs read and write rows through the TMA: 16-byte rows, so every
    K and N is a multiple of 8 bf16 elements. Returns the first broken rule, or None."""
    for name, n in dims.items():
        if n % 8:
            return f"{name} = {n} is not a multiple of 8 (the TMA needs 16-byte rows in bf16)"
    return None


def rename_keys(state_dict: dict, prefix: str, renamed: dict) -> None:
    """Move ``prefix + old`` to ``prefix + new`` for each {old: new} of ``renamed`` in a state
    dict being loaded (``_load_from_state_dict``), so a checkpoint saved before a parameter
    was renamed still loads; a dict holding both names is left for ``load_state_dict`` to
    report."""
    for old, new in renamed.items():
        if prefix + old in state_dict and prefix + new not in state_dict:
            state_dict[prefix + new] = state_dict.pop(prefix + old)
