"""Input checks that turn bad input into a clear error naming the argument and the rule,
before anything reaches the DSL (where it would be a crash or, worse, a wrong result)."""

from __future__ import annotations

import torch


class CodaInputError(ValueError):
    """An argument breaks one of an op's documented rules."""


def check_matrix(name: str, t, rows=None, cols=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodaInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise CodaInputError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    for axis, want in ((0, rows), (1, cols)):
        if want is not None and t.shape[axis] != want[1]:
            raise CodaInputError(
                f"{name}: dim {axis} must equal {want[0]} = {want[1]}, got shape {tuple(t.shape)}"
            )


def check_vector(name: str, t, length) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodaInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != length[1]:
        raise CodaInputError(
            f"{name}: expected shape ({length[0]},) = ({length[1]},), got {tuple(t.shape)}"
        )


def check_same_device(named: dict) -> torch.device:
    devices = {n: t.device for n, t in named.items() if t is not None}
    first = next(iter(devices.values()))
    for n, dv in devices.items():
        if dv != first:
            listing = ", ".join(f"{k} on {v}" for k, v in devices.items())
            raise CodaInputError(f"all tensors must be on one device; got {listing}")
    return first


def check_float_dtypes(named: dict, allowed) -> torch.dtype:
    dtypes = {n: t.dtype for n, t in named.items() if t is not None}
    first = next(iter(dtypes.values()))
    for n, dt in dtypes.items():
        if dt not in allowed:
            raise CodaInputError(f"{n}: dtype must be one of {list(allowed)}, got {dt}")
        if dt != first:
            listing = ", ".join(f"{k}={v}" for k, v in dtypes.items())
            raise CodaInputError(f"all tensors must share one dtype; got {listing}")
    return first


def check_tma_operand(name: str, t: torch.Tensor, *, either_major: bool = False) -> None:
    """The TMA unit reads 2-D tiles: one unit stride, the other stride and the base address
    16-byte aligned. ``either_major`` accepts a unit stride on either axis (weights)."""
    es = t.element_size()
    unit = [ax for ax in (1, 0) if t.stride(ax) == 1 or t.shape[ax] == 1]
    if not unit or (not either_major and 1 not in unit):
        want = "one unit stride" if either_major else "a unit stride on its last dim"
        raise CodaInputError(
            f"{name}: the TMA needs {want} (a contiguous row-major tensor), got strides "
            f"{t.stride()}; call .contiguous()"
        )
    other = 0 if unit[0] == 1 else 1
    if (t.stride(other) * es) % 16:
        raise CodaInputError(
            f"{name}: rows must be 16-byte aligned for the TMA: dim {unit[0]} of length "
            f"{t.shape[unit[0]]} x {es} B (stride {t.stride(other)}) is not a multiple of 16 B; "
            f"pad that dim to a multiple of {16 // es}"
        )
    if t.data_ptr() % 16:
        raise CodaInputError(f"{name}: base address must be 16-byte aligned for the TMA")
