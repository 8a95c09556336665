"""QK-norm with RoPE on the kernel path, and its backward: Qwen3's per-head norm, OLMo's over
the whole q and k projections, and Hunyuan's per-head norm of the rotated heads.

Forward, with z = rstd0 * acc (the QKV GEMM's output, the entry norm's deferred row scale
applied):

    s[m, h]   = (mean_{j in head h} z[m, j]^2 + eps)^-1/2      q and k heads only
    q_n       = z * s * w_h                                    w_h: q_norm or k_norm (hd,)
    out       = RoPE(q_n) for q and k heads, z for v heads      (bf16, the attention input)

It runs in F1's epilogue (``qk_norm_rope_program``): the head statistic in a prepass
(``GroupRstd``: a head is hd adjacent columns inside one output tile, so tile_n must be a
multiple of hd, and hd a multiple of the epilogue's 32-column subtile, ``qk_norm_config``),
then RoPE(z * s * w) is stored. For training (``keep_z=True``) the epilogue also stores z on
the q and k columns, as its even and odd columns (two half-width tiles beside the rotated
pairs, clipped by the TMA store past the k heads: on v columns z is the stored v), and s.
Where no tile width holds whole heads (or a head is narrower than a subtile), F1 runs
without rotation (``scale_rows``) and ``qk_norm_rope_rows`` does the rest as a row pass; so
does OLMo's norm, whose group (all of q's columns, all of k's: a weight of n_q hd, n_k hd)
spans many tiles: there s is one statistic for q and one for k a row, and each mean over j
runs over the group.

Hunyuan's QK-norm norms the rotated heads instead (``post``): a rotation keeps each head's
sum of squares, so s is the same statistic and only the gains move past RoPE,

    out       = RoPE(z * s) * w_h                               (each product rounded once)

one more per-column row (``post_w``) in the same epilogue; in the backward, dout * w_h
takes dout's place below (w_h = 1 there) and dw_h = sum_m dout * RoPE(q_hat).

Backward, from dout (attention's dq, dk, dv), per q/k head with q_hat = z * s:

    dq_n   = RoPE^T(dout)
    g      = s * (w dq_n - q_hat * mean_j(w dq_n q_hat))        the head norm's backward
    dw_h  += sum_m dq_n * q_hat                                 (summed over rows and heads)
    dz~0   = rstd0 * [g | dv]                                   B12/B13's A operand, as B11's
    S0     = sum_n [g | dv] * z / rstd0                         the entry norm's statistic

one row pass: these torch functions on the CPU (and as the oracle), one Triton kernel on the
GPU (``row_passes.dqk_norm_rope_heads_triton``; OLMo's, and its forward row pass:
``qk_norm_passes``). Oracles:
``coda.reference.rope.gemm_qk_norm_rope_ref`` (the epilogue) and ``decoder_layer_ref`` in
``coda.reference.layer`` with q_norm / k_norm (the float64 layer tests). Tests:
tests/test_qk_norm_epilogue.py (the epilogue), tests/test_row_passes.py (B11's pass).
"""

from __future__ import annotations

import functools

import torch

from coda.env import host_cache
from coda.kernels._launch import acc_dtype, example_operands, launch
from coda.kernels.config import GemmConfig
from coda.kernels.drope import pack_heads, rotate_pairs
from coda.kernels.gemm_rope import mrope_position
from coda.primitives import (
    ColLoad,
    GroupRstd,
    RowLoad,
    TileStore,
    epilogue_program,
    group_fits,
    pack,
    unpack,
)
from coda.primitives.aux import norm_correction
from coda.primitives.math import rotation


def is_per_head(q_norm, k_norm, head_dim: int) -> bool:
    """Whether QK-norm weights are Qwen3's, one head_dim weight for every head (else OLMo's,
    over the whole q and k projections)."""
    return q_norm.shape[0] == k_norm.shape[0] == head_dim


def _groups(t, q_norm, k_norm, n_q: int, n_k: int, head_dim: int):
    """t (M, (n_q + n_k) hd), q's columns then k's, as its QK-norm groups: q's columns in
    groups of q_norm's length (hd: Qwen3's per-head norm; n_q hd: OLMo's whole projection),
    then k's in groups of k_norm's: [(M, n_q hd / gq, gq), (M, n_k hd / gk, gk)]."""
    M, nq = t.shape[0], n_q * head_dim
    return [t[:, :nq].view(M, -1, q_norm.shape[0]), t[:, nq:].view(M, -1, k_norm.shape[0])]


