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

An MLP without a gate (``UNGATED``: Arcee's ``"relu2"``, relu(x)^2; Apertus's ``"xielu"``) has
W_il = W_up (d x f): s = act(r u) per column, and in B4 dz = ds act'(z), dz~ = r dz,
S1 = sum dz u. xIELU has numbers of its own, ``act`` = (a_p, a_n, beta, eps) (``xielu_act``
forms them from HF's parameters), a_p and a_n learned: B4 also gives their gradients.
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


def xielu_act(alpha_p, alpha_n, beta, eps) -> torch.Tensor:
    """xIELU's numbers (a_p, a_n, beta, eps) as one (4,) tensor, from HF's
    ``XIELUActivation`` parameters ``alpha_p``, ``alpha_n`` ((1,) each) and buffers ``beta``,
    ``eps`` (0-dim): a_p = softplus(alpha_p), a_n = beta + softplus(alpha_n), as its forward
    forms them, in fp32 (float64 for float64 parameters); differentiable in alpha_p and
    alpha_n, beta and eps held constant (HF's buffers)."""
    dt = torch.float64 if alpha_p.dtype == torch.float64 else torch.float32
    beta, eps = beta.detach().to(dt).reshape(1), eps.detach().to(dt).reshape(1)
    sp = torch.nn.functional.softplus
    a_p, a_n = sp(alpha_p.to(dt)).reshape(1), beta + sp(alpha_n.to(dt)).reshape(1)
    return torch.cat([a_p, a_n, beta, eps])


def xielu_ref(x: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
    """xIELU (Apertus's MLP activation, without a gate) as HF's ``XIELUActivation`` computes
    it: a_p x^2 + beta x for x > 0, else a_n (expm1(min(x, eps)) - x) + beta x; ``act`` =
    (a_p, a_n, beta, eps) (``xielu_act``)."""
    a_p, a_n, beta, eps = act.unbind()
    neg = (torch.expm1(torch.minimum(x, eps)) - x) * a_n + beta * x
    return torch.where(x > 0, a_p * x * x + beta * x, neg)


UNGATED_REFS = {"relu2": relu2_ref, "xielu": xielu_ref}
# the activations with numbers of their own (``act``)
PARAMETRIZED_REFS = ("xielu",)


def mlp_activation_ref(gu: torch.Tensor, activation: str, act=None) -> torch.Tensor:
    """The MLP's activation of its input projection's output: gated (``GLU_REFS``, on
    interleaved gate/up columns) or not (``UNGATED_REFS``, column by column); ``act``: the
    numbers of an activation that has them (xIELU's)."""
    if activation in PARAMETRIZED_REFS:
        return UNGATED_REFS[activation](gu, act)
    if activation in UNGATED_REFS:
        return UNGATED_REFS[activation](gu)
    return GLU_REFS[activation](gu[..., 0::2], gu[..., 1::2])


def _activation_and_slope(x, activation: str, act=None):
    """(act(x), act'(x)) in their textbook forms."""
    if activation == "relu2":
        return torch.relu(x).square(), 2 * torch.relu(x)
    if activation == "xielu":
        a_p, a_n, beta, eps = act.unbind()
        below = torch.where(x < eps, torch.exp(x), torch.zeros_like(x))
        slope = torch.where(x > 0, 2 * a_p * x + beta, a_n * (below - 1) + beta)
        return xielu_ref(x, act), slope
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


def gemm_swiglu_ref(a, w_il, r, activation: str = "silu", act=None):
    """F4: returns (s, u) with u = a @ w_il (unscaled), s = the gated activation of r * u's
    pairs."""
    dt = ref_dtype(a, w_il)
    u = a.to(dt) @ w_il.to(dt)
    z = r.to(dt)[:, None] * u
    return mlp_activation_ref(z, activation, None if act is None else act.to(dt)), u


def dswiglu_ref(ds, u, r, activation: str = "silu", act=None):
    """B4: returns (s, dz_tilde, S) given ds (M x f), saved u (M x 2f; M x f without a
    gate), r (M,); with xIELU's numbers ``act``, also the gradients of a_p and a_n (2,)."""
    r = r[:, None]
    if activation in UNGATED_REFS:
        z = r * u
        s, slope = _activation_and_slope(z, activation, act)
        dz = ds * slope
        out = (s, r * dz, (dz * u).sum(-1))
        if activation not in PARAMETRIZED_REFS:
            return out
        a_p, a_n, beta, eps = act.unbind()
        d_ap = (ds * torch.where(z > 0, z * z, torch.zeros_like(z))).sum()
        neg = torch.expm1(torch.minimum(z, eps)) - z
        d_an = (ds * torch.where(z > 0, torch.zeros_like(z), neg)).sum()
        return (*out, torch.stack([d_ap, d_an]))
    ug, uu = u[:, 0::2], u[:, 1::2]
    zg, zu = r * ug, r * uu
    act, slope = _activation_and_slope(zg, activation)
    dzg = ds * zu * slope
    dzu = ds * act
    dz_tilde = torch.stack([r * dzg, r * dzu], dim=-1).flatten(-2)
    S = (dzg * ug + dzu * uu).sum(-1)
    return act * zu, dz_tilde, S


def gemm_swiglu_torch(a, w_il, r, activation: str = "silu", act=None):
    """The plain PyTorch path in the inputs' dtype: normalize, project, activate, each
    rounded."""
    y = (a.float() * r[:, None]).to(a.dtype)
    act = None if act is None else act.to(a.dtype)
    return mlp_activation_ref(y @ w_il, activation, act)
