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
VEC    ``Scalar(name)``         one number for the whole GEMM, a host value passed at launch
                                (a branch's residual multiplier: Granite's)
       ``DeviceScalar(name)``   one number for the whole GEMM, read by the kernel from a
                                one-element fp32 tensor (a learned scalar: xIELU's)
       ``RowLoad(name)``        one value per output column, broadcast over rows (gamma)
       ``ColLoad(name)``        one value per output row, broadcast over columns (rstd, corr)
       ``ColSelect(name, idx)`` VEC-ST COL: out[m] = value at column idx[m] (target logit)
TILE   ``TileC()``              the residual / saved tile as the GEMM's C operand (``c``)
       ``TileLoad(name)``       an extra tile congruent with the output
       ``TileStore(name)``      an extra tile output (``"D"`` is the GEMM's own output)
RED    ``RowPartials(name)``    RED_m: sum over a tile's columns, one fp32 partial per
                                (row m, N-tile t) -> an M x T_N array
       ``ColPartials(name)``    RED_n: sum over a tile's rows, one fp32 partial per
                                (M-tile i, column n) -> a T_M x N array
       ``GroupRstd(name)``      a per-(row, column group) rstd of a ``prepass`` value, complete
                                inside the tile, read back by ``fn`` (per-head RMSNorm)
       ``TileMaxLog2(name)``    the tile's row max of a ``prepass`` value in log2 units,
                                rounded (the scaled-exp softmax's power-of-two offset)
LSE    ``OnlineLSE(name)``      stateful online (max, sum-exp) over a tile's columns, emitted
                                as one log-sum-exp partial per (row m, N-tile t)
XFORM  ``ScaleA(name, ...)``    not an epilogue primitive: A's blocks scaled by a strip on
                                their way into the mainloop (``a_transform=``)
=====  =======================  ==============================================================

A reduction declared ``scaled=True`` takes a pair ``(x, y)`` from ``fn`` and folds ``x*y``
without rounding the product first (one fused multiply-add on the GPU).

A program has two lowerings: ``primitives.interpreter`` runs it over a tile grid with torch
(the CPU path and the test oracle), and ``primitives.lowering`` turns it into a quack SM90
epilogue GEMM. Each primitive is one object carrying both of its meanings (``view`` / ``alloc``
/ ``fold`` for the interpreter, ``lower`` / ``host_args`` for quack), so the two lowering
modules are generic walks and a new primitive is one class in this file (plus, when it needs
a quack EpiOp coda has not used before, one entry in ``coda._quack.op_classes``).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from coda.primitives.math import TilePair

MODES = ("element", "pair", "widen")
LOG2E = 1.0 / math.log(2.0)


def as_pairs(x: torch.Tensor) -> TilePair:
    """Adjacent columns (2j, 2j+1) as one pair value."""
    return TilePair(x[..., 0::2], x[..., 1::2])


def as_lanes(v):
    """A value as plain columns: a pair contributes both lanes, interleaved."""
    return v.interleave() if isinstance(v, TilePair) else v


@dataclass(frozen=True)
class Primitive:
    """One declared operand or output of an epilogue program, as one object: its declaration
    (name, options), its meaning on the CPU (the tile interpreter calls ``view`` for inputs,
    ``alloc`` and ``fold`` for outputs), and its GPU lowering (``lower`` returns the quack
    EpiOp it becomes, from ``coda._quack.op_classes()``; ``host_args`` what it passes in
    quack's ``epi_args``). A new primitive is one new class here."""

    name: str

    family = ""  # EW / VEC / TILE / RED / LSE, for reports
    from_prepass = False  # an input computed from the program's prepass (``GroupRstd``)

    def cache_key(self) -> tuple:
        return (type(self).__name__, self.name)

    # -- GPU lowering ------------------------------------------------------------------------
    def lower(self, ops: dict, mode: str):
        """(the quack EpiOp this primitive becomes or None, extra EpiOps it needs)."""
        return ops[type(self).__name__](self.name), ()

    def host_args(self, operands: dict, outputs: dict) -> dict:
        """Its entries of quack's ``epi_args``."""
        return {self.name: operands[self.name]}

    def write_back(self, buf, value, operands: dict, n_cols: int) -> None:
        """An interpreted output into the kernel's own buffer ``buf``, as the kernel leaves
        it (``coda.kernels._launch`` runs CPU tensors through the interpreter)."""
        buf.copy_(value)


# -- VEC: rank-0 and rank-1 loads and stores -----------------------------------------------------
@dataclass(frozen=True)
class Scalar(Primitive):
    """VEC-LD of rank 0: one fp32 number for every element, given at launch as a Python
    number (quack passes it as a kernel argument: a new value is no new compile)."""

    family = "VEC"

    def view(self, v, rows, cols, mode):
        return float(v)

    def host_args(self, operands, outputs):
        return {self.name: float(operands[self.name])}


@dataclass(frozen=True)
class DeviceScalar(Primitive):
    """VEC-LD of rank 0 from device memory: one fp32 number for every element, which the
    kernel reads from a one-element tensor (quack's ``Scalar`` in pointer mode). For a value
    computed on the GPU in the step itself (a learned parameter, xIELU's alpha): passing it as
    a host number would cost a host sync per launch."""

    family = "VEC"

    def view(self, v, rows, cols, mode):
        return v.reshape(())

    def host_args(self, operands, outputs):
        return {self.name: operands[self.name]}


@dataclass(frozen=True)
class RowLoad(Primitive):
    """VEC-LD ROW: a length-N vector broadcast down the rows of every tile."""

    family = "VEC"

    def view(self, v, rows, cols, mode):
        a = v[cols][None, :]
        return as_pairs(a) if mode == "pair" else a


@dataclass(frozen=True)
class ColLoad(Primitive):
    """VEC-LD COL: a length-M vector broadcast across the columns of every tile."""

    family = "VEC"

    def view(self, v, rows, cols, mode):
        return v[rows][:, None]  # one value per row, in every mode


@dataclass(frozen=True)
class ColSelect(Primitive):
    """VEC-ST COL: out[m] = fn's value at column index[m]; rows whose index is outside
    [0, N) are not written. ``index`` names the integer length-M operand."""

    index: str = "target"
    family = "VEC"

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.index)

    def alloc(self, M, N, t_m, t_n, mode, dtype):
        return torch.full((M,), float("nan"), dtype=dtype)

    def fold(self, buf, v, rows, cols, i, j, operands, mode):
        flat = as_lanes(v)
        idx = operands[self.index][rows].long()
        hit = (idx >= cols.start) & (idx < cols.stop)
        local = (idx - cols.start).clamp(0, flat.shape[1] - 1)
        picked = flat.gather(1, local[:, None])[:, 0]
        buf[rows] = torch.where(hit, picked, buf[rows])

    def lower(self, ops, mode):
        index_load = ops["ColLoad"](self.index)  # the selecting column index, loaded per row
        return ops["ColSelect"](self.name, idx_op=index_load), (index_load,)

    def host_args(self, operands, outputs):
        return {self.index: operands[self.index], self.name: outputs[self.name]}

    def write_back(self, buf, value, operands, n_cols):
        idx = operands[self.index]  # only rows whose index lies in some tile are written
        hit = (idx >= 0) & (idx < n_cols)
        buf.copy_(torch.where(hit, value.to(buf.dtype), buf))


# -- TILE: rank-2 loads and stores ---------------------------------------------------------------
@dataclass(frozen=True)
class TileC(Primitive):
    """TILE-LD through the GEMM's C operand (TMA-loaded by the mainloop's epilogue pipeline).
    The fn parameter is always named ``c``."""

    name: str = "c"
    family = "TILE"

    def view(self, v, rows, cols, mode):
        if mode == "widen":  # the saved tile holds a pair per output column
            return as_pairs(v[rows, 2 * cols.start : 2 * cols.stop])
        a = v[rows, cols]
        return as_pairs(a) if mode == "pair" else a

    def lower(self, ops, mode):
        return None, ()  # the GEMM's own C operand

    def host_args(self, operands, outputs):
        return {}


@dataclass(frozen=True)
class TileLoad(Primitive):
    """TILE-LD of an extra M x N tensor congruent with the output."""

    family = "TILE"

    def view(self, v, rows, cols, mode):
        a = v[rows, cols]
        return as_pairs(a) if mode == "pair" else a


@dataclass(frozen=True)
class TileStore(Primitive):
    """TILE-ST of an extra output (full width; half width in "pair" mode)."""

    family = "TILE"

    def alloc(self, M, N, t_m, t_n, mode, dtype):
        return torch.empty(M, N // 2 if mode == "pair" else N, dtype=dtype)

    def fold(self, buf, v, rows, cols, i, j, operands, mode):
        if mode == "pair":
            buf[rows, cols.start // 2 : cols.stop // 2] = v
        else:
            buf[rows, cols] = v

    def lower(self, ops, mode):
        return ops["TileStore"](self.name, gated=mode == "pair"), ()

    def host_args(self, operands, outputs):
        return {self.name: outputs[self.name]}

    def clipped_shape(self, buf, M, N, mode):
        """The full shape of this store when ``buf`` is narrower than the tile grid (None
        otherwise): quack's frontend plans with a buffer of that shape, the compiled TMA
        store takes its bound from the buffer it is launched with and clips there."""
        n = N // 2 if mode == "pair" else N
        return (M, n) if buf.shape[-1] < n else None

    def write_back(self, buf, value, operands, n_cols):
        """A buffer narrower than the tile grid keeps its leading columns: the TMA store
        clips every tile at the tensor's bound (QK-norm's z is kept for q and k only)."""
        if buf.shape[-1] > value.shape[-1]:
            raise ValueError(f"{self.name}: buffer wider ({buf.shape[-1]}) than the tiles")
        buf.copy_(value[..., : buf.shape[-1]])


# -- RED: tile reductions to partials ------------------------------------------------------------
@dataclass(frozen=True)
class _Partials(Primitive):
    scaled: bool = False
    family = "RED"

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.scaled)

    def lower(self, ops, mode):
        return ops[type(self).__name__](self.name, scaled=self.scaled), ()

    def host_args(self, operands, outputs):
        return {self.name: outputs[self.name]}


@dataclass(frozen=True)
class RowPartials(_Partials):
    """RED_m: partial[m, t] = sum of fn's value over the columns of N-tile t (fp32)."""

    def alloc(self, M, N, t_m, t_n, mode, dtype):
        return torch.zeros(M, t_n, dtype=dtype)

    def fold(self, buf, v, rows, cols, i, j, operands, mode):
        buf[rows, j] = as_lanes(v).sum(dim=1)


@dataclass(frozen=True)
class ColPartials(_Partials):
    """RED_n: partial[i, n] = sum of fn's value over the rows of M-tile i (fp32)."""

    def alloc(self, M, N, t_m, t_n, mode, dtype):
        return torch.zeros(t_m, N, dtype=dtype)

    def fold(self, buf, v, rows, cols, i, j, operands, mode):
        if mode != "element":
            raise NotImplementedError("ColPartials is defined for element mode only")
        buf[i, cols] = as_lanes(v).sum(dim=0)


# -- LSE: stateful online log-sum-exp ------------------------------------------------------------
@dataclass(frozen=True)
class OnlineLSE(Primitive):
    """partial[m, t] = log sum_{n in N-tile t} exp(value[m, n]), carried as a running
    (max, sum-exp) pair so no positive number is ever exponentiated."""

    family = "LSE"

    def alloc(self, M, N, t_m, t_n, mode, dtype):
        return torch.zeros(M, t_n, dtype=dtype)

    def fold(self, buf, v, rows, cols, i, j, operands, mode):
        buf[rows, j] = torch.logsumexp(as_lanes(v), dim=1)

    def host_args(self, operands, outputs):
        return {self.name: outputs[self.name]}


# -- RED, finalized in the tile: a per-(row, column group) statistic of a prepass value -------
def epilogue_subtile_n(tile_n: int) -> int:
    """Columns of one epilogue subtile on SM90 (16- and 32-bit D): the GPU lowering sweeps a
    tile in subtiles this wide and folds each thread's run within one into one statistic."""
    return math.gcd(32, tile_n)


def group_fits(group: int, tile_n: int, n: int) -> str:
    """Why a column group of width ``group`` cannot be a statistic's group in an N = ``n``
    GEMM with ``tile_n``-wide tiles, or "" when it can: whole groups in every tile and in N,
    and, on the GPU, whole subtiles in every group (a narrower group would be folded with its
    subtile's neighbours: run 289's Qwen3 with head_dim 16)."""
    if tile_n % group or n % group:
        return f"group {group} must divide tile_n ({tile_n}) and N ({n})"
    sub = epilogue_subtile_n(tile_n)
    if group % sub:
        return f"group {group} must be a multiple of the epilogue subtile's {sub} columns"
    return ""


@dataclass(frozen=True)
class _GroupStat(Primitive):
    """A per-(row, column group) statistic of the value the program's ``prepass`` returns
    under this name, complete inside the tile (each group lies in one output tile: tile_n and
    N multiples of the group) and read back by ``fn`` as an input, broadcast over the group's
    columns. The group width is the operand under this name (an int); ``out`` optionally
    names an (M, N / group) fp32 output of the statistic itself."""

    out: str | None = None
    family = "RED"
    from_prepass = True

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.out)

    def statistic(self, grouped: torch.Tensor) -> torch.Tensor:
        """(rows, groups, group) prepass values -> (rows, groups) statistic."""
        raise NotImplementedError

    def check_group(self, group: int, tile_n: int, n: int) -> None:
        """Both lowerings refuse a group the GPU's cannot reduce (``group_fits``)."""
        why = group_fits(int(group), tile_n, n)
        if why:
            raise ValueError(f"{self.name}: {why}")

    def finish(self, value, group: int, rows, cols, mode, out_buf):
        """The tile's statistic from its prepass ``value``, as ``fn`` sees it."""
        v = as_lanes(value)
        r = self.statistic(v.reshape(v.shape[0], -1, group))
        if out_buf is not None:
            out_buf[rows, cols.start // group : cols.stop // group] = r
        full = r.repeat_interleave(group, dim=1)
        return as_pairs(full) if mode == "pair" else full

    def host_args(self, operands, outputs):
        args = {self.name: int(operands[self.name])}  # the group width, a compile-time int
        if self.out:
            args[self.out] = outputs[self.out]
        return args


@dataclass(frozen=True)
class GroupRstd(_GroupStat):
    """rstd[m, g] = (mean over the ``group`` adjacent columns of group g of v[m, n] + eps)^-1/2,
    with v the prepass value (e.g. z^2): per-head RMSNorm, Qwen3's QK-norm."""

    eps: float = 1e-6

    def cache_key(self) -> tuple:
        return (*super().cache_key(), self.eps)

    def statistic(self, grouped):
        return torch.rsqrt(grouped.mean(-1) + self.eps)

    def lower(self, ops, mode):
        op = ops["GroupRstd"](self.name, eps=self.eps)
        return op, ((op.out(self.out),) if self.out else ())


@dataclass(frozen=True)
class TileMaxLog2(_GroupStat):
    """k[m, t] = round-half-even(log2(e) * max over N-tile t of v[m, n]): the row maximum of a
    whole output tile in log2 units, rounded to an integer, so 2^(v log2 e - k) is a
    softmax numerator scaled by an exact power of two (the scaled-exp cross-entropy: quack's
    MaxLog2). The group is the whole tile: its width operand must equal tile_n."""

    def statistic(self, grouped):
        return torch.round(grouped.amax(-1) * LOG2E)  # torch.round is half-to-even

    def finish(self, value, group, rows, cols, mode, out_buf):
        if cols.stop - cols.start != group:
            raise ValueError(f"{self.name}: the group ({group}) must be the whole tile_n")
        return super().finish(value, group, rows, cols, mode, out_buf)

    def lower(self, ops, mode):
        op = ops["TileMaxLog2"](self.name)
        return op, ((op.out(self.out),) if self.out else ())


# -- XFORM: the A operand scaled on its way into the mainloop -------------------------------------
_SCALE_KINDS = {(1, None): "colvec_ktile", (64, 1): "kvec_m64"}  # quack's strip kinds


@dataclass(frozen=True)
class ScaleA:
    """An A-operand transform (mainloop side, not epilogue): the GEMM multiplies
    (u (.) A) @ B, with one value of the strip ``u`` per block of ``rows`` A rows by ``cols``
    A columns (``cols`` None: the mainloop's whole k-tile, ``tile_k`` columns). Two shapes:
    ``ScaleA(name)`` per (row, k-tile), and ``ScaleA(name, rows=64, cols=1)`` per (64-row
    block, column). The strip is a contiguous bf16 tensor, finer axis last: (K / cols, M)
    blocks for the first shape (transposed: rows vary fastest), (M / 64, K) for the second,
    with K padded to whole k-tiles. Lowered to quack's ``@a_transform`` value transform (the
    register-sourced SM90 mainloop scales A's fragments); M must be a multiple of tile_m.
    Used by the scaled-exp cross-entropy, whose softmax is E times powers of two."""

    name: str
    rows: int = 1
    cols: int | None = None
    tile_k: int = 64
    family = "XFORM"

    def __post_init__(self):
        if (self.rows, self.cols) not in _SCALE_KINDS:
            raise ValueError(f"ScaleA: (rows, cols) must be one of {sorted(_SCALE_KINDS)}")

    def cache_key(self) -> tuple:
        return ("ScaleA", self.name, self.rows, self.cols, self.tile_k)

    @property
    def kind(self) -> str:
        """quack's name for this strip shape."""
        return _SCALE_KINDS[(self.rows, self.cols)]

    def _k_inner(self) -> bool:
        return (self.cols or self.tile_k) < self.rows

    def strip_shape(self, m: int, k: int) -> tuple[int, int]:
        gk = self.cols or self.tile_k
        kg = -(-k // self.tile_k) * (self.tile_k // gk)
        return (m // self.rows, kg) if self._k_inner() else (kg, m // self.rows)

    def check(self, u: torch.Tensor, a: torch.Tensor, tile_m: int) -> None:
        """The strip's rules (quack's), as coda errors naming the argument."""
        from coda._validate import CodaInputError

        m, k = a.shape
        if m % tile_m or m % self.rows:
            raise CodaInputError(
                f"{self.name}: A has {m} rows; a scaled A operand needs a multiple of "
                f"tile_m = {tile_m}"
            )
        want = self.strip_shape(m, k)
        if tuple(u.shape) != want or u.dtype != a.dtype or not u.is_contiguous():
            raise CodaInputError(
                f"{self.name}: the strip must be a contiguous {a.dtype} tensor of shape {want}, "
                f"got {u.dtype} {tuple(u.shape)}"
            )

    def expand(self, u: torch.Tensor, m: int, k: int) -> torch.Tensor:
        """The interpreter's meaning: the (m, k) tensor of per-element scale values."""
        gk = self.cols or self.tile_k
        blocks = u if self._k_inner() else u.t()  # (m / rows, k-groups)
        full = blocks.repeat_interleave(self.rows, dim=0).repeat_interleave(gk, dim=1)
        return full[:m, :k]


INPUTS = (Scalar, DeviceScalar, RowLoad, ColLoad, TileC, TileLoad, GroupRstd, TileMaxLog2)
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
    prepass: Callable | None = None  # prepass(acc, **some inputs) -> {statistic name: value}
    a_transform: ScaleA | None = None  # A scaled in the mainloop; its strip is an operand

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
        stats = {p.name for p in self.inputs if p.from_prepass}
        if stats and self.prepass is None:
            raise ValueError(f"{self.fn.__name__}: {sorted(stats)} need a prepass")
        if self.a_transform is not None:
            if not isinstance(self.a_transform, ScaleA):
                raise TypeError(f"{self.a_transform!r} is not an A-operand transform (ScaleA)")
            if self.a_transform.name in declared or self.a_transform.name in params:
                raise ValueError(f"{self.fn.__name__}: {self.a_transform.name!r} declared twice")
        if self.prepass is not None:
            pre = list(inspect.signature(self.prepass).parameters)
            if not pre or pre[0] != "acc" or not set(pre[1:]) <= inputs - stats:
                raise ValueError(
                    f"{self.fn.__name__}: the prepass takes acc and plain declared inputs, "
                    f"got {pre}"
                )

    @property
    def name(self) -> str:
        return self.fn.__name__

    @functools.cached_property
    def group_stats(self) -> tuple:
        """The inputs computed in the prepass (``GroupRstd``, ``TileMaxLog2``)."""
        return tuple(p for p in self.inputs if p.from_prepass)

    def cache_key(self) -> tuple:
        """Plain-value identity of the declarations (the fn source is keyed by quack)."""
        return (
            self.name,
            self.mode,
            self.writes_d,
            tuple(p.cache_key() for p in (*self.inputs, *self.stores, *self.sinks)),
            self.a_transform.cache_key() if self.a_transform else None,
        )


def epilogue_program(
    *, inputs=(), stores=(), sinks=(), mode="element", writes_d=True, prepass=None, a_transform=None
):
    """Decorator: ``@epilogue_program(inputs=[...], ...)`` over ``fn(acc, ...)``."""

    def wrap(fn):
        return EpilogueProgram(
            fn,
            tuple(inputs),
            tuple(stores),
            tuple(sinks),
            mode=mode,
            writes_d=writes_d,
            prepass=prepass,
            a_transform=a_transform,
        )

    return wrap
