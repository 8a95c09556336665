"""EW vocabulary: math an epilogue program may use, with one meaning under every lowering.

Inside ``fn`` a value is a torch tensor (the tile interpreter: a whole tile at once, fp32 or
fp64), a CuTe DSL trace value (one accumulator element or pair, fp32), or a sympy expression
(``coda.primitives.symbolic``: one element, exact, for the symbolic proofs). Arithmetic
operators already mean the same thing on all three; the functions here cover the rest: pairs
of adjacent output columns and the transcendentals.

Pairs: in the interpreter a pair is a ``TilePair`` of two tensors (even columns, odd columns)
whose arithmetic is lane-wise, as quack's ``Pair`` is on the GPU. ``unpack`` splits one,
``pack`` builds one.
"""

from __future__ import annotations

import math

import torch

from coda import _quack


class TilePair:
    """(even, odd) lanes of a pair tile; arithmetic applies to both lanes."""

    __slots__ = ("even", "odd")

    def __init__(self, even, odd):
        self.even, self.odd = even, odd

    def _lanes(self, other):
        return (other.even, other.odd) if isinstance(other, TilePair) else (other, other)

    def __add__(self, other):
        e, o = self._lanes(other)
        return TilePair(self.even + e, self.odd + o)

    def __sub__(self, other):
        e, o = self._lanes(other)
        return TilePair(self.even - e, self.odd - o)

    def __rsub__(self, other):
        e, o = self._lanes(other)
        return TilePair(e - self.even, o - self.odd)

    def __mul__(self, other):
        e, o = self._lanes(other)
        return TilePair(self.even * e, self.odd * o)

    def __neg__(self):
        return TilePair(-self.even, -self.odd)

    __radd__ = __add__
    __rmul__ = __mul__

    def interleave(self) -> torch.Tensor:
        """Back to columns: (..., w) lanes -> (..., 2w) with even lane at 2j, odd at 2j+1."""
        return torch.stack([self.even, self.odd], dim=-1).flatten(-2)


def _is_interpreted(x) -> bool:
    return isinstance(x, (torch.Tensor, TilePair))


def _is_symbolic(x) -> bool:
    """A sympy expression (checked by module name: sympy is imported only by the proofs)."""
    return type(x).__module__.startswith("sympy")


def _sympy():
    import sympy

    return sympy


def unpack(pair):
    """(even, odd) halves of a pair value."""
    if isinstance(pair, TilePair):
        return pair.even, pair.odd
    return _quack.unpack(pair)


def pack(even, odd):
    """A pair value from its two halves."""
    if isinstance(even, torch.Tensor) or _is_symbolic(even):
        return TilePair(even, odd)
    return _quack.pack(even, odd)


def exp(x):
    if _is_interpreted(x):
        return torch.exp(x)
    return _sympy().exp(x) if _is_symbolic(x) else _quack.exp(x)


def exp2(x):
    if _is_interpreted(x):
        return torch.exp2(x)
    return 2**x if _is_symbolic(x) else _quack.exp2(x)


def expm1(x):
    """exp(x) - 1, accurate near 0 on every lowering: the interpreter's is torch's, the GPU's
    CUDA's expm1f (within an ulp). exp(x) - 1 near 0 is the difference of two numbers near 1:
    an absolute error of ~1e-7 on a value of the size of x, which xIELU's coefficient
    gradient, a sum of expm1(z) - z ~ z^2 / 2 over small z, turns into a bias (in the CPU model
    of Apertus's protocol it tripled alpha_n's gradient error: NOTES.md, session 77)."""
    if _is_interpreted(x):
        return torch.expm1(x)
    return _sympy().exp(x) - 1 if _is_symbolic(x) else _quack.expm1(x)


def select(cond, a, b):
    """``a`` where ``cond`` holds, else ``b`` (a comparison of values: ``x > 0``); one select
    instruction on the GPU, both sides computed."""
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, a, b)
    if _is_symbolic(cond):
        return _sympy().Piecewise((a, cond), (b, True))
    return _quack.select(cond, a, b)


def sigmoid(x):
    if _is_interpreted(x):
        return torch.sigmoid(x)
    return 1 / (1 + _sympy().exp(-x)) if _is_symbolic(x) else _quack.sigmoid(x)


