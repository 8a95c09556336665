"""The kernel path's launches as ``torch.library`` custom ops, so ``torch.compile`` can trace
coda's autograd Functions without a graph break: each op has a fake (meta) implementation
giving its outputs' exact shapes, dtypes and strides, and its real implementation is the
kernel function itself (quack's SM90 GEMM on the GPU, the tile interpreter on the CPU).

Eager calls skip the dispatcher (a custom op costs microseconds of host time per call): each
function here calls its kernel directly unless ``torch.compile`` is tracing. Tile configs
cross the op boundary as seven ints (``GemmConfig`` fields).

Inductor lowers every op to a call of it (a fallback kernel), registered by coda the first
time an op is traced (``op_support.inductor_fallbacks``: why, there). The LM head's ops live
in ``library_head``, the MLP boundary's (F4, B4) in ``library_mlp``; both are re-exported
here.
"""

from __future__ import annotations

import torch

from coda.kernels import embedding as _emb
from coda.kernels import gemm_residual_rms as _grr
from coda.kernels import gemm_rmsnorm_gemm as _rg
from coda.kernels import gemm_rope as _rope
from coda.kernels import norm_rows as _nr
from coda.kernels import post_norm as _pn
from coda.kernels import qk_norm as _qkn
from coda.kernels import qk_norm_passes as _qkp
from coda.kernels import rmsnorm_bwd as _nb
from coda.kernels import row_passes as _rp
from coda.kernels import wgrad as _wg
from coda.kernels._launch import acc_dtype
from coda.kernels._triton import cdiv
from coda.kernels.library_head import (  # noqa: F401 (the LM head's ops, re-exported)
    _lm_head_bwd,
    _lm_head_chunked,
    _lm_head_scaled,
    _lm_head_stats,
    lm_head_bwd,
    lm_head_chunked,
    lm_head_scaled,
    lm_head_stats,
)
from coda.kernels.library_mlp import (  # noqa: F401 (the MLP boundary's ops, re-exported)
    _dswiglu,
    _dxielu,
    _gemm_swiglu,
    _gemm_swiglu_only,
    dswiglu,
    dxielu,
    gemm_swiglu,
    gemm_swiglu_only,
)
from coda.kernels.op_support import config_ints as _cfg
from coda.kernels.op_support import config_of as _gc
from coda.kernels.op_support import either as _either
from coda.kernels.op_support import library_fake as _fake
from coda.kernels.op_support import new_empty as _empty


# -- forward ------------------------------------------------------------------------------------
@torch.library.custom_op("coda::gemm_rope", mutates_args=())
def _gemm_rope(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    pos: torch.Tensor,
    freq: torch.Tensor,
    cfg: list[int],
) -> torch.Tensor:
    return _rope.gemm_rope_kernel(a, w, rstd, pos, freq, _gc(cfg))


@_fake(_gemm_rope)
def _(a, w, rstd, pos, freq, cfg):
    return _empty(a.shape[0], w.shape[1], like=a)


