"""The LM head's launches as ``torch.library`` custom ops (``coda.kernels.library``'s
conventions: a fake implementation per op, eager calls straight to the kernel function): F6's
statistics (CE-A's forward, optionally of soft-capped logits), CE-A's recompute backward
(B1 + B3 + B2), and the two programs that form their gradients in the forward (CE-C, CE-S).
Re-exported by ``coda.kernels.library``, whose ``OPS`` lists them."""

from __future__ import annotations

import torch

from coda.kernels import ce_scaled_exp as _cse
from coda.kernels import linear_cross_entropy as _lce
from coda.kernels import linear_cross_entropy_bwd as _ceb
from coda.kernels import linear_cross_entropy_chunked as _cec
from coda.kernels._launch import acc_dtype
from coda.kernels._triton import cdiv
from coda.kernels.op_support import config_ints as _cfg
from coda.kernels.op_support import config_of as _gc
from coda.kernels.op_support import either as _either
from coda.kernels.op_support import library_fake as _fake
from coda.kernels.op_support import new_empty as _empty


@torch.library.custom_op("coda::lm_head_stats", mutates_args=())
def _lm_head_stats(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    target: torch.Tensor,
    cfg: list[int],
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _lce.lm_head_stats_kernel(a, w, rstd, target, _gc(cfg), softcap=softcap)


@_fake(_lm_head_stats)
def _(a, w, rstd, target, cfg, softcap):
    M, acc = a.shape[0], acc_dtype(a)
    return _empty(M, cdiv(w.shape[1], cfg[1]), like=a, dtype=acc), _empty(M, like=a, dtype=acc)


@torch.library.custom_op("coda::lm_head_bwd", mutates_args=())
def _lm_head_bwd(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    lse: torch.Tensor,
    tl: torch.Tensor,
    target: torch.Tensor,
    scale: torch.Tensor,
    chunk: int,
    cfg: list[int],
    hot: torch.Tensor | None,
    shift: torch.Tensor | None,
    want_dw: bool,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    G, S, dw = _ceb.linear_cross_entropy_bwd_kernel(
        a, w, rstd, lse, tl, target, scale, chunk, _gc(cfg), hot=hot, shift=shift,
        want_dw=want_dw, softcap=softcap,
    )  # fmt: skip
    return G, S, dw


@_fake(_lm_head_bwd)
def _(a, w, rstd, lse, tl, target, scale, chunk, cfg, hot, shift, want_dw, softcap):
    M, d, V, acc = a.shape[0], a.shape[1], w.shape[1] if want_dw else 0, acc_dtype(a)
    dw = _empty(V, d, like=a).t() if want_dw and _ceb.vocab_rows(w) else _empty(d, V, like=a)
    return _empty(M, d, like=a, dtype=acc), _empty(M, like=a, dtype=acc), dw


def _lm_head_gradients_fake(
    a, w, rstd, target, weight, rows, cfg, label_smoothing, z_loss, want_dw, softcap=None
):
    """The fake of an LM-head gradients op: dW is the fp32 accumulator, a (d, V) view of
    (V, d) storage (both programs scatter-add the target entries into its rows); (d, 0)
    without ``want_dw``."""
    M, d, acc = a.shape[0], a.shape[1], acc_dtype(a)
    stat = _empty(M, like=a, dtype=acc)
    dw = _empty(w.shape[1] if want_dw else 0, w.shape[0], like=a, dtype=acc).t()
    g = _empty(M, d, like=a, dtype=acc)
    return stat, torch.empty_like(stat), g, torch.empty_like(stat), torch.empty_like(stat), dw


def _lm_head_gradients_op(name: str, program):
    """The custom op of an LM-head program that forms its g = 1 gradients in the forward
    (CE-C, CE-S): (lse, target logit, G, coef, S, dW fp32) with one schema: G the softmax
    share of dL/da, coef its target entries' coefficient per row."""

    @torch.library.custom_op(f"coda::{name}", mutates_args=())
    def op(
        a: torch.Tensor,
        w: torch.Tensor,
        rstd: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor,
        rows: int,
        cfg: list[int],
        label_smoothing: float,
        z_loss: float,
        want_dw: bool,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg_ = _gc(cfg)
        options = {"label_smoothing": label_smoothing, "z_loss": z_loss, "want_dw": want_dw}
        if softcap is not None:  # (CE-S's capped program; CE-C takes none: ``check_softcap``)
            options["softcap"] = softcap
        return program(a, w, rstd, target, weight, rows, cfg_, **options)

    _fake(op)(_lm_head_gradients_fake)
    return op


_lm_head_chunked = _lm_head_gradients_op("lm_head_chunked", _cec.linear_cross_entropy_chunked)
_lm_head_scaled = _lm_head_gradients_op("lm_head_scaled", _cse.linear_cross_entropy_scaled)


# -- what the autograd Functions call --------------------------------------------------------
lm_head_stats = _either(  # softcap: the logits' soft-cap c, or None
    lambda a, w, r, t, c, softcap=None: _lm_head_stats(a, w, r, t, _cfg(c), softcap),
    lambda a, w, r, t, c, softcap=None: _lce.lm_head_stats_kernel(a, w, r, t, c, softcap=softcap),
)
lm_head_bwd = _either(
    lambda a, w, r, lse, tl, t, s, chunk, c, hot=None, shift=None, want_dw=True, softcap=None: (
        _lm_head_bwd(a, w, r, lse, tl, t, s, chunk, _cfg(c), hot, shift, want_dw, softcap)
    ),
    lambda a, w, r, lse, tl, t, s, chunk, c, hot=None, shift=None, want_dw=True, softcap=None: (
        _ceb.linear_cross_entropy_bwd_kernel(
            a,
            w,
            r,
            lse,
            tl,
            t,
            s,
            chunk,
            c,
            hot=hot,
            shift=shift,
            want_dw=want_dw,
            softcap=softcap,
        )
    ),
)


def _lm_head_gradients(op, program):
    """The op (custom op, or the program itself off the dispatcher); ``cap``: CE-S's soft-cap,
    passed on only when given (CE-C's program takes none)."""

    def direct(a, w, r, t, wt, rows, c, ls, z, dw, cap=None):
        capped = {} if cap is None else {"softcap": cap}
        return program(a, w, r, t, wt, rows, c, label_smoothing=ls, z_loss=z, want_dw=dw, **capped)

    return _either(
        lambda a, w, r, t, wt, rows, c, ls, z, dw, cap=None: op(
            a, w, r, t, wt, rows, _cfg(c), ls, z, dw, cap
        ),
        direct,
    )


lm_head_chunked = _lm_head_gradients(_lm_head_chunked, _cec.linear_cross_entropy_chunked)
lm_head_scaled = _lm_head_gradients(_lm_head_scaled, _cse.linear_cross_entropy_scaled)
