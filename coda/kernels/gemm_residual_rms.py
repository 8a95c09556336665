"""GEMM1 of the GEMM-Residual-RMSNorm-GEMM block (KERNELS.md F3/F5 + A1/A2), and the plain
residual GEMM a layer's last projection is.

    acc = x @ w                                   quack SM90 mainloop, fp32 accumulator
    h   = residual + acc [+ bias]                 TileC (residual as the GEMM's C); EW
                                                  [VEC-LD ROW bias: a projection's bias]
      or  residual + s acc                        [VEC-LD scalar s: a residual multiplier]
    D   = h                      (bf16)           TILE-ST: the new residual stream
    a   = h * gamma              (bf16, optional) VEC-LD ROW gamma; EW; TILE-ST
    P[m, t] = sum_{n in t} h^2   (fp32)           RED_m from the fp32 h, before rounding
    r[m] = (sum_t P[m, t] / d + eps)^-1/2         AUX (``coda.primitives.aux``)

``a`` is GEMM2's A operand (the norm's gamma applied, its row scale r deferred to GEMM2's
epilogue); without gamma the kernel is the plain "D = residual + A B plus sum-of-squares
partials", and without the statistic (``stats=False``, ``residual_add``) D alone: a decoder
layer's down projection, whose norm is the next layer's entry norm, which computes its own
(the partials would be dropped). Saved for backward: h and r. With ``bias`` (N,) (Llama's
``attention_bias=True`` puts one on the O projection) the bias is added to the fp32
accumulator before the residual, h rounded once. Without a residual (``output_sumsq``): D =
acc and the partials of acc^2, a sublayer's output whose norm comes before the residual add
(Gemma 2's and 3's; ``coda.kernels.post_norm`` finishes it in one row pass). With ``scale``
s != 1 (Granite's ``residual_multiplier`` on both branches of its layer) the branch is
scaled in fp32 before the add, h rounded once (HF's rounds the branch, then the sum).

Supported: bf16 x (M, K) row-major, w (K, N) either major, residual (M, N) row-major,
gamma (N,); K and N multiples of 8 (16-byte TMA rows); any M and any N-tile raggedness.
Compile key: the program (fn source + declarations, keyed by quack), dtypes and majors, the
``GemmConfig``; M, N, K are dynamic, so one compile serves every token count.
Tests: tests/test_gemm_residual_rms.py (interpreter == reference on CPU; sm_90a compile;
H200 error protocol). Measured: see benchmarks/results/.
"""

from __future__ import annotations

import torch

from coda.kernels._launch import acc_dtype, example_operands, interpret_gemm, launch
from coda.kernels.config import DEFAULT, GemmConfig
from coda.kernels.norm_rows import row_stat
from coda.primitives import RowLoad, RowPartials, Scalar, TileC, TileStore, epilogue_program
from coda.primitives.aux import rstd_from_sumsq
from coda.reference.rmsnorm import gemm_residual_rms_ref  # noqa: F401  (the op's reference)


@epilogue_program(inputs=[TileC()], sinks=[RowPartials("sumsq", scaled=True)])
def residual_sumsq(acc, c):
    h = acc + c
    return {"D": h, "sumsq": (h, h)}


@epilogue_program(
    inputs=[TileC(), RowLoad("gamma")],
    stores=[TileStore("normed")],
    sinks=[RowPartials("sumsq", scaled=True)],
)
def residual_norm_sumsq(acc, c, gamma):
    h = acc + c
    return {"D": h, "normed": h * gamma, "sumsq": (h, h)}


@epilogue_program(inputs=[TileC(), RowLoad("bias")], sinks=[RowPartials("sumsq", scaled=True)])
def residual_bias_sumsq(acc, c, bias):
    h = acc + bias + c
    return {"D": h, "sumsq": (h, h)}


@epilogue_program(
    inputs=[TileC(), RowLoad("gamma"), RowLoad("bias")],
    stores=[TileStore("normed")],
    sinks=[RowPartials("sumsq", scaled=True)],
)
def residual_bias_norm_sumsq(acc, c, gamma, bias):
    h = acc + bias + c
    return {"D": h, "normed": h * gamma, "sumsq": (h, h)}


@epilogue_program(inputs=[TileC()])
def residual_add(acc, c):
    return {"D": acc + c}


@epilogue_program(
    inputs=[TileC(), RowLoad("gamma"), Scalar("scale")],
    stores=[TileStore("normed")],
    sinks=[RowPartials("sumsq", scaled=True)],
)
def scaled_residual_norm_sumsq(acc, c, gamma, scale):  # (a residual multiplier: Granite's)
    h = acc * scale + c
    return {"D": h, "normed": h * gamma, "sumsq": (h, h)}


@epilogue_program(inputs=[TileC(), Scalar("scale")])
def scaled_residual_add(acc, c, scale):
    return {"D": acc * scale + c}


