"""coda's torch-facing fused ops: validate, pick the path, run.

Each op takes ordinary torch tensors, checks them (a clear ``CodaInputError`` naming the
argument and the rule), picks the kernel path on an SM90 GPU or the pure-torch reference path
elsewhere (``coda.env``: reported, never silent), and returns plain tensors.

Conventions: tokens are rows (M = batch * seq); weights are (in, out) matrices, ``y = x @ w``
(an ``nn.Linear`` weight ``W`` is passed as ``W.t()``, a view: the kernels take either major
order); ``rstd`` is RMSNorm's deferred row scale (M,) fp32, from ``gemm_residual_rms``.
W_qkv and W_il are in coda's paired layouts (``coda.layouts`` converts HF weights exactly).

``config`` (a ``GemmConfig``: tile, cluster, schedule of quack's mainloop) defaults to None:
the tile measured fastest for the op's kernel at its GEMM's (K, N) on the H200
(``coda.kernels.tuned``), as the layers use, else quack's default. These ops are forward only;
they refuse inputs that require grad (the autograd layers are ``coda.nn``'s).

Host cost: every rule above depends only on the inputs' metadata (dtype, device, shape,
strides, requires_grad), the op's plain arguments and the grad mode, so each op runs its checks
once per such signature (``_checked``, matching a call with torch's C++ tensor guards through
``coda._metadata``) and afterwards only what metadata cannot show, the TMA operands'
base-address alignment; the signature's tile configs are kept with that verdict, and its
launch plans replayed from a tape kept there too (``coda._quack.PlanTape``), with no
per-launch lookup. A call then costs little more than its kernel launches (a single-GEMM op
1.31-1.41x quack's own raw call on the H200's host in runs 247, 249 and 287;
benchmarks/NOTES.md has every run's figures).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from coda import _validate as v
from coda._metadata import matcher
from coda._quack import PlanTape
from coda.env import capturing, last_path, note, resolve_backend
from coda.kernels import library as lib
from coda.kernels._launch import acc_dtype, unit_rows
from coda.kernels.config import GemmConfig
from coda.kernels.gemm_rmsnorm_gemm import gemm_rmsnorm_gemm_kernel
from coda.kernels.gemm_rope import (
    LOADED_POSITIONS,
    cached_freq_table,
    lean_z_cols,
    position_rows,
)
from coda.kernels.gemm_swiglu import ACTIVATIONS as GLU_ACTIVATIONS
from coda.kernels.linear_cross_entropy import linear_cross_entropy_kernel
from coda.kernels.norm_rows import row_stat
from coda.kernels.qk_norm import epilogue_head_rule, epilogue_rows, qk_norm_config
from coda.kernels.target_check import checked_targets
from coda.kernels.tuned import config_for
from coda.reference.cross_entropy import linear_cross_entropy_ref
from coda.reference.rmsnorm import gemm_residual_rms_ref, gemm_rmsnorm_gemm_ref
from coda.reference.rope import gemm_qk_norm_rope_ref, gemm_rope_ref, rope_table
from coda.reference.swiglu import gemm_swiglu_ref

KERNEL_DTYPES = (torch.bfloat16,)
REFERENCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _start(op: str, backend: str, named: dict) -> str:
    """Shared checks; returns the path (the reference's for no rows: nothing to launch).
    Float inputs must share one device and dtype."""
    device = v.check_same_device(named)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in named.values()):
        raise NotImplementedError(
            f"coda.{op} is a forward-only op; use coda.nn for training (or torch.no_grad())"
        )
    not_float = ("rstd", "target", "positions")
    floats = {n: t for n, t in named.items() if t is not None and n not in not_float}
    dtype = next(iter(floats.values())).dtype
    dtype = dtype if dtype in REFERENCE_DTYPES else None
    path = resolve_backend(op, backend, device, dtype, empty=named["x"].shape[0] == 0)
    v.check_float_dtypes(floats, KERNEL_DTYPES if path == "kernel" else REFERENCE_DTYPES)
    return path


def _kernel_layout(activations: dict, weights: dict, vectors: dict) -> None:
    for name, t in activations.items():
        v.check_tma_operand(name, t)
    for name, t in weights.items():
        v.check_tma_operand(name, t, either_major=True)
    for name, t in vectors.items():
        if t is not None and not t.is_contiguous():
            raise v.CodaInputError(f"{name}: must be contiguous")


def _check_rstd(rstd, x, name="rstd") -> None:
    if rstd is None:
        return
    v.check_vector(name, rstd, ("x.shape[0]", x.shape[0]))
    want = acc_dtype(x)
    if rstd.dtype != want:
        raise v.CodaInputError(
            f"{name}: dtype must be {want} for {x.dtype} inputs, got {rstd.dtype}"
        )


def _check_residual_gemm(x, w, residual, gamma, w_name="w") -> None:
    """The shapes of residual + x @ w: x (M, K), w (K, N), residual (M, N), gamma (N,) or None."""
    v.check_matrix("x", x)
    M, K = x.shape
    v.check_matrix(w_name, w, rows=("x.shape[1]", K))
    n = (f"{w_name}.shape[1]", w.shape[1])
    v.check_matrix("residual", residual, rows=("x.shape[0]", M), cols=n)
    if gamma is not None:
        v.check_vector("gamma", gamma, n)


def _rstd(rstd, x):
    """``rstd``, or ones (no row scale) where it is None: one table per row count and device,
    not a fill launched on every call (the ops only read it)."""
    return unit_rows(x.shape[0], acc_dtype(x), x.device) if rstd is None else rstd


# (op, plain arguments, grad mode, x's shape) -> (_Verdict, ...): one per signature seen
_CHECKED: dict = {}
MAX_CHECKED = 4096  # keys kept; emptied when full (many distinct token counts), then refilled
MAX_VERDICTS = 8  # per key (other strides, dtypes, devices); the oldest dropped beyond it
UNTAPED = contextlib.nullcontext()  # calls whose launches each look their plan up by key
PLAN_TAPES = True  # False: every call untaped (the host benchmark's same-run comparison)


class _Verdict:
    """One signature's verdict: ``matches(*tensors)`` says whether a call has this signature
    (``coda._metadata.matcher``), then the path ``check()`` chose, why, the signature's
    ``PlanTape`` and its kernels' tile configs."""

    __slots__ = ("matches", "path", "reason", "tape", "configs")

    def __init__(self, tensors: tuple, path: str, reason: str, configs):
        self.matches = matcher(tensors)
        self.path, self.reason, self.tape, self.configs = path, reason, PlanTape(), configs


def _checked(op: str, check, plain: tuple, tensors: dict, tma: tuple = (), configs=None):
    """(path, tape, configs) of this call of ``op``: ``check()`` (all of the op's rules; raises
    on a broken one, returns the path) runs on the first call of each signature, later calls
    reuse its verdict and re-check only the base address of each TMA operand named in
    ``tma``. ``tape`` (``coda._quack.PlanTape``, entered around the kernel path) holds the
    signature's launch plans, so that its later calls look no plan up per launch.
    ``configs()`` (the tile configs of the op's kernels, a function of its plain arguments and
    shapes, with any device table they read) runs on the kernel path once per signature too;
    its value is kept with the verdict (None on the reference path; no verdict is kept for a
    call made while a CUDA graph is captured). Inside a torch.compile trace ``check()`` and
    ``configs()`` always run (traced once), untaped.

    The signature: the op, its plain arguments (typed: True is not 1), the grad mode and
    every tensor's metadata (``coda._metadata``); verdicts are filed by the first three and
    the first tensor's shape (the token count), and a call's tensors are matched against
    each. ``tensors`` must hold the same names on every call of an op (an optional one as
    None where not given): the match compares them by position."""
    if torch.compiler.is_compiling():
        return _uncached(check, configs)
    values = tuple(tensors.values())
    try:
        typed = (*plain, *map(type, plain))
        key = (op, typed, torch.is_grad_enabled(), values[0].shape)
        for hit in _CHECKED.get(key, ()):
            if hit.matches(*values):
                break
        else:
            hit = None
    except (AttributeError, TypeError, RuntimeError):  # no plain metadata: the checks say why
        return _uncached(check, configs)
    if hit is None:
        path = check()
        verdict = last_path(op)  # (path, reason) as ``check`` recorded it
        if verdict is None or verdict[0] != path or capturing():
            # kept only outside a CUDA graph capture: ``configs()`` may return device tables,
            # and one built while capturing holds nothing outside the graph
            return path, UNTAPED, _resolved(configs, path)
        if len(_CHECKED) >= MAX_CHECKED:
            _CHECKED.clear()
        hit = _Verdict(values, *verdict, _resolved(configs, path))
        _CHECKED[key] = (hit, *_CHECKED.get(key, ())[: MAX_VERDICTS - 1])
    else:
        path = hit.path
        note(op, path, hit.reason)
    if path == "kernel":
        for name in tma:
            if tensors[name].data_ptr() % 16:
                raise v.CodaInputError(f"{name}: base address must be 16-byte aligned for the TMA")
    return path, hit.tape if PLAN_TAPES else UNTAPED, hit.configs


def _uncached(check, configs):
    path = check()
    return path, UNTAPED, _resolved(configs, path)


def _resolved(configs, path: str):
    return configs() if configs is not None and path == "kernel" else None


class ResidualRMS(NamedTuple):
    h: torch.Tensor  # residual + x @ w, the new residual stream (x.dtype)
    normed: Optional[torch.Tensor]  # h * gamma (x.dtype), GEMM2's A operand; None without gamma
    rstd: torch.Tensor  # (M,) fp32: (mean(h^2) + eps)^-1/2, applied in GEMM2's epilogue


def gemm_residual_rms(
    x,
    w,
    residual,
    gamma=None,
    *,
    eps: float = 1e-5,
    bias=None,
    backend: str = "auto",
    config: Optional[GemmConfig] = None,
) -> ResidualRMS:
    """h = residual + x @ w (+ bias); normed = h * gamma; rstd = RMSNorm's row scale of h.

    x (M, K), w (K, N), residual (M, N), gamma (N,), bias (N,) (the projection's: Llama's
    ``attention_bias=True`` O projection), added to the fp32 product before the residual.
    RMSNorm(h) * gamma == rstd[:, None] * normed, and (RMSNorm(h) * gamma) @ w2 ==
    rstd[:, None] * (normed @ w2): the row scale is deferred to the next GEMM's epilogue
    (KERNELS.md [I2.3])."""
    named = {"x": x, "w": w, "residual": residual, "gamma": gamma, "bias": bias}

    def check():
        _check_residual_gemm(x, w, residual, gamma)
        if bias is not None:
            v.check_vector("bias", bias, ("w.shape[1]", w.shape[1]))
        v.check_eps(eps)
        path = _start("gemm_residual_rms", backend, named)
        if path == "kernel":
            vectors = {"gamma": gamma, "bias": bias}
            _kernel_layout({"x": x, "residual": residual}, {"w": w}, vectors)
        return path

    tma = ("x", "residual", "w")
    plain = (backend, eps, config)
    path, tape, config = _checked(
        "gemm_residual_rms", check, plain, named, tma,
        configs=lambda: config or config_for("residual", *x.shape, w.shape[1]),
    )  # fmt: skip
    if path == "kernel":
        with tape:
            if gamma is None:
                h, sumsq = lib.gemm_residual(x, w, residual, config, bias)
                return ResidualRMS(h, None, row_stat(sumsq, None, w.shape[1], eps))
            return ResidualRMS(*lib.gemm_residual_rms(x, w, residual, gamma, eps, config, bias))
    h, a, r = gemm_residual_rms_ref(x, w, residual, gamma, eps, bias)
    return ResidualRMS(h.to(x.dtype), None if a is None else a.to(x.dtype), r.to(acc_dtype(x)))


class RMSNormGemm(NamedTuple):
    h: torch.Tensor  # the new residual stream residual + x @ w1
    z: torch.Tensor  # (RMSNorm(h) * gamma) @ w2
    rstd: torch.Tensor  # (M,) fp32, saved for backward


def gemm_rmsnorm_gemm(
    x,
    w1,
    residual,
    gamma,
    w2,
    *,
    eps: float = 1e-5,
    backend: str = "auto",
    config1: Optional[GemmConfig] = None,
    config2: Optional[GemmConfig] = None,
) -> RMSNormGemm:
    """The GEMM-Residual-RMSNorm-GEMM block: h = residual + x @ w1; z = RMSNorm(h) gamma @ w2.

    x (M, K), w1 (K, d), residual (M, d), gamma (d,), w2 (d, N2). On the kernel path the norm is
    the epilogue of GEMM1 (partials), an AUX reduction, and the row scale in GEMM2's epilogue."""
    named = {"x": x, "w1": w1, "residual": residual, "gamma": gamma, "w2": w2}

    def check():
        v.check_tensor("gamma", gamma)  # required here
        _check_residual_gemm(x, w1, residual, gamma, w_name="w1")
        v.check_matrix("w2", w2, rows=("w1.shape[1]", w1.shape[1]))
        v.check_eps(eps)
        path = _start("gemm_rmsnorm_gemm", backend, named)
        if path == "kernel":
            layout = ({"x": x, "residual": residual}, {"w1": w1, "w2": w2}, {"gamma": gamma})
            _kernel_layout(*layout)
        return path

    tma = ("x", "residual", "w1", "w2")
    plain = (backend, eps, config1, config2)
    path, tape, configs = _checked(
        "gemm_rmsnorm_gemm", check, plain, named, tma,
        configs=lambda: (
            config1 or config_for("residual", *x.shape, w1.shape[1]),
            config2 or config_for("scale_rows", x.shape[0], *w2.shape),
        ),
    )  # fmt: skip
    if path == "kernel":
        config1, config2 = configs
        with tape:
            out = gemm_rmsnorm_gemm_kernel(x, w1, residual, gamma, w2, eps, config1, config2)
        return RMSNormGemm(*out)
    h, z, r = gemm_rmsnorm_gemm_ref(x, w1, residual, gamma, w2, eps)
    return RMSNormGemm(h.to(x.dtype), z.to(x.dtype), r.to(acc_dtype(x)))


class SwiGLU(NamedTuple):
    s: torch.Tensor  # (M, f) act(gate) * up: silu (SwiGLU) or gelu_tanh (GeGLU)
    preact: Optional[torch.Tensor]  # (M, 2f) the unscaled interleaved pre-activation, if kept


def gemm_swiglu(
    x,
    w_il,
    rstd=None,
    *,
    save_preact: bool = False,
    activation: str = "silu",
    backend: str = "auto",
    config: Optional[GemmConfig] = None,
) -> SwiGLU:
    """s = SwiGLU(rstd * (x @ w_il)) with gate/up interleaved: column 2j gate j, 2j+1 up j.

    x (M, K), w_il (K, 2f) (``coda.layouts.gate_up_weight_from_hf``), rstd (M,) fp32 or None
    (no norm). ``save_preact`` also returns x @ w_il, what the backward needs. ``activation``:
    the gate's, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, GELU's tanh form: Gemma's MLP)."""
    named = {"x": x, "w_il": w_il, "rstd": rstd}

    def check():
        v.check_choice("activation", activation, GLU_ACTIVATIONS)
        v.check_matrix("x", x)
        v.check_matrix("w_il", w_il, rows=("x.shape[1]", x.shape[1]))
        if w_il.shape[1] % 2:
            raise v.CodaInputError(f"w_il: dim 1 (2f) must be even, got {w_il.shape[1]}")
        _check_rstd(rstd, x)
        path = _start("gemm_swiglu", backend, named)
        if path == "kernel":
            _kernel_layout({"x": x}, {"w_il": w_il}, {"rstd": rstd})
            tile_n = (config or config_for("swiglu", *x.shape, w_il.shape[1])).tile_n
            if tile_n % 32:
                raise v.CodaInputError(f"config.tile_n must be a multiple of 32, got {tile_n}")
        return path

    plain = (backend, save_preact, config, activation)
    path, tape, config = _checked(
        "gemm_swiglu", check, plain, named, ("x", "w_il"),
        configs=lambda: config or config_for("swiglu", *x.shape, w_il.shape[1]),
    )  # fmt: skip
    r = _rstd(rstd, x)
    if path == "kernel":
        with tape:
            if save_preact:
                return SwiGLU(*lib.gemm_swiglu(x, w_il, r, config, activation))
            return SwiGLU(lib.gemm_swiglu_only(x, w_il, r, config, activation), None)
    s, u = gemm_swiglu_ref(x, w_il, r, activation)
    return SwiGLU(s.to(x.dtype), u.to(x.dtype) if save_preact else None)


def gemm_rope(
    x,
    w_qkv,
    positions,
    *,
    head_dim: int,
    n_heads: int,
    n_kv_heads: int,
    rstd=None,
    rope_base: float = 10000.0,
    q_norm=None,
    k_norm=None,
    eps: float = 1e-6,
    bias=None,
    backend: str = "auto",
    config: Optional[GemmConfig] = None,
    qk_norm_after_rope: bool = False,
) -> torch.Tensor:
    """qkv = RoPE(rstd * (x @ w_qkv)) on the q and k heads; v unrotated. Returns (M, Nqkv).

    w_qkv (K, (n_heads + 2 n_kv_heads) head_dim): columns [q | k | v], q and k in the
    adjacent-pair layout (``coda.layouts.qkv_weight_from_hf``); positions (M,) integer or
    float token positions (on the kernel path the epilogue loads int64, int32 and float32
    positions as they are, exact below 2^24; another dtype's float32 rows are remembered while
    the same tensor is passed unchanged: a loop casts them once); rstd (M,) fp32 or None. The
    result viewed as (B, S, n_heads + 2 n_kv_heads, head_dim) splits into q, k, v heads.

    ``q_norm``, ``k_norm`` (head_dim,) (both or neither; ``coda.layouts.head_weight_from_hf``
    converts Qwen3's): each q and k head is RMS-normalized over its head_dim values (eps) and
    scaled by them before RoPE, Qwen3's QK-norm, inside the GEMM's epilogue on the kernel
    path (the default tile config then holds whole heads: ``qk_norm.qk_norm_config``).
    ``qk_norm_after_rope``: the norm of the rotated heads instead (Hunyuan's order), its gains
    after the rotation in the same epilogue.

    ``bias`` (Nqkv,) in x's dtype, w_qkv's column order (``coda.layouts.qkv_bias_from_hf``
    converts Qwen2's q, k, v biases): RoPE(rstd * (x @ w_qkv) + bias), added in the epilogue
    before the rotation (not with QK-norm: no model has both)."""
    named = {"x": x, "w_qkv": w_qkv, "rstd": rstd, "positions": positions}
    named.update(q_norm=q_norm, k_norm=k_norm, bias=bias)  # (None where not given)

    def check():
        v.check_matrix("x", x)
        M, K = x.shape
        for name, val in (("head_dim", head_dim), ("n_heads", n_heads)):
            v.check_positive_int(name, val)
        if isinstance(n_kv_heads, bool) or not isinstance(n_kv_heads, int) or n_kv_heads < 0:
            raise v.CodaInputError(f"n_kv_heads: must be an integer >= 0, got {n_kv_heads!r}")
        n_cols = (n_heads + 2 * n_kv_heads) * head_dim
        cols = ("(n_heads + 2 n_kv_heads) head_dim", n_cols)
        v.check_matrix("w_qkv", w_qkv, rows=("x.shape[1]", K), cols=cols)
        if head_dim % 2:
            raise v.CodaInputError(f"head_dim must be even, got {head_dim}")
        v.check_positive_number("rope_base", rope_base)
        v.check_vector("positions", positions, ("x.shape[0]", M))
        if not (positions.is_floating_point() or v.is_integer(positions)):
            raise v.CodaInputError(f"positions: must be integer or float, got {positions.dtype}")
        _check_rstd(rstd, x)
        if (q_norm is None) != (k_norm is None):
            raise v.CodaInputError("q_norm, k_norm: give both (Qwen3's QK-norm) or neither")
        if not isinstance(qk_norm_after_rope, bool):
            raise v.CodaInputError(
                f"qk_norm_after_rope: must be a bool, got {qk_norm_after_rope!r}"
            )
        if qk_norm_after_rope and q_norm is None:
            raise v.CodaInputError("qk_norm_after_rope: needs q_norm and k_norm")
        if q_norm is not None:
            v.check_vector("q_norm", q_norm, ("head_dim", head_dim))
            v.check_vector("k_norm", k_norm, ("head_dim", head_dim))
            v.check_eps(eps)
        if bias is not None:
            v.check_vector("bias", bias, cols)
            if q_norm is not None:
                raise v.CodaInputError("bias: not with q_norm / k_norm (no model has both)")
        path = _start("gemm_rope", backend, named)
        if path == "kernel":
            vectors = {"rstd": rstd, "positions": positions, "bias": bias}
            _kernel_layout({"x": x}, {"w_qkv": w_qkv}, vectors)
            why = q_norm is not None and epilogue_head_rule(
                head_dim, config or qk_norm_config(head_dim)
            )
            if why:  # the QK-norm epilogue normalizes heads within a tile
                raise v.CodaInputError(
                    f"head_dim ({head_dim}): the QK-norm epilogue needs whole heads in one "
                    f"output tile and heads of whole 32-column epilogue subtiles: {why} "
                    f"(the reference path, backend='reference', takes any head_dim)"
                )
        return path

    def configs():  # the tile config and the frequency table, kept with the verdict
        cfg = config or (
            config_for("rope", *x.shape, w_qkv.shape[1]) if q_norm is None
            else qk_norm_config(head_dim)
        )  # fmt: skip
        heads = (n_heads + n_kv_heads, n_kv_heads)
        return cfg, cached_freq_table(head_dim, *heads, rope_base, x.device)

    args = (backend, head_dim, n_heads, n_kv_heads, rope_base, eps, config, qk_norm_after_rope)
    path, tape, kept = _checked("gemm_rope", check, args, named, ("x", "w_qkv"), configs)
    r = _rstd(rstd, x)
    if path == "kernel":
        cfg, freq = kept
        # int64 / int32 / float32 positions are loaded as they are; another dtype's float32
        # rows are remembered per positions tensor (unchanged, same object): cast once
        pos = positions
        if positions.dtype not in LOADED_POSITIONS:
            pos = position_rows(positions, 1, x.device)
        if bias is not None:  # (z, kept for a backward, clipped to one 16-byte row)
            z_cols = lean_z_cols(w_qkv.shape[1])
            with tape:
                return lib.gemm_rope_bias(x, w_qkv, r, pos, freq, bias, cfg, z_cols)[0]
        if q_norm is None:
            with tape:
                return lib.gemm_rope(x, w_qkv, r, pos, freq, cfg)
        heads = (q_norm, k_norm, n_heads, n_kv_heads, n_kv_heads)
        head_w, plain, post_w = epilogue_rows(*heads, torch.float32, qk_norm_after_rope)
        with tape:
            return lib.gemm_qk_norm_rope(
                x, w_qkv, r, pos, freq, head_w, plain, head_dim, eps, cfg, post_w=post_w
            )
    cs = rope_table(positions, head_dim, rope_base)
    if q_norm is None:
        z = gemm_rope_ref(x, w_qkv, r, cs, n_heads, n_kv_heads, head_dim, bias)
    else:
        args = (n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, qk_norm_after_rope)
        z = gemm_qk_norm_rope_ref(x, w_qkv, r, cs, *args)
    return z.to(x.dtype)


def linear_cross_entropy(
    x,
    w_lm,
    target,
    *,
    rstd=None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    backend: str = "auto",
    config: Optional[GemmConfig] = None,
) -> torch.Tensor:
    """Cross-entropy of the logits rstd * (x @ w_lm) against ``target``, logits never stored.

    x (M, d), w_lm (d, V), target (M,) int64/int32 in [0, V) or ``ignore_index``; rstd (M,) fp32
    (the final norm's deferred scale) or None. reduction: "mean" over non-ignored rows (NaN
    when every row is ignored, as in PyTorch), "sum", or "none" (per-row loss, 0 on ignored
    rows). ``label_smoothing`` as ``F.cross_entropy``'s; ``z_loss`` adds z * lse^2 per
    non-ignored row. Returns fp32. A target out of range raises ``CodaInputError`` on the CPU;
    on a GPU it fails a device-side assertion (no host sync), as PyTorch's cross-entropy does."""
    v.check_choice("reduction", reduction, v.REDUCTIONS)
    label_smoothing, z_loss = v.check_ce_options(label_smoothing, z_loss)
    ignore_index = v.check_ignore_index(ignore_index)
    v.check_matrix("x", x)
    v.check_matrix("w_lm", w_lm, rows=("x.shape[1]", x.shape[1]))
    # every call: the range of the values (a device-side assertion on a GPU, no sync)
    target = checked_targets(target, (x.shape[0],), w_lm.shape[1], ignore_index)
    named = {"x": x, "w_lm": w_lm, "rstd": rstd, "target": target}

    def check():
        _check_rstd(rstd, x)
        path = _start("linear_cross_entropy", backend, named)
        if path == "kernel":
            _kernel_layout({"x": x}, {"w_lm": w_lm}, {"rstd": rstd, "target": target})
        return path

    args = (backend, config)
    path, tape, config = _checked(
        "linear_cross_entropy", check, args, named, ("x", "w_lm"),
        configs=lambda: config or config_for("lm_head", *x.shape, w_lm.shape[1]),
    )  # fmt: skip
    r = _rstd(rstd, x)
    if path == "kernel":
        with tape:
            return linear_cross_entropy_kernel(
                x, w_lm, r, target, ignore_index, reduction, config, label_smoothing, z_loss
            )[0]
    loss = linear_cross_entropy_ref(
        x, w_lm, r, target, ignore_index, reduction, label_smoothing, z_loss
    )
    return loss.to(acc_dtype(x))
