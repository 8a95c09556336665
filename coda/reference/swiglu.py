"""Pure-torch references for SwiGLU, and GeGLU (Gemma's gated GELU, tanh form), on
interleaved gate/up columns (KERNELS.md 3.1, 5.1).

Layouts (weights stored (in, out)): the standard ``W_gu = [W_gate | W_up]`` (d x 2f) and coda's
interleaved ``W_il`` with ``W_il[:, 2j] = W_gate[:, j]``, ``W_il[:, 2j+1] = W_up[:, j]``, so a
gate/up pair is two adjacent output columns of one GEMM tile.

- F4 epilogue:  u = a @ W_il (saved, unscaled); z = r * u; s_j = act(z_2j) * z_2j+1
- B4 epilogue:  acc = ds = dx @ W_d^T; z = r * u;
                dz_g = ds * z_u * act'(z_g); dz_u = ds * act(z_g);
                writes s (recomputed), dz~ = r * (dz_g, dz_u) interleaved, and
                S1 = sum_pairs (dz_g u_g + dz_u u_u) for the norm backward.

``act`` is silu (``activation="silu"``) or GELU's tanh form (``"gelu_tanh"``); the references
take each in its textbook form (torch's ``gelu(approximate="tanh")`` and the derivative of
0.5 x (1 + tanh(k (x + a x^3)))), not the kernels' sigmoid form of it.

An MLP without a gate (``UNGATED``: Arcee's ``"relu2"``, relu(x)^2) has W_il = W_up (d x f):
s = act(r u) per column, and in B4 dz = ds act'(z), dz~ = r dz, S1 = sum dz u.
"""

from __future__ import annotations

import math

import torch

from coda.reference.rmsnorm import ref_dtype


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Standard SwiGLU: silu(gate) * up."""
    return torch.nn.functional.silu(gate) * up


def geglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU with GELU's tanh form (Gemma's MLP): gelu_tanh(gate) * up."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


GLU_REFS = {"silu": swiglu_ref, "gelu_tanh": geglu_ref}


def relu2_ref(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, relu(x)^2 (HF's "relu2": Arcee's MLP, without a gate)."""
    return torch.relu(x).square()


UNGATED_REFS = {"relu2": relu2_ref}


def mlp_activation_ref(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP's activation of its input projection's output: gated (``GLU_REFS``, on
    interleaved gate/up columns) or not (``UNGATED_REFS``, column by column)."""
    if activation in UNGATED_REFS:
        return UNGATED_REFS[activation](gu)
    return GLU_REFS[activation](gu[..., 0::2], gu[..., 1::2])


def _activation_and_slope(x, activation: str):
    """(act(x), act'(x)) in their textbook forms."""
    if activation == "relu2":
        return torch.relu(x).square(), 2 * torch.relu(x)
    if activation == "silu":
        sig = torch.sigmoid(x)
        return x * sig, sig * (1 + x * (1 - sig))
    k, a = math.sqrt(2 / math.pi), 0.044715
    t = torch.tanh(k * (x + a * x**3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * a * x * x)


def interleave_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """(in, f) gate and up weights -> (in, 2f) interleaved: column 2j gate j, 2j+1 up j."""
    return torch.stack([w_gate, w_up], dim=-1).flatten(-2)


def split_gate_up(w_il: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_gate_up`` (strided views: gate = even, up = odd columns)."""
    return w_il[..., 0::2], w_il[..., 1::2]


def interleave_gate_up_linear(gate_w: torch.Tensor, up_w: torch.Tensor) -> torch.Tensor:
    """nn.Linear form: (f, d) gate_proj.weight, up_proj.weight -> (2f, d) interleaved rows."""
    return torch.stack([gate_w, up_w], dim=1).reshape(-1, gate_w.shape[-1])


def split_gate_up_linear(w_il_lin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_gate_up_linear``."""
    g, u = w_il_lin.view(-1, 2, w_il_lin.shape[-1]).unbind(1)
    return g, u


def gemm_swiglu_ref(a, w_il, r, activation: str = "silu"):
    """F4: returns (s, u) with u = a @ w_il (unscaled), s = the gated activation of r * u's
    pairs."""
    dt = ref_dtype(a, w_il)
    u = a.to(dt) @ w_il.to(dt)
    z = r.to(dt)[:, None] * u
    return mlp_activation_ref(z, activation), u


def dswiglu_ref(ds, u, r, activation: str = "silu"):
    """B4: returns (s, dz_tilde, S) given ds (M x f), saved u (M x 2f; M x f without a
    gate), r (M,)."""
    r = r[:, None]
    if activation in UNGATED_REFS:
        act, slope = _activation_and_slope(r * u, activation)
        dz = ds * slope
        return act, r * dz, (dz * u).sum(-1)
    ug, uu = u[:, 0::2], u[:, 1::2]
    zg, zu = r * ug, r * uu
    act, slope = _activation_and_slope(zg, activation)
    dzg = ds * zu * slope
    dzu = ds * act
    dz_tilde = torch.stack([r * dzg, r * dzu], dim=-1).flatten(-2)
    S = (dzg * ug + dzu * uu).sum(-1)
    return act * zu, dz_tilde, S


def gemm_swiglu_torch(a, w_il, r, activation: str = "silu"):
    """The plain PyTorch path in the inputs' dtype: normalize, project, activate, each
    rounded."""
    y = (a.float() * r[:, None]).to(a.dtype)
    return mlp_activation_ref(y @ w_il, activation)
