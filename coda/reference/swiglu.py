"""Pure-torch references for SwiGLU on interleaved gate/up columns (KERNELS.md 3.1, 5.1).

Layouts (weights stored (in, out)): the standard ``W_gu = [W_gate | W_up]`` (d x 2f) and coda's
interleaved ``W_il`` with ``W_il[:, 2j] = W_gate[:, j]``, ``W_il[:, 2j+1] = W_up[:, j]``, so a
gate/up pair is two adjacent output columns of one GEMM tile.

- F4 epilogue:  u = a @ W_il (saved, unscaled); z = r * u; s_j = silu(z_2j) * z_2j+1
- B4 epilogue:  acc = ds = dx @ W_d^T; z = r * u; sigma = sigmoid(z_g);
                dz_g = ds * z_u * sigma * (1 + z_g (1 - sigma)); dz_u = ds * silu(z_g);
                writes s (recomputed), dz~ = r * (dz_g, dz_u) interleaved, and
                S1 = sum_pairs (dz_g u_g + dz_u u_u) for the norm backward.
"""

from __future__ import annotations

import torch

from coda.reference.rmsnorm import ref_dtype


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Standard SwiGLU: silu(gate) * up."""
    return torch.nn.functional.silu(gate) * up


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


def gemm_swiglu_ref(a, w_il, r):
    """F4: returns (s, u) with u = a @ w_il (unscaled), s = SwiGLU of r * u's pairs."""
    dt = ref_dtype(a, w_il)
    u = a.to(dt) @ w_il.to(dt)
    z = r.to(dt)[:, None] * u
    return swiglu_ref(z[:, 0::2], z[:, 1::2]), u


def dswiglu_ref(ds, u, r):
    """B4: returns (s, dz_tilde, S) given ds (M x f), saved u (M x 2f), r (M,)."""
    r = r[:, None]
    ug, uu = u[:, 0::2], u[:, 1::2]
    zg, zu = r * ug, r * uu
    sig = torch.sigmoid(zg)
    silu = zg * sig
    dzg = ds * zu * sig * (1 + zg * (1 - sig))
    dzu = ds * silu
    dz_tilde = torch.stack([r * dzg, r * dzu], dim=-1).flatten(-2)
    S = (dzg * ug + dzu * uu).sum(-1)
    return silu * zu, dz_tilde, S


def gemm_swiglu_torch(a, w_il, r):
    """The plain PyTorch path in the inputs' dtype: normalize, project, SwiGLU, each rounded."""
    y = (a.float() * r[:, None]).to(a.dtype)
    gu = y @ w_il
    return swiglu_ref(gu[:, 0::2], gu[:, 1::2])