def _gains(q_norm, k_norm, post: bool, acc):
    """(before, after): each group's gains before the rotation and after it, (q's, k's); the
    gains sit before it (Qwen3's, OLMo's) or after it (``post``: Hunyuan's), 1 at the other."""
    gains = [w.to(acc) for w in (q_norm, k_norm)]
    ones = [w.new_ones(()) for w in gains]
    return (ones, gains) if post else (gains, ones)


def qk_norm_rope_rows(
    z, q_norm, k_norm, cos, sin, n_q: int, n_k: int, head_dim: int, eps, post: bool = False
):
    """Returns (qkv bf16 (M, Nqkv): normed and rotated q, k; v = z's, s fp32 (M, groups): each
    QK-norm group's statistic, q's then k's (``_groups``: one a head for Qwen3's norm, one
    for q and one for k for OLMo's)). cos, sin: (M, hd / 2) RoPE tables of every row
    (adjacent pairs). ``post``: the gains after the rotation (Hunyuan's)."""
    acc = acc_dtype(z)
    n_rot = (n_q + n_k) * head_dim
    before, after = _gains(q_norm, k_norm, post, acc)
    parts = _groups(z[:, :n_rot].to(acc), q_norm, k_norm, n_q, n_k, head_dim)
    s = [torch.rsqrt(p.pow(2).mean(-1) + eps) for p in parts]
    qn = [(p * r[..., None] * w).flatten(1) for p, r, w in zip(parts, s, before)]
    y = _rotate(torch.cat(qn, 1), cos, sin, n_q + n_k, head_dim)
    out = torch.empty_like(z)
    out[:, :n_rot] = _scaled_groups(y, after, q_norm, k_norm, n_q, n_k, head_dim)
    out[:, n_rot:] = z[:, n_rot:]
    return out, torch.cat(s, 1)


def _scaled_groups(t, gains, q_norm, k_norm, n_q: int, n_k: int, head_dim: int):
    """t (M, (n_q + n_k) hd) with each QK-norm group's columns times its gain (q's, k's)."""
    parts = _groups(t, q_norm, k_norm, n_q, n_k, head_dim)
    return torch.cat([(p * w).flatten(1) for p, w in zip(parts, gains)], 1)


def _rotate(t, cos, sin, heads: int, head_dim: int, inverse: bool = False):
    """RoPE (or its transpose) of t (M, heads hd)'s adjacent pairs, per head."""
    M = t.shape[0]
    t = t.view(M, heads, head_dim)
    pairs = rotate_pairs(t[..., 0::2], t[..., 1::2], cos[:, None, :], sin[:, None, :], inverse)
    return torch.stack(pairs, -1).view(M, heads * head_dim)


def dqk_norm_rope_rows(
    dout, z, s, rstd, cos, sin, q_norm, k_norm, n_q: int, n_k: int, head_dim: int, d: int,
    post: bool = False,
):  # fmt: skip
    """Returns (dz~0 (M, Nqkv) in z's dtype, corr0 (M,), dq_norm, dk_norm (their weights'
    shapes)). s: ``qk_norm_rope_rows``'s statistic (M, groups). ``post``: the gains after
    the rotation (Hunyuan's)."""
    acc = acc_dtype(z)
    n_rot = (n_q + n_k) * head_dim
    groups = (q_norm, k_norm, n_q, n_k, head_dim)
    before, after = _gains(q_norm, k_norm, post, acc)
    d_out = dout[:, :n_rot].to(acc)
    dqn = _rotate(_scaled_groups(d_out, after, *groups), cos, sin, n_q + n_k, head_dim, True)
    n_gq = n_q * head_dim // q_norm.shape[0]
    s_parts = (s[:, :n_gq, None].to(acc), s[:, n_gq:, None].to(acc))
    q_hat = [zp * sp for zp, sp in zip(_groups(z[:, :n_rot].to(acc), *groups), s_parts)]
    g = []
    for qh, dp, sp, w in zip(q_hat, _groups(dqn, *groups), s_parts, before):
        dq_hat = dp * w
        g.append((sp * (dq_hat - qh * (dq_hat * qh).mean(-1, keepdim=True))).flatten(1))
    if post:  # out = RoPE(q_hat) w: dw = sum_m dout * RoPE(q_hat)
        rotated = _rotate(
            torch.cat([qh.flatten(1) for qh in q_hat], 1), cos, sin, n_q + n_k, head_dim
        )
        pairs = zip(_groups(d_out, *groups), _groups(rotated, *groups))
    else:  # out = RoPE(q_hat w): dw = sum_m RoPE^T(dout) * q_hat
        pairs = zip(_groups(dqn, *groups), q_hat)
    dw = [(a * b).sum((0, 1)) for a, b in pairs]  # (summed over rows and groups)
    gz = torch.cat([*g, dout[:, n_rot:].to(acc)], dim=1)
    S0 = (gz * z.to(acc)).sum(-1) / rstd
    dz0 = (gz * rstd[:, None]).to(z.dtype)
    return dz0, norm_correction(rstd, S0, d), *dw


