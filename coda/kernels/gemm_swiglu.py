"""GEMM2 of the MLP boundary: gate/up projection + deferred row scale + a gated activation
(KERNELS.md F4): SwiGLU, or GeGLU (Gemma's MLP: GELU's tanh form in place of silu).

    acc = a @ W_il            a = h * gamma (from GEMM1), W_il gate/up interleaved (d x 2f)
    u   = acc                 TILE-ST (optional, bf16): the unscaled pre-activation for backward
    z   = rstd * acc          VEC-LD COL rstd (the norm's deferred row scale)
    s_j = act(z_2j) z_2j+1    EW pairwise (gate at even, up at odd columns); TILE-ST s (M x f)
                              act = silu, or gelu_tanh(x) = x sigmoid(2 k (x + a x^3))

Without a gate (``UNGATED``: Arcee's MLP, relu(x)^2; Apertus's, xIELU), W_il = W_up (d x f)
and, per column,
    s = relu(rstd acc)^2       EW (element mode); TILE-ST s (M x f), u = acc (M x f)
    s = xielu(rstd acc)        xIELU's four numbers (a_p, a_n, beta, eps) as DeviceScalars:
                               a_p, a_n are learned, formed on the GPU (``XIELU_OPERANDS``)

Supported: bf16, K and 2f multiples of 8, tile_n a multiple of 32 (quack's SM90 rule for a
half-width pair store); any M. Compile key: program, dtypes, majors, GemmConfig.
Tests: tests/test_forward_kernels.py, tests/test_geglu.py.
"""

from __future__ import annotations

import torch

from coda.kernels._launch import example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.primitives import (
    ColLoad,
    DeviceScalar,
    TileStore,
    epilogue_program,
    gelu_tanh,
    relu,
    silu,
    unpack,
    xielu,
)
from coda.reference.swiglu import gemm_swiglu_ref  # noqa: F401  (the op's reference)

# one declaration for every gated program: rstd in, s out, a (gate, up) pair per column.
# Each program is its own module-level function, not one made per activation by a factory:
# quack keys its compile cache on the fn's source and the globals it names, not on a
# closure's values, so two programs must differ in their source
_GLU = {"inputs": [ColLoad("rstd")], "stores": [TileStore("s")], "mode": "pair"}


@epilogue_program(**_GLU)
def swiglu_keep_preact(acc, rstd):
    g, u = unpack(acc * rstd)
    return {"D": acc, "s": silu(g) * u}


@epilogue_program(**_GLU, writes_d=False)
def swiglu_only(acc, rstd):
    g, u = unpack(acc * rstd)
    return {"s": silu(g) * u}


@epilogue_program(**_GLU)
def geglu_keep_preact(acc, rstd):
    g, u = unpack(acc * rstd)
    return {"D": acc, "s": gelu_tanh(g) * u}


@epilogue_program(**_GLU, writes_d=False)
def geglu_only(acc, rstd):
    g, u = unpack(acc * rstd)
    return {"s": gelu_tanh(g) * u}


# an MLP without a gate: one column in, one out (``"relu2"``: Arcee's squared ReLU)
_ACT = {"inputs": [ColLoad("rstd")], "stores": [TileStore("s")]}


@epilogue_program(**_ACT)
def relu2_keep_preact(acc, rstd):
    r = relu(acc * rstd)
    return {"D": acc, "s": r * r}


@epilogue_program(**_ACT, writes_d=False)
def relu2_only(acc, rstd):
    r = relu(acc * rstd)
    return {"s": r * r}


# xIELU (Apertus's): its coefficients a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n)
# and constants beta, eps, each read by the kernel from one fp32 element (``act_operands``)
XIELU_OPERANDS = ("a_p", "a_n", "beta", "eps")
_XIELU = {
    "inputs": [ColLoad("rstd"), *map(DeviceScalar, XIELU_OPERANDS)],
    "stores": [TileStore("s")],
}


