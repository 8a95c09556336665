"""Launch an epilogue program on quack's SM90 GEMM, or only compile it (``dry=True``), or
run it through the tile interpreter on the CPU (``interpret_gemm``).

Every kernel builds its buffers and calls ``launch``; the compile tests call the same kernel
function on small CPU tensors with ``dry=True``, so what CI compiles is exactly what runs.
Called with CPU tensors (and not ``dry``), ``launch`` runs the same program through the tile
interpreter and writes the same buffers, rounding each stored tile once as the kernel does:
the kernel path's whole sequence (the autograd Functions included) then runs on the CPU, in
float64 for proofs or in bf16 as a model of the GPU's numerics."""

from __future__ import annotations

import functools

import torch

from coda import _quack
from coda.env import host_cache
from coda.kernels.config import GemmConfig
from coda.primitives.lowering import epi_args, lower

# whether launches with tensors off the GPU run the tile interpreter (``benchmarks/
# probe_host_cpu.py`` turns it off to time the GPU branch's host work on CPU tensors, quack
# stubbed)
INTERPRET_OFF_GPU = True


def launch(
    program,
    x,
    w,
    *,
    config: GemmConfig,
    d=None,
    c=None,
    operands=None,
    outputs=None,
    dry: bool = False,
    add_to_output: bool = False,
):
    """acc = x @ w (x (M, K) either major, w (K, N) either major); run ``program`` on it.
    ``add_to_output``: D += the program's D (TMA reduce-add store; no C operand).
    Returns the number of compiles done when ``dry`` (0 on a jit-cache hit), else None."""
    operands = operands or {}
    xf = program.a_transform
    if xf is not None:
        xf.check(operands[xf.name], x, config.tile_m)
    if not dry and not x.is_cuda and INTERPRET_OFF_GPU:  # (``interpret`` checks the groups)
        return _interpret_into(program, x, w, config, d, c, operands, outputs or {}, add_to_output)
    for p in program.group_stats:  # the interpreter's refusal, before quack's trace
        p.check_group(operands[p.name], config.tile_n, w.shape[1])
    args = epi_args(program, operands, outputs or {})
    a_scale = (xf.kind, operands[xf.name], xf.tile_k) if xf is not None else None
    # which stores are narrower than the tile grid matters only where a plan is built
    clipped = (
        (lambda: _clipped_stores(program, outputs or {}, x.shape[0], w.shape[1]))
        if program.stores
        else None
    )
    if dry:
        return _quack.compile_only(
            lower(program), x, w, d, c, args, config, add_to_output, a_scale, clipped
        )
    _quack.run_epi_gemm(
        lower(program),
        x,
        w,
        d,
        c,
        args,
        config,
        add_to_output=add_to_output,
        a_scale=a_scale,
        clipped=clipped,
    )
    return None


def _clipped_stores(program, outputs, M, N) -> dict:
    """{name: full shape} of every tile store given a buffer narrower than the tile grid."""
    shapes = {}
    for p in program.stores:
        buf = outputs.get(p.name)
        shape = None if buf is None else p.clipped_shape(buf, M, N, program.mode)
        if shape is not None:
            shapes[p.name] = shape
    return shapes


