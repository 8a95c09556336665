"""dSwiGLU (or dGeGLU) in the epilogue of the down-projection's dgrad GEMM (KERNELS.md B4 + A6).

    acc = ds = dx2 @ W_d^T       (M x f)
    z = rstd * u                 TILE-LD u (saved unscaled pre-activation, as the GEMM's C,
                                 one (gate, up) pair per output column); VEC-LD COL rstd
    dz_g = ds z_u act'(z_g),  dz_u = ds act(z_g)
        silu:      act' = sig (1 + z_g (1 - sig)),  sig = sigmoid(z_g)
        gelu_tanh: act' = t + z_g t (1 - t) 2 k (1 + 3 a z_g^2),  t = sigmoid(2 k (z_g + a z_g^3))
    D     = rstd * (dz_g, dz_u)  TILE-ST, bf16 M x 2f interleaved ("widen": one value in,
                                 a packed pair out): the A operand of the W_il dgrad (B6) and
                                 the B operand of its wgrad (B7)
    s     = act(z_g) z_u         TILE-ST, recomputed: the operand of the W_d wgrad (B5)
    S[m, t] = sum (dz_g u_g + dz_u u_u)   RED_m: the norm-backward statistic, one GEMM early
AUX:  corr = -(rstd^3 / d) * sum_t S       (``coda.kernels.rmsnorm_bwd.norm_corr``)

Without a gate (``UNGATED``: relu(z)^2, xIELU), u is M x f and, per column (element mode):
    dz = acc act'(z);  D = rstd dz;  s = act(z);  S[m, t] = sum dz u
xIELU's learned coefficients take their gradients as two more row partials:
    P[m, t] = sum acc z^2 [z > 0]                   (d loss / d a_p)
    N[m, t] = sum acc (expm1(min(z, eps)) - z) [z <= 0]   (d loss / d a_n)

Supported: bf16; f a multiple of 8. Tests: tests/test_backward_kernels.py, tests/test_geglu.py.
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.gemm_swiglu import PARAMETRIZED, UNGATED, XIELU_OPERANDS, act_operands
from coda.primitives import (
    ColLoad,
    DeviceScalar,
    RowPartials,
    TileC,
    TileStore,
    epilogue_program,
    expm1,
    gelu_tanh_gate,
    gelu_tanh_slope,
    pack,
    relu,
    select,
    sigmoid,
    unpack,
    xielu,
    xielu_slope,
)
from coda.reference.swiglu import dswiglu_ref  # noqa: F401  (the kernel's reference)

# both programs' declaration: the saved pairs (as C) and rstd in; the pair gradient (D, a
# packed pair per input value), the recomputed s and the norm statistic's partials out
_DGLU = {
    "inputs": [TileC(), ColLoad("rstd")],
    "stores": [TileStore("s")],
    "sinks": [RowPartials("stat")],
    "mode": "widen",
}


@epilogue_program(**_DGLU)
def dswiglu_rescaled(acc, c, rstd):
    ug, uu = unpack(c)
    zg, zu = ug * rstd, uu * rstd
    sig = sigmoid(zg)
    silu_g = zg * sig
    dzg = acc * zu * sig * (1.0 + zg * (1.0 - sig))
    dzu = acc * silu_g
    return {"D": pack(dzg * rstd, dzu * rstd), "s": silu_g * zu, "stat": dzg * ug + dzu * uu}


@epilogue_program(**_DGLU)
def dgeglu_rescaled(acc, c, rstd):
    ug, uu = unpack(c)
    zg, zu = ug * rstd, uu * rstd
    gate = gelu_tanh_gate(zg)
    gelu_g = zg * gate
    dzg = acc * zu * gelu_tanh_slope(zg, gate)
    dzu = acc * gelu_g
    return {"D": pack(dzg * rstd, dzu * rstd), "s": gelu_g * zu, "stat": dzg * ug + dzu * uu}


@epilogue_program(
    inputs=[TileC(), ColLoad("rstd")], stores=[TileStore("s")], sinks=[RowPartials("stat")]
)
def drelu2_rescaled(acc, c, rstd):  # (no gate: u is one column per output column)
    r = relu(c * rstd)
    dz = acc * 2.0 * r
    return {"D": dz * rstd, "s": r * r, "stat": dz * c}


@epilogue_program(
    inputs=[TileC(), ColLoad("rstd"), *map(DeviceScalar, XIELU_OPERANDS)],
    stores=[TileStore("s")],
    sinks=[RowPartials("stat"), RowPartials("d_ap"), RowPartials("d_an")],
)
def dxielu_rescaled(acc, c, rstd, a_p, a_n, beta, eps):
    z = c * rstd
    dz = acc * xielu_slope(z, a_p, a_n, beta, eps)
    pos = z > 0.0  # (the coefficients' terms: z^2 above 0, expm1(min(z, eps)) - z below)
    neg = expm1(select(z < eps, z, eps)) - z  # (shared with xielu's by the compiler's CSE)
    return {
        "D": dz * rstd,
        "s": xielu(z, a_p, a_n, beta, eps),
        "stat": dz * c,
        "d_ap": select(pos, acc * z * z, 0.0),
        "d_an": select(pos, 0.0, acc * neg),
    }


_PROGRAMS = {
    "silu": dswiglu_rescaled,
    "gelu_tanh": dgeglu_rescaled,
    "relu2": drelu2_rescaled,
    "xielu": dxielu_rescaled,
}


def program_for(activation: str = "silu"):
    """B4's program for the MLP's gated ``activation`` (``gemm_swiglu.ACTIVATIONS``)."""
    return _PROGRAMS[activation]


def dswiglu_kernel(
    dx, w_d, u, rstd, config: GemmConfig = DEFAULT, dry=False, activation="silu", act=None
):
    """acc = dx @ w_d^T; returns (dz_tilde M x 2f, s M x f, stat partials M x T_N), and for a
    parametrized activation (``act``: xIELU's numbers) its coefficients' gradient partials
    (2, M, T_N) last. ``w_d`` is the (f, d) down-projection weight; its transpose is a view."""
    M, f = dx.shape[0], w_d.shape[0]
    dz = torch.empty_like(u)
    partials = (M, config.grid(M, f)[1])
    outputs = {"s": dx.new_empty(M, f), "stat": dx.new_empty(partials, dtype=acc_dtype(dx))}
    coef = None
    if activation in PARAMETRIZED:
        coef = dx.new_empty((2, *partials), dtype=acc_dtype(dx))
        outputs.update(d_ap=coef[0], d_an=coef[1])
    compiled = launch(
        program_for(activation),
        dx,
        w_d.t(),
        config=config,
        d=dz,
        c=u,
        operands={"rstd": rstd, **act_operands(activation, act)},
        outputs=outputs,
        dry=dry,
    )
    if dry:
        return compiled
    out = (dz, outputs["s"], outputs["stat"])
    return out if coef is None else (*out, coef)


def dswiglu_interpreted(
    dx, w_d, u, rstd, config: GemmConfig = DEFAULT, activation="silu", act=None
):
    operands = {"c": u, "rstd": rstd, **act_operands(activation, act)}
    out = interpret_gemm(program_for(activation), dx, w_d.t(), config=config, operands=operands)
    res = (out["D"], out["s"], out["stat"])
    return (*res, torch.stack([out["d_ap"], out["d_an"]])) if activation in PARAMETRIZED else res


def compile_dswiglu(d, f, *, config=DEFAULT, m=256, activation="silu") -> int:
    dx, w_dt = example_operands(m, d, f, "k")  # w_d^T of a row-major (f, d) weight: k-major
    u = torch.empty(m, f if activation in UNGATED else 2 * f, dtype=torch.bfloat16)
    act = torch.empty(4) if activation in PARAMETRIZED else None
    return dswiglu_kernel(dx, w_dt.t(), u, torch.empty(m), config, True, activation, act)
