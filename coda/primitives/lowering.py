"""The GPU lowering: an epilogue program becomes a quack SM90 epilogue GEMM.

Each coda primitive maps onto one quack EpiOp (``coda._quack.op_classes``), the program's
``fn`` becomes quack's traced epilogue function unchanged, and ``mode`` picks quack's visit
mode ("pair" -> acc_pair, "widen" -> packed_cd_b16x2). quack keys its compile cache on the
fn's source plus every global it references and each op's config, so the key is built from
plain values only; one EpiMod per program is kept for the life of the process.
"""

from __future__ import annotations

import functools

from coda import _quack
from coda.primitives.vocabulary import (
    ColLoad,
    ColSelect,
    EpilogueProgram,
    RowLoad,
    TileC,
    TileLoad,
)

_QUACK_MODE = {"element": None, "pair": "acc_pair", "widen": "packed_cd_b16x2"}


@functools.lru_cache(maxsize=None)
def lower(program: EpilogueProgram):
    """The quack EpiMod that runs ``program`` in the epilogue of quack's SM90 GEMM."""
    cls = _quack.op_classes()
    ops, outs, extra = {}, {}, []
    for p in program.inputs:
        if isinstance(p, (RowLoad, ColLoad, TileLoad)):
            ops[p.name] = cls[type(p).__name__](p.name)
        elif not isinstance(p, TileC):
            raise TypeError(f"no lowering for input {p!r}")
    stores = tuple(cls["TileStore"](p.name, gated=program.mode == "pair") for p in program.stores)
    for p in program.sinks:
        kind = type(p).__name__
        if isinstance(p, ColSelect):
            index_load = cls["ColLoad"](p.index)
            extra.append(index_load)
            outs[p.name] = cls[kind](p.name, idx_op=index_load)
        elif kind in ("RowPartials", "ColPartials"):
            outs[p.name] = cls[kind](p.name, scaled=p.scaled)
        else:
            outs[p.name] = cls[kind](p.name)
    return _quack.make_epi_mod(
        program.fn,
        outputs=stores,
        ops=ops,
        outs=outs,
        extra_ops=tuple(extra),
        mode=_QUACK_MODE[program.mode],
    )


@functools.lru_cache(maxsize=None)
def _arg_recipe(program: EpilogueProgram) -> tuple:
    """(name, source, unsqueeze) per quack argument, in a fixed order, computed once per
    program: ``source`` is "in" (an operand) or "out" (an output buffer)."""
    recipe = []
    for p in program.inputs:
        if not isinstance(p, TileC):
            recipe.append((p.name, "in", isinstance(p, (RowLoad, ColLoad))))
    for p in program.sinks:
        if isinstance(p, ColSelect):
            recipe.append((p.index, "in", True))
    for p in (*program.stores, *program.sinks):
        recipe.append((p.name, "out", False))
    return tuple(recipe)


def epi_args(program: EpilogueProgram, operands: dict, outputs: dict) -> dict:
    """quack's ``epi_args``: loaded vectors get quack's leading batch axis ((1, N) rows,
    (1, M) columns; a selected column's index likewise); tiles, stores, partial buffers and
    selected columns (M,) pass as they are."""
    args = {}
    for name, source, unsqueeze in _arg_recipe(program):
        v = operands[name] if source == "in" else outputs[name]
        args[name] = v.unsqueeze(0) if unsqueeze else v
    return args