@epilogue_program(**_XIELU)
def xielu_keep_preact(acc, rstd, a_p, a_n, beta, eps):
    return {"D": acc, "s": xielu(acc * rstd, a_p, a_n, beta, eps)}


@epilogue_program(**_XIELU, writes_d=False)
def xielu_only(acc, rstd, a_p, a_n, beta, eps):
    return {"s": xielu(acc * rstd, a_p, a_n, beta, eps)}


# the gated activations (``activation=`` of the ops, the MLP Function and ``DecoderLayer``)
ACTIVATIONS = ("silu", "gelu_tanh")
# the MLP activations without a gate (the MLP Function's and ``DecoderLayer``'s, whose W_il is
# then W_up, d x f)
UNGATED = ("relu2", "xielu")
# the activations with parameters: their kernels take ``act``, a (4,) fp32 tensor of
# (a_p, a_n, beta, eps) (``act_operands``)
PARAMETRIZED = ("xielu",)
MLP_ACTIVATIONS = ACTIVATIONS + UNGATED
_PROGRAMS = {
    ("silu", True): swiglu_keep_preact,
    ("silu", False): swiglu_only,
    ("gelu_tanh", True): geglu_keep_preact,
    ("gelu_tanh", False): geglu_only,
    ("relu2", True): relu2_keep_preact,
    ("relu2", False): relu2_only,
    ("xielu", True): xielu_keep_preact,
    ("xielu", False): xielu_only,
}


def act_width(n: int, activation: str) -> int:
    """s's width for an input projection of ``n`` columns: n / 2 gated (a pair a column of
    s), n without a gate."""
    return n if activation in UNGATED else n // 2


def act_operands(activation: str, act) -> dict:
    """The kernel operands of a parametrized activation's numbers ``act`` (xIELU's: a
    contiguous (4,) fp32 tensor, one one-element view each; none for the others)."""
    if activation not in PARAMETRIZED:
        return {}
    if act is None or act.shape != (len(XIELU_OPERANDS),):
        got = None if act is None else tuple(act.shape)
        raise ValueError(f"activation {activation!r}: act must be its (4,) numbers, got {got}")
    return {name: act[i : i + 1] for i, name in enumerate(XIELU_OPERANDS)}


def program_for(save_preact: bool, activation: str = "silu"):
    """F4's program for ``activation``, storing the pre-activations (``save_preact``) or not."""
    return _PROGRAMS[activation, save_preact]


def gemm_swiglu_kernel(
    a,
    w_il,
    rstd,
    save_preact=True,
    config: GemmConfig = DEFAULT,
    dry=False,
    activation="silu",
    act=None,
):
    """Returns (s (M x f), u (M x 2f) or None); with ``dry`` only compiles. ``act``: a
    parametrized activation's numbers (``act_operands``)."""
    M, n2 = a.shape[0], w_il.shape[1]
    s = a.new_empty(M, act_width(n2, activation))
    u = a.new_empty(M, n2) if save_preact else None
    compiled = launch(
        program_for(save_preact, activation),
        a,
        w_il,
        config=config,
        d=u,
        operands={"rstd": rstd, **act_operands(activation, act)},
        outputs={"s": s},
        dry=dry,
    )
    return compiled if dry else (s, u)


def gemm_swiglu_interpreted(
    a, w_il, rstd, config: GemmConfig = DEFAULT, activation="silu", act=None
):
    program = program_for(True, activation)
    operands = {"rstd": rstd, **act_operands(activation, act)}
    out = interpret_gemm(program, a, w_il, config=config, operands=operands)
    return out["s"], out["D"]


def compile_gemm_swiglu(
    k, n2, *, save_preact, w_major="n", config=DEFAULT, m=256, activation="silu"
) -> int:
    a, w = example_operands(m, k, n2, w_major)
    act = torch.empty(4) if activation in PARAMETRIZED else None
    return gemm_swiglu_kernel(a, w, torch.empty(m), save_preact, config, True, activation, act)
