"""The symbolic lowering: an epilogue program's ``fn`` on sympy values, one output element.

Cleave's symbolic equivalence testing on CODA's one program, several lowerings: the ``fn``
that the GPU lowering traces and the tile interpreter runs is called here with exact sympy
expressions, so a proof can show, for every value rather than for sampled ones, that what an
epilogue computes per element equals the canonical math it reparameterizes (for instance,
that dSwiGLU's stored pair is the gradient of silu(z_g) z_u). The tile grid (ragged tiles,
reductions across a tile, the partials' shapes) is the interpreter's, proven in float64.

    out = evaluate(dswiglu_rescaled, acc=ds, c=(u_g, u_u), rstd=r)
    out["D"]      # (even, odd): a pair output
    out["stat"]   # a reduction's per-element term (a scaled one's two factors multiplied)

``prepass`` gives a prepass statistic's per-element terms, which a proof reduces itself.
"""

from __future__ import annotations

import inspect

from coda.primitives.math import TilePair
from coda.primitives.vocabulary import EpilogueProgram


def _value(v):
    """An (even, odd) tuple is a pair value, as the interpreter's ``TilePair``."""
    return TilePair(*v) if isinstance(v, tuple) else v


def _call(fn, acc, inputs) -> dict:
    """``fn`` at one element, its results back in this module's conventions: a pair as an
    (even, odd) tuple, a scaled reduction's (x, y) term as x * y."""
    result = fn(_value(acc), **{k: _value(v) for k, v in inputs.items()})
    out = {}
    for name, v in result.items():
        if isinstance(v, TilePair):
            v = (v.even, v.odd)
        elif isinstance(v, tuple):
            v = v[0] * v[1]
        out[name] = v
    return out


def prepass(program: EpilogueProgram, acc, **inputs) -> dict:
    """``program.prepass`` at one element, with ``evaluate``'s conventions: the per-element
    terms a prepass statistic (``GroupRstd``, ``TileMaxLog2``) reduces over its group."""
    return _call(program.prepass, acc, inputs)


def evaluate(program: EpilogueProgram, acc, **inputs) -> dict:
    """Every output of ``program`` at one element: ``acc`` and each input of ``program.fn``
    as sympy expressions, a pair (the accumulator in "pair" mode, the C tile in "widen" mode,
    a vector of pairs such as RoPE's frequencies) as an (even, odd) tuple; a prepass
    statistic is passed like any input. Returns {name: expression}, pairs as tuples."""
    params = list(inspect.signature(program.fn).parameters)[1:]
    if set(params) != set(inputs):
        raise TypeError(f"{program.name} takes {params}, got {sorted(inputs)}")
    return _call(program.fn, acc, inputs)
