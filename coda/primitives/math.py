"""EW vocabulary: math an epilogue program may use, with one meaning under both lowerings.

Inside ``fn`` a value is either a torch tensor (the tile interpreter: a whole tile at once,
fp32 or fp64) or a CuTe DSL trace value (one accumulator element or pair, fp32). Arithmetic
operators already mean the same thing on both; the functions here cover the rest: pairs of
adjacent output columns and the transcendentals.

Pairs: in the interpreter a pair tile has a trailing axis of size 2 (even column, odd column);
on the GPU it is quack's ``Pair``. ``unpack`` splits one, ``pack`` builds one.
"""

from __future__ import annotations

import torch

from coda import _quack


def _is_tile(x) -> bool:
    return isinstance(x, torch.Tensor)


def unpack(pair):
    """(even, odd) halves of a pair value."""
    if _is_tile(pair):
        return pair[..., 0], pair[..., 1]
    return _quack.unpack(pair)


def pack(even, odd):
    """A pair value from its two halves."""
    if _is_tile(even):
        return torch.stack(torch.broadcast_tensors(even, odd), dim=-1)
    return _quack.pack(even, odd)


def exp(x):
    return torch.exp(x) if _is_tile(x) else _quack.exp(x)


def sigmoid(x):
    return torch.sigmoid(x) if _is_tile(x) else _quack.sigmoid(x)


def silu(x):
    """x * sigmoid(x)."""
    return x * sigmoid(x)