def silu(x):
    """x * sigmoid(x)."""
    return x * sigmoid(x)


def relu(x):
    """max(x, 0) (on the GPU one max instruction, quack's)."""
    if _is_interpreted(x):
        return torch.relu(x)
    return _sympy().Max(x, 0) if _is_symbolic(x) else _quack.relu(x)


# GELU's tanh form, 0.5 x (1 + tanh(k (x + a x^3))) with k = sqrt(2 / pi), a = 0.044715, is
# x * sigmoid(2 k (x + a x^3)) exactly (tanh(y) = 2 sigmoid(2 y) - 1): one sigmoid, as silu
GELU_TANH_A = 0.044715
GELU_TANH_K2 = 2.0 * math.sqrt(2.0 / math.pi)


def gelu_tanh_gate(x):
    """sigmoid(2 k (x + a x^3)): the gate of GELU's tanh form, gelu_tanh(x) = x times it."""
    return sigmoid(GELU_TANH_K2 * (x + GELU_TANH_A * x * x * x))


def gelu_tanh(x):
    """GELU's tanh approximation (torch's ``gelu(approximate="tanh")``, Gemma's MLP)."""
    return x * gelu_tanh_gate(x)


def gelu_tanh_slope(x, gate):
    """d gelu_tanh / dx given ``gate = gelu_tanh_gate(x)``:
    gate + x gate (1 - gate) 2 k (1 + 3 a x^2)."""
    return gate + x * gate * (1.0 - gate) * GELU_TANH_K2 * (1.0 + 3.0 * GELU_TANH_A * x * x)


# xIELU (Apertus's MLP activation, without a gate; arXiv:2411.13010), with its coefficients
# a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n) already formed:
#   x > 0:  a_p x^2 + beta x
#   x <= 0: a_n (expm1(min(x, eps)) - x) + beta x      (eps < 0: HF's -1e-6)
def xielu(x, a_p, a_n, beta, eps):
    """xIELU of ``x`` in HF's order of operations (``XIELUActivation``'s Python form)."""
    neg = a_n * (expm1(select(x < eps, x, eps)) - x) + beta * x
    return select(x > 0.0, a_p * x * x + beta * x, neg)


def xielu_slope(x, a_p, a_n, beta, eps):
    """d xielu / dx: 2 a_p x + beta for x > 0; a_n (exp(x) - 1) + beta below eps, beta - a_n
    between eps and 0 (where min(x, eps) is the constant)."""
    neg = a_n * (select(x < eps, exp(x), 0.0) - 1.0) + beta
    return select(x > 0.0, 2.0 * a_p * x + beta, neg)


def turns_to_angle(pos, freq_hi, freq_lo):
    """theta = 2 pi * frac(pos * (hi + lo)) in float64: the RoPE angle from a float-float
    frequency in turns, range-reduced exactly. The torch form of the angle the GPU epilogue
    forms (the interpreter's and dRoPE's one home)."""
    turns = pos.double() * (freq_hi.double() + freq_lo.double())
    return 2 * math.pi * torch.remainder(turns, 1.0)


def rotation(pos, freq):
    """(sin, cos) of the RoPE angle theta = pos * inv_freq, for one pair.

    ``freq`` is a pair value holding inv_freq / 2pi as a float-float (hi, lo) split (see
    ``coda.kernels.gemm_rope.rope_freq_table``); the angle is formed in turns so the range
    reduction is exact (on the GPU, quack's float-float sincos). The interpreter computes the
    same angle in float64; the symbolic lowering takes it exactly, as 2 pi pos (hi + lo)."""
    if isinstance(freq, TilePair) and (_is_symbolic(pos) or _is_symbolic(freq.even)):  # exact
        theta = 2 * _sympy().pi * pos * (freq.even + freq.odd)
        return _sympy().sin(theta), _sympy().cos(theta)
    if isinstance(freq, TilePair):
        theta = turns_to_angle(pos, freq.even, freq.odd)
        return theta.sin().to(pos.dtype), theta.cos().to(pos.dtype)
    return _quack.sincos_turns(pos, freq)