@torch.library.custom_op("coda::gemm_rope_bias", mutates_args=())
def _gemm_rope_bias(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    pos: torch.Tensor,
    freq: torch.Tensor,
    bias: torch.Tensor,
    cfg: list[int],
    z_cols: int,
    pos_hw: torch.Tensor | None,
    sect: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mrope = _mrope(pos_hw, sect)  # (multimodal RoPE)
    return _rope.gemm_rope_bias_kernel(a, w, rstd, pos, freq, bias, _gc(cfg), z_cols, mrope=mrope)


@_fake(_gemm_rope_bias)
def _(a, w, rstd, pos, freq, bias, cfg, z_cols, pos_hw, sect):
    M, N = a.shape[0], w.shape[1]
    return _empty(M, N, like=a), _empty(M, z_cols // 2, like=a), _empty(M, z_cols // 2, like=a)


@torch.library.custom_op("coda::gemm_qk_norm_rope", mutates_args=())
def _gemm_qk_norm_rope(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    pos: torch.Tensor,
    freq: torch.Tensor,
    head_w: torch.Tensor,
    plain: torch.Tensor,
    head_dim: int,
    eps: float,
    cfg: list[int],
    pos_hw: torch.Tensor | None,
    sect: torch.Tensor | None,
    post_w: torch.Tensor | None = None,
) -> torch.Tensor:
    return _qkn.gemm_qk_norm_rope_kernel(
        a, w, rstd, pos, freq, head_w, plain, head_dim, eps, _gc(cfg), mrope=_mrope(pos_hw, sect),
        post_w=post_w,
    )  # fmt: skip


def _mrope(pos_hw, sect):
    """A kernel's ``mrope`` argument from an op's optional (2, M) rows and section flags."""
    return None if sect is None else (pos_hw[0], pos_hw[1], sect)


@_fake(_gemm_qk_norm_rope)
def _(a, w, rstd, pos, freq, head_w, plain, head_dim, eps, cfg, pos_hw, sect, post_w=None):
    return _empty(a.shape[0], w.shape[1], like=a)


@torch.library.custom_op("coda::gemm_qk_norm_rope_keep_z", mutates_args=())
def _gemm_qk_norm_rope_keep_z(
    a: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    pos: torch.Tensor,
    freq: torch.Tensor,
    head_w: torch.Tensor,
    plain: torch.Tensor,
    head_dim: int,
    eps: float,
    cfg: list[int],
    z_cols: int,
    pos_hw: torch.Tensor | None,
    sect: torch.Tensor | None,
    post_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _qkn.gemm_qk_norm_rope_kernel(
        a, w, rstd, pos, freq, head_w, plain, head_dim, eps, _gc(cfg), keep_z=True, z_cols=z_cols,
        mrope=_mrope(pos_hw, sect), post_w=post_w,
    )  # fmt: skip


@_fake(_gemm_qk_norm_rope_keep_z)
def _(a, w, rstd, pos, freq, head_w, plain, head_dim, eps, cfg, z_cols, pos_hw, sect, post_w=None):
    M, N = a.shape[0], w.shape[1]
    half = _empty(M, z_cols // 2, like=a)
    return (
        _empty(M, N, like=a),
        half,
        torch.empty_like(half),
        _empty(M, N // head_dim, like=a, dtype=acc_dtype(a)),
    )


@torch.library.custom_op("coda::gemm_residual_rms", mutates_args=())
def _gemm_residual_rms(
    x: torch.Tensor,
    w: torch.Tensor,
    res: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    cfg: list[int],
    bias: torch.Tensor | None = None,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _grr.gemm_residual_rms_kernel(x, w, res, gamma, eps, _gc(cfg), bias, scale)


@_fake(_gemm_residual_rms)
def _(x, w, res, gamma, eps, cfg, bias=None, scale=1.0):
    M, N = x.shape[0], w.shape[1]
    return _empty(M, N, like=x), _empty(M, N, like=x), _empty(M, like=x, dtype=acc_dtype(x))


@torch.library.custom_op("coda::gemm_residual", mutates_args=())
def _gemm_residual(
    x: torch.Tensor,
    w: torch.Tensor,
    res: torch.Tensor,
    cfg: list[int],
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    h, _, sumsq = _grr.epilogue_gemm(x, w, res, None, _gc(cfg), bias=bias)
    return h, sumsq


@_fake(_gemm_residual)
def _(x, w, res, cfg, bias=None):
    M, N = x.shape[0], w.shape[1]
    return _empty(M, N, like=x), _empty(M, cdiv(N, cfg[1]), like=x, dtype=acc_dtype(x))


@torch.library.custom_op("coda::gemm_residual_add", mutates_args=())
def _gemm_residual_add(
    x: torch.Tensor,
    w: torch.Tensor,
    res: torch.Tensor,
    cfg: list[int],
    rows: list[int],
    scale: float = 1.0,
) -> torch.Tensor:
    c = _gc(cfg)
    return _grr.epilogue_gemm(x, w, res, None, c, stats=False, rows=tuple(rows), scale=scale)[0]


@_fake(_gemm_residual_add)
def _(x, w, res, cfg, rows, scale=1.0):
    return _empty(*(rows or [x.shape[0]]), w.shape[1], like=x)


@torch.library.custom_op("coda::gemm_output_sumsq", mutates_args=())
def _gemm_output_sumsq(
    x: torch.Tensor, w: torch.Tensor, cfg: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, sumsq = _grr.epilogue_gemm(x, w, None, None, _gc(cfg))
    return y, sumsq


@_fake(_gemm_output_sumsq)
def _(x, w, cfg):
    M, N = x.shape[0], w.shape[1]
    return _empty(M, N, like=x), _empty(M, cdiv(N, cfg[1]), like=x, dtype=acc_dtype(x))


@torch.library.custom_op("coda::gemm_scale_rows", mutates_args=())
def _gemm_scale_rows(
    a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, cfg: list[int]
) -> torch.Tensor:
    return _rg.gemm_scale_rows_kernel(a, w, scale, _gc(cfg))


@_fake(_gemm_scale_rows)
def _(a, w, scale, cfg):
    return _empty(a.shape[0], w.shape[1], like=a)


# -- backward -----------------------------------------------------------------------------------
@torch.library.custom_op("coda::norm_bwd", mutates_args=())
def _norm_bwd(
    dz: torch.Tensor,
    w2: torch.Tensor,
    h: torch.Tensor,
    gamma: torch.Tensor,
    corr: torch.Tensor,
    dres: torch.Tensor | None,
    cfg: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    return _nb.norm_bwd_kernel(dz, w2, h, gamma, corr, dres, _gc(cfg))


@_fake(_norm_bwd)
def _(dz, w2, h, gamma, corr, dres, cfg):
    d = w2.shape[0]
    return _empty(dz.shape[0], d, like=dz), _empty(d, like=dz, dtype=gamma.dtype)


@torch.library.custom_op("coda::wgrad_gamma_rows", mutates_args=())
def _wgrad_gamma_rows(h: torch.Tensor, dz: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    return _wg.wgrad_gamma_rows(h, dz, gamma)  # its tile chosen here, from concrete shapes


@_fake(_wgrad_gamma_rows)
def _(h, dz, gamma):
    return _empty(h.shape[1], dz.shape[1], like=h)


# -- row passes (Triton on the GPU, torch on the CPU) ------------------------------------------
@torch.library.custom_op("coda::norm_rows", mutates_args=())
def _norm_rows(
    x: torch.Tensor, gamma: torch.Tensor, eps: float, scaled: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _nr.norm_rows(x, gamma, eps, scaled)


@_fake(_norm_rows)
def _(x, gamma, eps, scaled):
    return _empty(*x.shape, like=x), _empty(x.shape[0], like=x, dtype=acc_dtype(x))


@torch.library.custom_op("coda::post_norm_rows", mutates_args=())
def _post_norm_rows(
    y: torch.Tensor,
    sumsq: torch.Tensor,
    x0: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    rows: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    return _pn.post_norm(y, sumsq, x0, gain, eps, None, tuple(rows))


@_fake(_post_norm_rows)
def _(y, sumsq, x0, gain, eps, rows):
    r = _empty(y.shape[0], like=y, dtype=acc_dtype(y))
    return _empty(*(rows or [y.shape[0]]), y.shape[1], like=x0), r


@torch.library.custom_op("coda::post_norm_next_rows", mutates_args=())
def _post_norm_next_rows(
    y: torch.Tensor,
    sumsq: torch.Tensor,
    x0: torch.Tensor,
    gain: torch.Tensor,
    eps: float,
    next_gain: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pn.post_norm(y, sumsq, x0, gain, eps, next_gain)


@_fake(_post_norm_next_rows)
def _(y, sumsq, x0, gain, eps, next_gain):
    r = _empty(y.shape[0], like=y, dtype=acc_dtype(y))
    return _empty(*x0.shape, like=x0), r, _empty(*x0.shape, like=x0), torch.empty_like(r)


@torch.library.custom_op("coda::post_norm_bwd_rows", mutates_args=())
def _post_norm_bwd_rows(
    dx1: torch.Tensor, y: torch.Tensor, r: torch.Tensor, gain: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _pn.post_norm_bwd(dx1, y, r, gain)


@_fake(_post_norm_bwd_rows)
def _(dx1, y, r, gain):
    return _empty(*y.shape, like=y), _empty(y.shape[1], like=gain)


@torch.library.custom_op("coda::drope_rows", mutates_args=())
def _drope_rows(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    qkv: torch.Tensor,
    rstd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    d: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rp.drope_pass(dq, dk, dv, qkv, rstd, cos, sin, d)


@_fake(_drope_rows)
def _(dq, dk, dv, qkv, rstd, cos, sin, d):
    return _empty(*qkv.shape, like=qkv), _empty(qkv.shape[0], like=rstd)


@torch.library.custom_op("coda::drope_bias_rows", mutates_args=())
def _drope_bias_rows(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    z_even: torch.Tensor,
    z_odd: torch.Tensor,
    rstd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    d: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _rp.drope_bias_pass(dq, dk, dv, z_even, z_odd, rstd, cos, sin, d)


@_fake(_drope_bias_rows)
def _(dq, dk, dv, z_even, z_odd, rstd, cos, sin, d):
    M, N = z_even.shape[0], 2 * z_even.shape[1]
    acc = acc_dtype(z_even)
    return _empty(M, N, like=z_even), _empty(M, like=rstd), _empty(N, like=z_even, dtype=acc)


@torch.library.custom_op("coda::dqk_norm_rows", mutates_args=())
def _dqk_norm_rows(
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    z_even: torch.Tensor,
    z_odd: torch.Tensor | None,
    z_v: torch.Tensor,
    s: torch.Tensor,
    rstd: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    d: int,
    post: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _qkp.dqk_norm_pass(
        dq, dk, dv, z_even, z_odd, z_v, s, rstd, cos, sin, q_norm, k_norm, d, post
    )


@_fake(_dqk_norm_rows)
def _(dq, dk, dv, z_even, z_odd, z_v, s, rstd, cos, sin, q_norm, k_norm, d, post=False):
    M, hd = z_even.shape[0], dq.shape[-1]
    n_heads = dq.shape[1] + 2 * dk.shape[1]
    acc = acc_dtype(z_even)
    return (
        _empty(M, n_heads * hd, like=z_even),
        _empty(M, like=z_even, dtype=acc),
        _empty(q_norm.shape[0], like=z_even, dtype=acc),  # (hd, or OLMo's n_q hd)
        _empty(k_norm.shape[0], like=z_even, dtype=acc),
    )


@torch.library.custom_op("coda::qk_norm_rows", mutates_args=())
def _qk_norm_rows(
    z: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    n_q: int,
    n_k: int,
    head_dim: int,
    eps: float,
    post: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _qkp.qk_norm_pass(z, q_norm, k_norm, cos, sin, n_q, n_k, head_dim, eps, post)


@_fake(_qk_norm_rows)
def _(z, q_norm, k_norm, cos, sin, n_q, n_k, head_dim, eps, post=False):
    groups = n_q * head_dim // q_norm.shape[0] + n_k * head_dim // k_norm.shape[0]
    return _empty(*z.shape, like=z), _empty(z.shape[0], groups, like=z, dtype=acc_dtype(z))


@torch.library.custom_op("coda::embedding_backward", mutates_args=())
def _embedding_backward(
    tokens: torch.Tensor, grad: torch.Tensor, vocab: int, padding_idx: int
) -> torch.Tensor:
    return _emb.embedding_backward(tokens, grad, vocab, padding_idx)


@_fake(_embedding_backward)
def _(tokens, grad, vocab, padding_idx):
    return _empty(vocab, grad.shape[1], like=grad)


# -- what coda.autograd calls: the kernel directly, or the op while torch.compile traces --------
gemm_rope = _either(
    lambda a, w, r, p, f, c: _gemm_rope(a, w, r, p, f, _cfg(c)), _rope.gemm_rope_kernel
)
gemm_rope_bias = _either(  # (qkv, z_even, z_odd); pos_hw, sect: multimodal RoPE's, or None
    lambda a, w, r, p, f, b, c, z_cols, pos_hw=None, sect=None: _gemm_rope_bias(
        a, w, r, p, f, b, _cfg(c), z_cols, pos_hw, sect
    ),
    lambda a, w, r, p, f, b, c, z_cols, pos_hw=None, sect=None: _rope.gemm_rope_bias_kernel(
        a, w, r, p, f, b, c, z_cols, mrope=None if sect is None else (pos_hw[0], pos_hw[1], sect)
    ),
)
gemm_qk_norm_rope = _either(  # pos_hw, sect: multimodal RoPE's, or None; post_w: Hunyuan's
    lambda a, w, r, p, f, hw, pl, hd, eps, c, pos_hw=None, sect=None, post_w=None: (
        _gemm_qk_norm_rope(a, w, r, p, f, hw, pl, hd, eps, _cfg(c), pos_hw, sect, post_w)
    ),
    lambda *args, pos_hw=None, sect=None, post_w=None: _qkn.gemm_qk_norm_rope_kernel(
        *args, mrope=_mrope(pos_hw, sect), post_w=post_w
    ),
)
gemm_qk_norm_rope_keep_z = _either(
    lambda a, w, r, p, f, hw, pl, hd, eps, c, z_cols, pos_hw=None, sect=None, post_w=None: (
        _gemm_qk_norm_rope_keep_z(
            a, w, r, p, f, hw, pl, hd, eps, _cfg(c), z_cols, pos_hw, sect, post_w
        )
    ),
    lambda a, w, r, p, f, hw, pl, hd, eps, c, z_cols, pos_hw=None, sect=None, post_w=None: (
        _qkn.gemm_qk_norm_rope_kernel(
            a,
            w,
            r,
            p,
            f,
            hw,
            pl,
            hd,
            eps,
            c,
            keep_z=True,
            z_cols=z_cols,
            mrope=_mrope(pos_hw, sect),
            post_w=post_w,
        )
    ),  # fmt: skip
)
gemm_residual_rms = _either(  # bias: the projection's (N,), or None; scale: the branch's
    lambda x, w, res, g, eps, c, bias=None, scale=1.0: _gemm_residual_rms(
        x, w, res, g, eps, _cfg(c), bias, scale
    ),
    _grr.gemm_residual_rms_kernel,
)
gemm_residual = _either(  # (h, sum-of-squares partials)
    lambda x, w, res, c, bias=None: _gemm_residual(x, w, res, _cfg(c), bias),
    lambda x, w, res, c, bias=None: _grr.epilogue_gemm(x, w, res, None, c, bias=bias)[::2],
)
gemm_residual_add = _either(  # h alone (no statistic), its leading dimensions ``rows``
    lambda x, w, res, c, rows=(), scale=1.0: _gemm_residual_add(
        x, w, res, _cfg(c), list(rows), scale
    ),
    lambda x, w, res, c, rows=(), scale=1.0: _grr.epilogue_gemm(
        x, w, res, None, c, stats=False, rows=rows, scale=scale
    )[0],
)
gemm_output_sumsq = _either(  # (y, its sum-of-squares partials): no residual
    lambda x, w, c: _gemm_output_sumsq(x, w, _cfg(c)),
    lambda x, w, c: _grr.epilogue_gemm(x, w, None, None, c)[::2],
)
gemm_scale_rows = _either(
    lambda a, w, s, c: _gemm_scale_rows(a, w, s, _cfg(c)), _rg.gemm_scale_rows_kernel
)
norm_bwd = _either(
    lambda dz, w2, h, g, corr, dres, c: _norm_bwd(dz, w2, h, g, corr, dres, _cfg(c)),
    _nb.norm_bwd_kernel,
)
wgrad_gamma_rows = _either(_wgrad_gamma_rows, _wg.wgrad_gamma_rows)
# F0 and the final norm: under torch.compile the same Triton pass as in eager calls (an op),
# not a torch form for Inductor to regenerate: there is nothing for it to fuse the norm with
# (its input comes from an op's GEMM, the embedding's gather, or the step's input)
norm_rows = _either(_norm_rows, _nr.norm_rows)
# the norm after a sublayer (``post_norm``): one row pass each way
post_norm_rows = _either(
    lambda y, s, x0, g, eps, rows=(): _post_norm_rows(y, s, x0, g, eps, list(rows)),
    lambda y, s, x0, g, eps, rows=(): _pn.post_norm(y, s, x0, g, eps, None, rows),
)
post_norm_next_rows = _either(_post_norm_next_rows, _pn.post_norm)
post_norm_bwd_rows = _either(_post_norm_bwd_rows, _pn.post_norm_bwd)
drope_rows = _either(_drope_rows, _rp.drope_pass)
drope_bias_rows = _either(_drope_bias_rows, _rp.drope_bias_pass)
embedding_backward = _either(_embedding_backward, _emb.embedding_backward)
dqk_norm_rows = _either(_dqk_norm_rows, _qkp.dqk_norm_pass)
# F1's QK-norm row pass (heads no tile holds, OLMo's norm): under torch.compile too the Triton
# pass (OLMo's), not a torch form for Inductor to regenerate (ten kernels a layer, run 313)
qk_norm_rows = _either(_qk_norm_rows, _qkp.qk_norm_pass)


# every op, for tests (opcheck) and reports: each under its name, the function ``_<name>``
_NAMES = (
    "gemm_rope", "gemm_rope_bias", "gemm_qk_norm_rope", "gemm_qk_norm_rope_keep_z",
    "gemm_residual_rms", "gemm_residual", "gemm_residual_add", "gemm_output_sumsq",
    "gemm_swiglu", "gemm_scale_rows", "gemm_swiglu_only", "lm_head_stats", "dswiglu",
    "dxielu",
    "norm_bwd", "wgrad_gamma_rows", "lm_head_bwd", "lm_head_chunked", "lm_head_scaled",
    "norm_rows", "post_norm_rows", "post_norm_next_rows", "post_norm_bwd_rows", "drope_rows",
    "drope_bias_rows", "dqk_norm_rows", "qk_norm_rows", "embedding_backward"
)  # fmt: skip
OPS = {name: globals()[f"_{name}"] for name in _NAMES}
