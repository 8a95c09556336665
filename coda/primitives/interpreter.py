"""The tile interpreter: runs an epilogue program over a tile grid with torch.

This is the CPU lowering of a ``coda.primitives`` program and the oracle the GPU lowering is
tested against. It walks the (ceil(M/tile_m), ceil(N/tile_n)) grid of output tiles, hands
``fn`` the tile's slice of the accumulator and of every declared operand (vectors broadcast as
on the GPU), and scatters what ``fn`` returns: tiles into full outputs, reductions into
partial arrays with exactly the GPU's shapes (M x T_N for RED_m and LSE, T_M x N for RED_n).
Ragged last tiles are cut to the valid rows and columns, which is what the GPU's predicated
accumulator (zeros for sums, -inf for LSE) amounts to.

Arithmetic runs in ``acc.dtype``: float64 for algebra proofs, float32 to mirror the kernel.
Outputs are rounded once to ``out_dtype`` when it is given, as the kernel's stores are.
"""

from __future__ import annotations

import math

import torch

from coda.primitives.math import TilePair
from coda.primitives.vocabulary import (
    ColLoad,
    ColPartials,
    ColSelect,
    EpilogueProgram,
    OnlineLSE,
    RowLoad,
    RowPartials,
    TileC,
)


def _tiles(extent: int, tile: int):
    for i in range(math.ceil(extent / tile)):
        yield i, slice(i * tile, min((i + 1) * tile, extent))


def _pairs(x: torch.Tensor) -> TilePair:
    """Adjacent columns (2j, 2j+1) as one pair value."""
    return TilePair(x[..., 0::2], x[..., 1::2])


def _tile_operand(p, v, rows, cols, mode):
    """The slice of one declared input that tile (rows, cols) sees, shaped as on the GPU:
    a column vector is one value per row; in "pair" mode every other input is a pair; in
    "widen" mode the saved tile (TileC) holds a pair per output column."""
    if isinstance(p, ColLoad):
        return v[rows][:, None]
    if isinstance(p, RowLoad):
        a = v[cols][None, :]
    elif isinstance(p, TileC) and mode == "widen":
        return _pairs(v[rows, 2 * cols.start : 2 * cols.stop])
    else:  # TileC, TileLoad
        a = v[rows, cols]
    return _pairs(a) if mode == "pair" else a


def interpret(
    program: EpilogueProgram,
    acc: torch.Tensor,
    operands: dict,
    *,
    tile_m: int,
    tile_n: int,
    out_dtype: torch.dtype | None = None,
) -> dict:
    """Run ``program`` on accumulator ``acc`` (M x N); returns every output it declares.

    ``operands`` maps each declared input (and each ColSelect's index) to its full tensor:
    RowLoad (N,), ColLoad (M,), TileC / TileLoad (M, N) -- (M, 2N) for TileC in "widen" mode.
    """
    M, N = acc.shape
    dt = acc.dtype
    mode = program.mode
    if mode == "pair" and (N % 2 or tile_n % 2):
        raise ValueError(f"pair mode needs even N and tile_n, got N={N}, tile_n={tile_n}")
    t_m, t_n = math.ceil(M / tile_m), math.ceil(N / tile_n)
    store_w = N // 2 if mode == "pair" else N
    d_w = 2 * N if mode == "widen" else N
    ops = {name: v.to(dt) if v.is_floating_point() else v for name, v in operands.items()}

    out: dict = {}
    if program.writes_d:
        out["D"] = torch.empty(M, d_w, dtype=dt)
    for p in program.stores:
        out[p.name] = torch.empty(M, store_w, dtype=dt)
    for p in program.sinks:
        if isinstance(p, (RowPartials, OnlineLSE)):
            out[p.name] = torch.zeros(M, t_n, dtype=dt)
        elif isinstance(p, ColPartials):
            out[p.name] = torch.zeros(t_m, N, dtype=dt)
        elif isinstance(p, ColSelect):
            out[p.name] = torch.full((M,), float("nan"), dtype=dt)

    for i, rows in _tiles(M, tile_m):
        for j, cols in _tiles(N, tile_n):
            args = {p.name: _tile_operand(p, ops[p.name], rows, cols, mode) for p in program.inputs}
            acc_view = _pairs(acc[rows, cols]) if mode == "pair" else acc[rows, cols]
            result = program.fn(acc_view, **args)
            _scatter(program, result, acc_view, out, rows, cols, i, j, ops)

    if out_dtype is not None:
        for name in ("D", *(p.name for p in program.stores)):
            if name in out:
                out[name] = out[name].to(out_dtype)
    return out


def _columns(v):
    return v.interleave() if isinstance(v, TilePair) else v


def _scatter(program, result, acc_view, out, rows, cols, i, j, ops):
    mode = program.mode
    unknown = set(result) - {"D"} - {p.name for p in (*program.stores, *program.sinks)}
    if unknown:
        raise KeyError(f"{program.name} returned undeclared names {sorted(unknown)}")
    if program.writes_d:
        d = _columns(result.get("D", acc_view))
        if mode == "widen":
            out["D"][rows, 2 * cols.start : 2 * cols.stop] = d
        else:
            out["D"][rows, cols] = d
    for p in program.stores:
        v = result[p.name]
        if mode == "pair":
            out[p.name][rows, cols.start // 2 : cols.stop // 2] = v
        else:
            out[p.name][rows, cols] = v
    for p in program.sinks:
        v = result[p.name]
        if isinstance(v, tuple):  # scaled reduction: fold x*y
            v = v[0] * v[1]
        flat = _columns(v)  # a pair contributes both lanes
        if isinstance(p, RowPartials):
            out[p.name][rows, j] = flat.sum(dim=1)
        elif isinstance(p, OnlineLSE):
            out[p.name][rows, j] = torch.logsumexp(flat, dim=1)
        elif isinstance(p, ColPartials):
            if mode != "element":
                raise NotImplementedError("ColPartials is defined for element mode only")
            out[p.name][i, cols] = flat.sum(dim=0)
        elif isinstance(p, ColSelect):
            idx = ops[p.index][rows].long()
            hit = (idx >= cols.start) & (idx < cols.stop)
            local = (idx - cols.start).clamp(0, flat.shape[1] - 1)
            picked = flat.gather(1, local[:, None])[:, 0]
            sel = out[p.name][rows]
            out[p.name][rows] = torch.where(hit, picked, sel)