def dqk_norm_rope_heads(
    dq, dk, dv, z, s, rstd, cos, sin, q_norm, k_norm, n_q, n_k, hd, d, post=False
):
    """``dqk_norm_rope_rows`` on the head gradients as attention returns them."""
    dout = pack_heads(dq, dk, dv)
    return dqk_norm_rope_rows(dout, z, s, rstd, cos, sin, q_norm, k_norm, n_q, n_k, hd, d, post)


# -- the forward as one GEMM: the head statistic in F1's epilogue ------------------------------
def _z_squared(acc, rstd):
    z = acc * rstd
    return {"head_rstd": z * z}


def _normed_rotated(z, pos, freq, head_w, plain, head_rstd):
    """RoPE(z * s * w) on q/k columns, z on v columns (head_w 0, plain 1, freq 0 there)."""
    x1, x2 = unpack(z * (head_rstd * head_w + plain))
    s, c = rotation(pos, freq)
    return pack(x1 * c - x2 * s, x1 * s + x2 * c)


def _qk_norm_rope(acc, rstd, pos, freq, head_w, plain, head_rstd):
    return {"D": _normed_rotated(acc * rstd, pos, freq, head_w, plain, head_rstd)}


def _qk_norm_rope_keep_z(acc, rstd, pos, freq, head_w, plain, head_rstd):
    z = acc * rstd
    z_even, z_odd = unpack(z)
    out = _normed_rotated(z, pos, freq, head_w, plain, head_rstd)
    return {"D": out, "z_even": z_even, "z_odd": z_odd}


# Hunyuan's: the gains after the rotation (``post_w``: the q or k gain, 1 on v columns; head_w
# is 1 on q and k columns there)
def _qk_norm_rope_post(acc, rstd, pos, freq, head_w, plain, post_w, head_rstd):
    out = _qk_norm_rope(acc, rstd, pos, freq, head_w, plain, head_rstd)
    return {**out, "D": out["D"] * post_w}


def _qk_norm_rope_post_keep_z(acc, rstd, pos, freq, head_w, plain, post_w, head_rstd):
    out = _qk_norm_rope_keep_z(acc, rstd, pos, freq, head_w, plain, head_rstd)
    return {**out, "D": out["D"] * post_w}


# with multimodal RoPE (Qwen3-VL's): each pair's position by its section (``mrope_position``)
def _qk_norm_mrope(acc, rstd, pos, pos_h, pos_w, freq, sect, head_w, plain, head_rstd):
    at = mrope_position(pos, pos_h, pos_w, sect)
    return _qk_norm_rope(acc, rstd, at, freq, head_w, plain, head_rstd)


def _qk_norm_mrope_keep_z(acc, rstd, pos, pos_h, pos_w, freq, sect, head_w, plain, head_rstd):
    at = mrope_position(pos, pos_h, pos_w, sect)
    return _qk_norm_rope_keep_z(acc, rstd, at, freq, head_w, plain, head_rstd)


