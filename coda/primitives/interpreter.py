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

import inspect
import math

import torch

from coda.primitives.vocabulary import EpilogueProgram, as_lanes, as_pairs


def _tiles(extent: int, tile: int):
    for i in range(math.ceil(extent / tile)):
        yield i, slice(i * tile, min((i + 1) * tile, extent))


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
    What each primitive reads and writes is its own (``Primitive.view`` / ``alloc`` /
    ``fold``); this walks the grid and routes values.
    """
    M, N = acc.shape
    dt = acc.dtype
    mode = program.mode
    if mode == "pair" and (N % 2 or tile_n % 2):
        raise ValueError(f"pair mode needs even N and tile_n, got N={N}, tile_n={tile_n}")
    t_m, t_n = math.ceil(M / tile_m), math.ceil(N / tile_n)
    # a loaded vector or tile reaches the program in the accumulator's dtype, integer ones
    # too (token positions), as quack's loads convert them; an index operand stays integer
    loads = {p.name for p in program.inputs if not p.from_prepass}
    ops = {
        name: v.to(dt)
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or name in loads)
        else v
        for name, v in operands.items()
    }

    out: dict = {}
    if program.writes_d:
        out["D"] = torch.empty(M, 2 * N if mode == "widen" else N, dtype=dt)
    for p in (*program.stores, *program.sinks):
        out[p.name] = p.alloc(M, N, t_m, t_n, mode, dt)
    stats = [p for p in program.inputs if p.from_prepass]
    for p in stats:
        p.check_group(ops[p.name], tile_n, N)
        if p.out:
            out[p.out] = torch.zeros(M, N // ops[p.name], dtype=dt)
    pre_names = list(inspect.signature(program.prepass).parameters)[1:] if stats else []

    for i, rows in _tiles(M, tile_m):
        for j, cols in _tiles(N, tile_n):
            args = {
                p.name: p.view(ops[p.name], rows, cols, mode)
                for p in program.inputs
                if not p.from_prepass
            }
            acc_view = as_pairs(acc[rows, cols]) if mode == "pair" else acc[rows, cols]
            if stats:
                pre = program.prepass(acc_view, **{n: args[n] for n in pre_names})
                for p in stats:
                    buf = out.get(p.out) if p.out else None
                    args[p.name] = p.finish(pre[p.name], ops[p.name], rows, cols, mode, buf)
            result = program.fn(acc_view, **args)
            _scatter(program, result, acc_view, out, rows, cols, i, j, ops)

    if out_dtype is not None:
        for name in ("D", *(p.name for p in program.stores)):
            if name in out:
                out[name] = out[name].to(out_dtype)
    return out


def _scatter(program, result, acc_view, out, rows, cols, i, j, ops):
    mode = program.mode
    unknown = set(result) - {"D"} - {p.name for p in (*program.stores, *program.sinks)}
    if unknown:
        raise KeyError(f"{program.name} returned undeclared names {sorted(unknown)}")
    if program.writes_d:
        d = as_lanes(result.get("D", acc_view))
        if mode == "widen":
            out["D"][rows, 2 * cols.start : 2 * cols.stop] = d
        else:
            out["D"][rows, cols] = d
    for p in (*program.stores, *program.sinks):
        v = result[p.name]
        if isinstance(v, tuple):  # a scaled reduction: fold x*y
            v = v[0] * v[1]
        p.fold(out[p.name], v, rows, cols, i, j, ops, mode)
