"""The five CODA epilogue primitive families, as declarations an epilogue program is written in.

An epilogue program is one plain Python function ``fn(acc, **operands) -> {name: value}`` plus
the declarations below, which say what every operand and every returned name *is*:

=====  =======================  ==============================================================
CODA   declaration              meaning inside ``fn`` / what the kernel does with it
=====  =======================  ==============================================================
EW     ``mode``                 "element": ``acc`` is one accumulator value. "pair": ``acc`` is
                                the pair of adjacent output columns (2j, 2j+1) (RoPE, SwiGLU);
                                "widen": one ``acc`` value becomes a stored pair (dSwiGLU).
                                The map itself is the body of ``fn`` (see ``primitives.math``).
VEC    ``RowLoad(name)``        one value per output column, broadcast over rows (gamma)
       ``ColLoad(name)``        one value per output row, broadcast over columns (rstd, corr)
       ``ColSelect(name, idx)`` VEC-ST COL: out[m] = value at column idx[m] (target logit)
TILE   ``TileC()``              the residual / saved tile as the GEMM's C operand (``c``)
       ``TileLoad(name)``       an extra tile congruent with the output
       ``TileStore(name)``      an extra tile output (``"D"`` is the GEMM's own output)
RED    ``RowPartials(name)``    RED_m: sum over a tile's columns, one fp32 partial per
                                (row m, N-tile t) -> an M x T_N array
       ``ColPartials(name)``    RED_n: sum over a tile's rows, one fp32 partial per
                                (M-tile i, column n) -> a T_M x N array
LSE    ``OnlineLSE(name)``      stateful online (max, sum-exp) over a tile's columns, emitted
                                as one log-sum-exp partial per (row m, N-tile t)
=====  =======================  ==============================================================

A reduction declared ``scaled=True`` takes a pair ``(x, y)`` from ``fn`` and folds ``x*y``
without rounding the product first (one fused multiply-add on the GPU).

A program has two lowerings: ``primitives.interpreter`` runs it over a tile grid with torch
(the CPU path and the test oracle), and ``primitives.lowering`` turns it into a quack SM90
epilogue GEMM. Both read only these declarations, so one program text serves both.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

MODES = ("element", "pair", "widen")


@dataclass(frozen=True)
class Primitive:
    """One declared operand or output of an epilogue program."""

    name: str

    family = ""  # EW / VEC / TILE / RED / LSE, for reports

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.name)


# -- VEC: rank-1 loads and stores ----------------------------------------------------------------
@dataclass(frozen=True)
class RowLoad(Primitive):
    """VEC-LD ROW: a length-N vector broadcast down the rows of every tile."""

    family = "VEC"


@dataclass(frozen=True)
class ColLoad(Primitive):
    """VEC-LD COL: a length-M vector broadcast across the columns of every tile."""

    family = "VEC"


@dataclass(frozen=True)
class ColSelect(Primitive):
    """VEC-ST COL: out[m] = fn's value at column index[m]; rows whose index is outside
    [0, N) are not written. ``index`` names the integer length-M operand."""

    index: str = "target"
    family = "VEC"

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.index)


# -- TILE: rank-2 loads and stores ---------------------------------------------------------------
@dataclass(frozen=True)
class TileC(Primitive):
    """TILE-LD through the GEMM's C operand (TMA-loaded by the mainloop's epilogue pipeline).
    The fn parameter is always named ``c``."""

    name: str = "c"
    family = "TILE"


@dataclass(frozen=True)
class TileLoad(Primitive):
    """TILE-LD of an extra M x N tensor congruent with the output."""

    family = "TILE"


@dataclass(frozen=True)
class TileStore(Primitive):
    """TILE-ST of an extra output (full width; half width in "pair" mode)."""

    family = "TILE"


# -- RED: tile reductions to partials ------------------------------------------------------------
@dataclass(frozen=True)
class _Partials(Primitive):
    scaled: bool = False
    family = "RED"

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.scaled)


@dataclass(frozen=True)
class RowPartials(_Partials):
    """RED_m: partial[m, t] = sum of fn's value over the columns of N-tile t (fp32)."""


@dataclass(frozen=True)
class ColPartials(_Partials):
    """RED_n: partial[i, n] = sum of fn's value over the rows of M-tile i (fp32)."""


# -- LSE: stateful online log-sum-exp ------------------------------------------------------------
@dataclass(frozen=True)
class OnlineLSE(Primitive):
    """partial[m, t] = log sum_{n in N-tile t} exp(value[m, n]), carried as a running
    (max, sum-exp) pair so no positive number is ever exponentiated."""

    family = "LSE"


INPUTS = (RowLoad, ColLoad, TileC, TileLoad)
SINKS = (RowPartials, ColPartials, OnlineLSE, ColSelect)


@dataclass(frozen=True, eq=False)
class EpilogueProgram:
    """An epilogue program: ``fn`` plus the declaration of every name it reads or returns.

    A program is one object for the life of the process (declared once, at module level):
    it compares and hashes by identity, so looking up its lowering on every launch is a
    pointer hash, not a walk over its declarations."""

    fn: Callable
    inputs: tuple = ()
    stores: tuple = ()
    sinks: tuple = ()
    mode: str = "element"
    writes_d: bool = True

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        params = list(inspect.signature(self.fn).parameters)
        if not params or params[0] != "acc":
            raise ValueError(f"{self.fn.__name__}: the first parameter must be 'acc'")
        declared = {p.name: p for p in (*self.inputs, *self.stores, *self.sinks)}
        if len(declared) != len(self.inputs) + len(self.stores) + len(self.sinks):
            raise ValueError(f"{self.fn.__name__}: duplicate primitive names")
        inputs = {p.name for p in self.inputs}
        if set(params[1:]) != inputs:
            raise ValueError(
                f"{self.fn.__name__}: parameters {params[1:]} must be exactly the declared "
                f"inputs {sorted(inputs)}"
            )
        for p in self.inputs:
            if not isinstance(p, INPUTS):
                raise TypeError(f"{p!r} is not an input primitive")
        for p in self.stores:
            if not isinstance(p, TileStore):
                raise TypeError(f"{p!r} is not a TileStore")
        for p in self.sinks:
            if not isinstance(p, SINKS):
                raise TypeError(f"{p!r} is not a reduction / select primitive")
        if self.mode == "widen" and not any(isinstance(p, TileC) for p in self.inputs):
            raise ValueError("'widen' mode reads its saved pairs through TileC")

    @property
    def name(self) -> str:
        return self.fn.__name__

    def cache_key(self) -> tuple:
        """Plain-value identity of the declarations (the fn source is keyed by quack)."""
        return (
            self.name,
            self.mode,
            self.writes_d,
            tuple(p.cache_key() for p in (*self.inputs, *self.stores, *self.sinks)),
        )


def epilogue_program(*, inputs=(), stores=(), sinks=(), mode="element", writes_d=True):
    """Decorator: ``@epilogue_program(inputs=[...], ...)`` over ``fn(acc, ...)``."""

    def wrap(fn):
        return EpilogueProgram(
            fn, tuple(inputs), tuple(stores), tuple(sinks), mode=mode, writes_d=writes_d
        )

    return wrap