@functools.lru_cache(maxsize=None)
def qk_norm_rope_program(eps: float, keep_z: bool = False, mrope: bool = False, post: bool = False):
    """F1 with QK-norm (one program per eps: it is a compile-time constant of the statistic).
    ``mrope``: multimodal RoPE's height and width rows and section flags too.
    Per output column: ``head_w`` = the q or k norm weight (0 on v columns), ``plain`` = 1 on
    v columns (0 elsewhere), so v is stored as z; freq is 0 on v columns (no rotation).
    ``keep_z`` (training): also stores z = rstd * acc, what the backward needs, as its even
    and odd columns (two half-width tiles beside the rotated output), and the head statistic
    s (M x Nqkv / hd, fp32). ``post`` (Hunyuan's, not with ``mrope``): the rotated output
    times the row ``post_w`` (``post_rows``)."""
    if post and mrope:
        raise ValueError("QK-norm after RoPE (post) with multimodal RoPE: no such model")
    rows = [ColLoad("pos_h"), ColLoad("pos_w")] if mrope else []
    inputs = [
        ColLoad("rstd"),
        ColLoad("pos"),
        *rows,
        RowLoad("freq"),
        *([RowLoad("sect")] if mrope else []),
        RowLoad("head_w"),
        RowLoad("plain"),
        *([RowLoad("post_w")] if post else []),
        GroupRstd("head_rstd", eps=float(eps), out="head_s" if keep_z else None),
    ]
    fns = {
        (False, False, False): _qk_norm_rope,
        (True, False, False): _qk_norm_rope_keep_z,
        (False, True, False): _qk_norm_mrope,
        (True, True, False): _qk_norm_mrope_keep_z,
        (False, False, True): _qk_norm_rope_post,
        (True, False, True): _qk_norm_rope_post_keep_z,
    }
    stores = [TileStore("z_even"), TileStore("z_odd")] if keep_z else []
    return epilogue_program(inputs=inputs, stores=stores, mode="pair", prepass=_z_squared)(
        fns[keep_z, mrope, post]
    )


def column_rows(q_norm, k_norm, n_q: int, n_k: int, n_v: int, dtype=torch.float32):
    """(head_w, plain): the per-column rows of ``qk_norm_rope_program`` (length Nqkv). Only
    head_w depends on the weights; plain depends on the shape and is built once."""
    hd = q_norm.shape[0]
    head_w = torch.cat(
        [
            q_norm.to(dtype).repeat(n_q),
            k_norm.to(dtype).repeat(n_k),
            q_norm.new_zeros(n_v * hd, dtype=dtype),
        ]
    )
    return head_w, _plain_row((n_q + n_k) * hd, n_v * hd, dtype, q_norm.device)


def epilogue_rows(q_norm, k_norm, n_q: int, n_k: int, n_v: int, dtype, post: bool):
    """(head_w, plain, post_w): the per-column rows F1's QK-norm epilogue takes, the gains
    before the rotation (``column_rows``; post_w None) or after it (``post_rows``)."""
    heads = (q_norm, k_norm, n_q, n_k, n_v, dtype)
    return post_rows(*heads) if post else (*column_rows(*heads), None)


def post_rows(q_norm, k_norm, n_q: int, n_k: int, n_v: int, dtype=torch.float32):
    """(head_w, plain, post_w): ``qk_norm_rope_program``'s rows for the gains after RoPE
    (``post``): head_w 1 on the q and k columns (0 on v), post_w the gains there (1 on v)."""
    gains, plain = column_rows(q_norm, k_norm, n_q, n_k, n_v, dtype)
    n_rot = (n_q + n_k) * q_norm.shape[0]
    unit = _plain_row(n_rot, n_v * q_norm.shape[0], dtype, q_norm.device, rotated=True)
    return unit, plain, gains + plain


@host_cache(maxsize=16, device_tensors=True)  # (a device tensor: kept beyond no capture)
def _plain_row(n_rot_cols: int, n_v_cols: int, dtype, device, rotated: bool = False):
    """1 on the v columns, 0 on the rotated q and k columns (the other way round with
    ``rotated``): built once per shape."""
    on_rot, on_v = (1.0, 0.0) if rotated else (0.0, 1.0)
    return torch.cat(
        [
            torch.full((n_rot_cols,), on_rot, dtype=dtype, device=device),
            torch.full((n_v_cols,), on_v, dtype=dtype, device=device),
        ]
    )


