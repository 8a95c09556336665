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
from coda.primitives.vocabulary import EpilogueProgram

_QUACK_MODE = {"element": None, "pair": "acc_pair", "widen": "packed_cd_b16x2"}


@functools.lru_cache(maxsize=None)
def lower(program: EpilogueProgram):
    """The quack EpiMod that runs ``program`` in the epilogue of quack's SM90 GEMM: each
    declared primitive lowers itself (``Primitive.lower``)."""
    table, mode = _quack.op_classes(), program.mode
    ops, outs, extra = {}, {}, []
    for group, into in ((program.inputs, ops), (program.sinks, outs)):
        for p in group:
            op, needs = p.lower(table, mode)
            if op is not None:
                into[p.name] = op
            extra.extend(needs)
    stores = tuple(p.lower(table, mode)[0] for p in program.stores)
    stats = tuple(p.name for p in program.inputs if p.from_prepass)
    prepass = {"prepass": program.prepass, "prepass_outs": stats} if stats else {}
    return _quack.make_epi_mod(
        program.fn,
        outputs=stores,
        ops=ops,
        outs=outs,
        extra_ops=tuple(extra),
        mode=_QUACK_MODE[mode],
        **prepass,
    )


def epi_args(program: EpilogueProgram, operands: dict, outputs: dict) -> dict:
    """quack's ``epi_args``: every declared primitive's own host arguments
    (``Primitive.host_args``: each operand or output buffer under its name, as it is; quack's
    vector loads take a rank-1 vector as one vector for the whole (unbatched) GEMM)."""
    args = {}
    for p in (*program.inputs, *program.sinks, *program.stores):
        args.update(p.host_args(operands, outputs))
    return args