@epilogue_program(sinks=[RowPartials("sumsq", scaled=True)])
def output_sumsq(acc):  # (a sublayer's output, before the norm that follows it: no residual)
    return {"D": acc, "sumsq": (acc, acc)}


def program_for(
    gamma, stats: bool = True, bias: bool = False, residual: bool = True, scaled: bool = False
) -> object:
    if scaled:
        assert residual and not bias, "a scaled branch: with a residual, without a bias"
        assert (gamma is not None) == stats, "scaled: the normed output with its statistic, or D"
        return scaled_residual_norm_sumsq if stats else scaled_residual_add
    if not residual:
        assert stats and gamma is None and not bias, "without a residual: D and its statistic"
        return output_sumsq
    if not stats:
        assert gamma is None and not bias, "the normed output and the bias need the statistic"
        return residual_add
    if bias:
        return residual_bias_sumsq if gamma is None else residual_bias_norm_sumsq
    return residual_sumsq if gamma is None else residual_norm_sumsq


def _operands(gamma, bias, scale: float = 1.0) -> dict:
    named = {"gamma": gamma, "bias": bias, "scale": None if scale == 1.0 else scale}
    return {k: t for k, t in named.items() if t is not None}


def epilogue_gemm(
    x,
    w,
    residual,
    gamma=None,
    config: GemmConfig = DEFAULT,
    dry=False,
    stats: bool = True,
    rows: tuple = (),
    bias=None,
    scale: float = 1.0,
):
    """The SM90 epilogue GEMM alone: returns (h, a or None, sum-of-squares partials M x T_N,
    or None without ``stats``), or with ``dry`` only compiles it and returns the number of
    compiles. ``rows``: h's leading dimensions (product M), e.g. (batch, seq), so that a
    layer returns h as a tensor of its own rather than a view of an (M, N) one; default (M,).
    ``bias`` (N,) in x's dtype, or None. Without ``residual`` (None), h = acc with its
    statistic: the output of a sublayer whose norm follows it (``coda.kernels.post_norm``).
    ``scale``: h = residual + scale * acc (with ``gamma`` and the statistic, or D alone)."""
    M, N = x.shape[0], w.shape[1]
    h = x.new_empty(*(rows or (M,)), N)
    outputs = {}
    if stats:
        outputs["sumsq"] = x.new_empty(M, config.grid(M, N)[1], dtype=acc_dtype(x))
    if gamma is not None:
        outputs["normed"] = torch.empty_like(h)
    compiled = launch(
        program_for(gamma, stats, bias is not None, residual is not None, scale != 1.0),
        x,
        w,
        config=config,
        d=h.view(M, N) if rows else h,
        c=residual,
        operands=_operands(gamma, bias, scale),
        outputs=outputs,
        dry=dry,
    )
    return compiled if dry else (h, outputs.get("normed"), outputs.get("sumsq"))


def gemm_residual_rms_kernel(
    x, w, residual, gamma=None, eps=1e-5, config: GemmConfig = DEFAULT, bias=None, scale=1.0
):
    """The SM90 kernel + AUX. Inputs must already be validated (``coda.ops``).
    Returns (h, a or None, r)."""
    h, a, sumsq = epilogue_gemm(x, w, residual, gamma, config, bias=bias, scale=scale)
    return h, a, row_stat(sumsq, None, w.shape[1], eps)  # A1


def gemm_residual_rms_interpreted(x, w, residual, gamma=None, eps=1e-5, config=DEFAULT, bias=None):
    """The same program through the tile interpreter (CPU): GEMM in ``x``'s precision
    (fp32 for half inputs), epilogue tile by tile, the same AUX. Returns (h, a, r, partials)."""
    operands = {"c": residual, **_operands(gamma, bias)}
    program = program_for(gamma, bias=bias is not None)
    out = interpret_gemm(program, x, w, config=config, operands=operands)
    return out["D"], out.get("normed"), rstd_from_sumsq(out["sumsq"], w.shape[1], eps), out["sumsq"]


def compile_gemm_residual_rms(
    k: int,
    n: int,
    *,
    gamma: bool,
    stats: bool = True,
    w_major: str = "n",
    config: GemmConfig = DEFAULT,
    m: int = 256,
    bias: bool = False,
    gamma_dtype: torch.dtype = torch.bfloat16,
    residual: bool = True,
    scale: float = 1.0,
) -> int:
    """Compile for sm_90a without a GPU; returns compiles done (M, N, K are dynamic).
    ``gamma_dtype``: the gain's (fp32: a ``norm_offset`` layer's 1 + w); ``residual``
    False: ``output_sumsq``; ``scale`` != 1: the scaled-branch programs."""
    x, w = example_operands(m, k, n, w_major)
    residual = torch.empty(m, n, dtype=torch.bfloat16) if residual else None
    g = torch.empty(n, dtype=gamma_dtype) if gamma else None
    b = torch.empty(n, dtype=torch.bfloat16) if bias else None
    return epilogue_gemm(x, w, residual, g, config, dry=True, stats=stats, bias=b, scale=scale)