def gemm_qk_norm_rope_kernel(
    a, w_qkv, rstd, pos, freq, head_w, plain, head_dim, eps, config, keep_z=False, dry=False,
    z_cols=None, mrope=None, post_w=None,
):  # fmt: skip
    """Returns qkv (M x Nqkv: normed and rotated q, k; plain v). ``config.tile_n`` must be a
    multiple of ``head_dim`` (a head inside one tile). ``keep_z`` (the training F1): returns
    (qkv, z_even, z_odd, s) with the even and odd columns of z's first ``z_cols`` columns
    (M x z_cols / 2 each, a.dtype; default all Nqkv; on the GPU a multiple of 16, for the
    TMA's 16-byte rows; the store clips the tiles past it) and the head statistic s
    (M x Nqkv / hd, fp32; its v-head columns are computed and unused). The training F1 keeps
    z for the q and k heads only: on v columns z is the stored v itself. ``mrope``: (pos_h,
    pos_w, sect), multimodal RoPE's (``gemm_rope.mrope_scaled_bias``'s). ``post_w``: the
    gains after RoPE (Hunyuan's; ``post_rows``), or None."""
    M, N = a.shape[0], w_qkv.shape[1]
    qkv = a.new_empty(M, N)
    operands = {"rstd": rstd, "pos": pos, "freq": freq, "head_w": head_w, "plain": plain}
    operands["head_rstd"] = head_dim
    outputs = {}
    if keep_z:
        z_cols = N if z_cols is None else z_cols
        assert 0 < z_cols <= N and z_cols % 2 == 0, z_cols  # on the GPU: 16-byte rows
        outputs = {
            "z_even": a.new_empty(M, z_cols // 2),
            "z_odd": a.new_empty(M, z_cols // 2),
            "head_s": a.new_empty(M, N // head_dim, dtype=acc_dtype(a)),
        }
    if mrope is not None:
        operands.update(zip(("pos_h", "pos_w", "sect"), mrope))
    if post_w is not None:
        operands["post_w"] = post_w
    program = qk_norm_rope_program(eps, keep_z, mrope is not None, post_w is not None)
    compiled = launch(
        program, a, w_qkv, config=config, d=qkv, operands=operands, outputs=outputs, dry=dry
    )
    if dry:
        return compiled
    return (qkv, *outputs.values()) if keep_z else qkv


def dqk_norm_rope_heads_split_z(dq, dk, dv, z_even, z_odd, z_v, s, *args, post=False):
    """``dqk_norm_rope_heads`` with z's q and k columns given as their even and odd columns
    (the training F1's stores, which may run past them) and its v columns as ``z_v`` (the
    stored v: equal to z there). ``z_odd`` None: ``z_even`` is z's leading columns whole."""
    half = (dq.shape[1] + dk.shape[1]) * dq.shape[-1] // 2
    if z_odd is None:
        z_rot = z_even[:, : 2 * half]
    else:
        z_rot = torch.stack([z_even[:, :half], z_odd[:, :half]], dim=-1).flatten(1)
    return dqk_norm_rope_heads(dq, dk, dv, torch.cat([z_rot, z_v], dim=1), s, *args, post=post)


def epilogue_head_rule(head_dim: int, config: GemmConfig | None) -> str:
    """Why F1's epilogue cannot normalize heads of ``head_dim`` under ``config``, or "": a
    head's statistic (``GroupRstd``) needs whole heads in a tile and whole epilogue subtiles
    (32 columns) in a head (``group_fits``; N is whole heads by construction)."""
    if config is None:
        return "no default tile holds whole heads (tile_n 128 or 256)"
    return group_fits(head_dim, config.tile_n, config.tile_n)


def qk_norm_config(head_dim: int) -> GemmConfig | None:
    """A tile config whose tile_n holds whole heads (128 columns ping-pong, or 256
    cooperative), or None where neither does (head_dim 12, 48) or a head is narrower than an
    epilogue subtile (head_dim 8, 16): then F1 runs without rotation and a row pass."""
    for config in (GemmConfig(128, 128, 2, 1, True), GemmConfig(128, 256, 2, 1, False)):
        if not epilogue_head_rule(head_dim, config):
            return config
    return None


def compile_gemm_qk_norm_rope(
    k, n, head_dim, *, keep_z=False, eps=1e-6, m=256, pos_dtype=torch.float32, mrope=False,
    post=False,
) -> int:  # fmt: skip
    a, w = example_operands(m, k, n)
    f, r, pos = torch.empty(n), torch.empty(m), torch.zeros(m, dtype=pos_dtype)
    cfg = qk_norm_config(head_dim)
    z_cols = n - head_dim if keep_z else None  # z kept short of the last head: clipped tiles
    rows = (torch.zeros(m), torch.zeros(m), torch.zeros(n)) if mrope else None
    return gemm_qk_norm_rope_kernel(
        a, w, r, pos, f, f, f, head_dim, eps, cfg, keep_z, dry=True, z_cols=z_cols, mrope=rows,
        post_w=f if post else None,
    )  # fmt: skip