def acc_dtype(t) -> torch.dtype:
    """The accumulator / statistics dtype for inputs like ``t``: fp32 (the kernel's), or
    float64 for float64 inputs (the CPU proofs)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@host_cache(maxsize=16, device_tensors=True)
def unit_rows(m: int, dtype: torch.dtype, device) -> torch.Tensor:
    """m ones: a row scale of 1 that a kernel only reads (a program's rstd operand where the
    rows are already scaled, or none was given), made once per shape and device instead of
    filled on every call. Called where a torch.compile trace sees it (an op, a Function),
    never from a kernel's own code: a custom op's implementation runs in CUDA graph trees'
    memory pool during their warm-up, where no cache may keep a tensor."""
    return torch.ones(m, dtype=dtype, device=device)


def _interpret_into(program, x, w, config, d, c, operands, outputs, add_to_output):
    """``launch`` on the CPU: the interpreter's outputs written into the kernel's buffers.
    For 16-bit operands the TMA's layout rules are checked as the GPU would enforce them, so
    a CPU run catches a layout the kernel could not read."""
    if x.element_size() == 2:
        from coda._validate import check_tma_operand

        check_tma_operand("A", x, either_major=True)
        check_tma_operand("B", w, either_major=True)
        for name, t in (("D", d), ("C", c)):
            if t is not None:
                check_tma_operand(name, t)
    ops = dict(operands) if c is None else {**operands, "c": c}
    out = interpret_gemm(program, x, w, config=config, operands=ops)
    if program.writes_d and d is not None:
        if add_to_output:
            d.add_(out["D"].to(d.dtype))
        else:
            d.copy_(out["D"])
    declared = {p.name: p for p in (*program.stores, *program.sinks)}
    for name, buf in outputs.items():
        p = declared.get(name)
        if p is None:  # an output written by an input primitive (a GroupRstd statistic)
            buf.copy_(out[name])
        else:
            p.write_back(buf, out[name], ops, w.shape[1])
    return None


def interpret_gemm(program, x, w, *, config: GemmConfig, operands=None, out_dtype=None):
    """The CPU twin of ``launch``: acc = x @ w in float64 for float64 inputs (algebra proofs),
    else float32 (as the kernel's accumulator), with x first scaled by the program's A-operand
    transform if it declares one, then ``program`` through the tile interpreter on
    ``config``'s tile grid. Returns every output the program declares."""
    from coda.primitives.interpreter import interpret

    dt = acc_dtype(x)
    a = x.to(dt)
    if program.a_transform is not None:  # the mainloop's A-operand transform
        xf = program.a_transform
        a = a * xf.expand((operands or {})[xf.name].to(dt), *x.shape)
    return interpret(
        program,
        a @ w.to(dt),
        operands or {},
        tile_m=config.tile_m,
        tile_n=config.tile_n,
        out_dtype=out_dtype,
    )


def example_operands(m: int, k: int, n: int, w_major: str = "n", dtype=None):
    """Small CPU bf16 x (m, k) and w (k, n) with w n-major or k-major, for dry compiles."""
    dtype = dtype or torch.bfloat16
    x = torch.empty(m, k, dtype=dtype)
    w = torch.empty(k, n, dtype=dtype) if w_major == "n" else torch.empty(n, k, dtype=dtype).t()
    return x, w


def fused(fn):
    """A row kernel (the final norm's backward, CE-C's softmax gradient, the norms on rows
    their Triton kernel does not take) compiled by
    torch.compile on the GPU: its elementwise ops and row reductions become one or two Triton
    kernels instead of one pass over memory per torch op. On the CPU it runs as written, and
    inside a user's torch.compile trace as well (Inductor fuses it with its neighbours).

    Inductor's coalescing analysis is off: it does not apply to dynamic shapes anyway, and in
    torch 2.11 it fails an internal assertion on the QK-norm row pass (H200, 2026-11-30)."""
    return fn if torch.compiler.is_compiling() else _compiled_row_kernel(fn)


COMPILED_ON = ("cuda",)  # the device types whose tensors take the compiled form
ROW_BACKEND = "inductor"  # (tests count compiles with a counting backend instead)


@functools.cache  # reached only outside a torch.compile trace (``fused``)
def _compiled_row_kernel(fn):
    """``fn`` compiled, called with autograd's dispatch keys excluded, as inside a custom op.

    Why excluded: Dynamo guards each input's dispatch keys as the thread's dispatch state
    leaves them. A row kernel is called from an autograd.Function (those keys active) and from
    a custom op's implementation under a user's torch.compile (where the dispatcher has
    excluded them, or not: on its first call the op arrives through the dispatcher, later
    through Inductor's direct call). Each new state recompiled ``fn`` once more; the second
    step of a compiled coda LM head did, and under ``mode="reduce-overhead"`` that step is
    the one CUDA graph trees record, so Inductor compiled and benchmarked kernels inside the
    capture and invalidated it (``cudaErrorStreamCaptureInvalidated``, runs 145-147). With
    one state every caller shares one compiled form (tests/test_compile.py). Row kernels
    never build an autograd graph: coda's Functions write their backward themselves."""
    if ROW_BACKEND == "inductor":
        options = {"triton.coalesce_tiling_analysis": False}
        compiled = torch.compile(fn, dynamic=True, options=options)
    else:
        compiled = torch.compile(fn, dynamic=True, backend=ROW_BACKEND)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        first = next(a for a in args if isinstance(a, torch.Tensor))
        if first.device.type not in COMPILED_ON:
            return fn(*args, **kwargs)
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return compiled(*args, **kwargs)

    return run
