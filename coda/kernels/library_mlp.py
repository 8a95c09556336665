"""The MLP boundary's launches as ``torch.library`` custom ops (``coda.kernels.library``'s
conventions: a fake implementation per op, eager calls straight to the kernel function): F4,
the input projection with its activation in the epilogue (storing the pre-activation for a
backward or not), and B4, the activation's gradient in the down projection's dgrad epilogue.
``act`` names the activation (``gemm_swiglu.MLP_ACTIVATIONS``); ``params``, for one with
numbers of its own (xIELU's (4,) fp32 tensor: ``gemm_swiglu.act_operands``), else None. B4 of
such an activation is its own op (``dxielu``): it also returns its coefficients' gradient
partials. Re-exported by ``coda.kernels.library``, whose ``OPS`` lists them."""

from __future__ import annotations

import torch

from coda.kernels import dswiglu as _dsw
from coda.kernels import gemm_swiglu as _sw
from coda.kernels._launch import acc_dtype
from coda.kernels._triton import cdiv
from coda.kernels.op_support import config_ints as _cfg
from coda.kernels.op_support import config_of as _gc
from coda.kernels.op_support import either as _either
from coda.kernels.op_support import library_fake as _fake
from coda.kernels.op_support import new_empty as _empty


@torch.library.custom_op("coda::gemm_swiglu", mutates_args=())
def _gemm_swiglu(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    cfg: list[int],
    act: str,
    params: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _sw.gemm_swiglu_kernel(a, w, rstd, True, _gc(cfg), activation=act, act=params)


@_fake(_gemm_swiglu)
def _(a, w, rstd, cfg, act, params=None):
    M, N = a.shape[0], w.shape[1]
    return _empty(M, _sw.act_width(N, act), like=a), _empty(M, N, like=a)


@torch.library.custom_op("coda::gemm_swiglu_only", mutates_args=())
def _gemm_swiglu_only(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    cfg: list[int],
    act: str,
    params: torch.Tensor | None = None,
) -> torch.Tensor:
    return _sw.gemm_swiglu_kernel(a, w, rstd, False, _gc(cfg), activation=act, act=params)[0]


@_fake(_gemm_swiglu_only)
def _(a, w, rstd, cfg, act, params=None):
    return _empty(a.shape[0], _sw.act_width(w.shape[1], act), like=a)


def _dswiglu_fake(dx, w_d, u, rstd, cfg):
    M, f = dx.shape[0], w_d.shape[0]
    stat = _empty(M, cdiv(f, cfg[1]), like=dx, dtype=acc_dtype(dx))
    return torch.empty_like(u), _empty(M, f, like=dx), stat


@torch.library.custom_op("coda::dswiglu", mutates_args=())
def _dswiglu(
    dx: torch.Tensor,
    w_d: torch.Tensor,
    u: torch.Tensor,
    rstd: torch.Tensor,
    cfg: list[int],
    act: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _dsw.dswiglu_kernel(dx, w_d, u, rstd, _gc(cfg), activation=act)


@_fake(_dswiglu)
def _(dx, w_d, u, rstd, cfg, act):
    return _dswiglu_fake(dx, w_d, u, rstd, cfg)


@torch.library.custom_op("coda::dxielu", mutates_args=())
def _dxielu(
    dx: torch.Tensor,
    w_d: torch.Tensor,
    u: torch.Tensor,
    rstd: torch.Tensor,
    params: torch.Tensor,
    cfg: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _dsw.dswiglu_kernel(dx, w_d, u, rstd, _gc(cfg), activation="xielu", act=params)


@_fake(_dxielu)
def _(dx, w_d, u, rstd, params, cfg):
    dz, s, stat = _dswiglu_fake(dx, w_d, u, rstd, cfg)
    return dz, s, stat, _empty(2, *stat.shape, like=stat)


gemm_swiglu = _either(  # act: the MLP's activation; params: its numbers (xIELU's) or None
    lambda a, w, r, c, act="silu", params=None: _gemm_swiglu(a, w, r, _cfg(c), act, params),
    lambda a, w, r, c, act="silu", params=None: _sw.gemm_swiglu_kernel(
        a, w, r, True, c, activation=act, act=params
    ),
)
gemm_swiglu_only = _either(
    lambda a, w, r, c, act="silu", params=None: _gemm_swiglu_only(a, w, r, _cfg(c), act, params),
    lambda a, w, r, c, act="silu", params=None: _sw.gemm_swiglu_kernel(
        a, w, r, False, c, activation=act, act=params
    )[0],
)
dswiglu = _either(
    lambda dx, w, u, r, c, act="silu": _dswiglu(dx, w, u, r, _cfg(c), act),
    lambda dx, w, u, r, c, act="silu": _dsw.dswiglu_kernel(dx, w, u, r, c, activation=act),
)
# xIELU's B4: (dz_tilde, s, stat partials, its coefficients' gradient partials (2, M, T_N))
dxielu = _either(
    lambda dx, w, u, r, p, c: _dxielu(dx, w, u, r, p, _cfg(c)),
    lambda dx, w, u, r, p, c: _dsw.dswiglu_kernel(dx, w, u, r, c, activation="xielu", act=p),
)
