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


def epi_args(program: EpilogueProgram, operands: dict, outputs: dict) -> dict:
    """quack's ``epi_args``: loaded vectors get quack's leading batch axis ((1, N) rows,
    (1, M) columns); tiles, stores, partial buffers and selected columns (M,) pass as they
    are."""
    args = {}
    for p in program.inputs:
        if isinstance(p, TileC):
            continue
        v = operands[p.name]
        args[p.name] = v.unsqueeze(0) if isinstance(p, (RowLoad, ColLoad)) else v
    for p in program.sinks:
        if isinstance(p, ColSelect):
            args[p.index] = operands[p.index].unsqueeze(0)
    for p in (*program.stores, *program.sinks):
        args[p.name] = outputs[p.name]
    return args
