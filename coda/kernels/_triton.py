"""What coda's hand-written Triton kernels (``norm_rows``, ``row_passes``, ``target_terms``
and the embedding's backward through it, ``final_norm_rows``) share: where they run, their
launcher, their accumulator type, and their compile for sm_90 without a GPU.

They run on CUDA tensors, and on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``
set before triton is imported: how CI tests them); elsewhere their callers take the torch
form of the same pass.

Launching: Triton's ``kernel[grid](...)`` binds and specializes every argument and looks its
compiled kernel up on each call. ``Kernel`` keeps the compiled kernel that call returns under
a key that determines everything Triton specializes on (each tensor's dtype, device and
16-byte alignment; every other argument's exact value; the options), and later calls with
that key launch it directly, on the current stream read in one C call: ~6 us less host time
per launch on the H200's host (run 58, benchmarks/NOTES.md session 16; a layer step makes
seven), ~1.2-1.5 us less again since session 37 (runs 163-164). Every launch runs on its
tensors' device, current or not (``coda._device``).
"""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from coda._device import foreign


@functools.cache
def interpreted() -> bool:
    """True in Triton's interpreter mode (fixed when triton is imported, so read once)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_triton(t: torch.Tensor) -> bool:
    """Whether a pass over ``t`` runs its Triton kernel (else its torch form)."""
    return t.is_cuda or interpreted()


def contiguous_pass(*tensors: torch.Tensor) -> bool:
    """Whether a hand-written pass that reads ``tensors`` at unit strides runs its Triton
    kernel: on their device (``on_triton``), all contiguous, outside a torch.compile trace
    (which traces and fuses the pass's torch form instead). Else its caller takes that form."""
    return (  # the trace first: inside one, nothing else is asked (Dynamo would trace it)
        not torch.compiler.is_compiling()
        and on_triton(tensors[0])
        and all(t.is_contiguous() for t in tensors)
    )


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative ints. Host-side launch arithmetic uses these, not
    ``triton.cdiv`` / ``triton.next_power_of_2``: in recent Triton those are constexpr functions
    whose every call unwraps its arguments, microseconds each on the host (session 16)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def div_rn(a, b):
    """a / b correctly rounded, as torch divides (Triton's fp32 ``/`` is the approximate
    division; float64's is exact already). For kernels whose values must equal a torch form's."""
    if a.dtype == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)


FAST_LAUNCH = True  # False: every launch through Triton's own call (the same-run A/B)
# launch arguments that are never tensors: ``isinstance(v, torch.Tensor)`` goes through torch's
# tensor metaclass, ~0.1 us for each non-tensor, a fifth of a launch key's cost (session 57)
_PLAIN = frozenset((int, float, bool))
MAX_COMPILED = 1024  # keys kept per kernel; emptied when full (many distinct shapes)


def _stream_reader():
    """A function returning the current CUDA stream's handle, what Triton's launcher looks up
    (through two Python calls) when it is given none; None where this torch build has no CUDA
    (the launcher then looks it up itself)."""
    device = getattr(torch._C, "_cuda_getDevice", None)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if device is None or raw is None:
        return None
    return lambda: raw(device())


_current_stream = _stream_reader()


class Kernel:
    """A Triton kernel (``fn`` under ``triton.jit``) whose launches after the first of each
    specialization key (``key``: every argument's, and the launch options) go straight to
    the compiled kernel Triton returned for that first launch: ``Kernel(fn)[grid](*args,
    **constexprs_and_options)``, as with ``triton.jit``. Arguments are positional, then the
    remaining parameters by name (the constexprs) and ``num_warps``."""

    def __init__(self, fn, debug: bool = False):
        # ``debug``: the kernel's ``tl.device_assert`` compiled in (else Triton drops it)
        self.jit = triton.jit(fn, debug=True) if debug else triton.jit(fn)
        self.params = tuple(inspect.signature(fn).parameters)
        self.compiled: dict = {}

    def __getitem__(self, grid):
        return lambda *args, **named: self.launch(grid, args, named)

    @staticmethod
    def key(args, named) -> tuple:
        """The specialization key of a launch: what the compiled kernel may depend on. For a
        tensor its dtype, device and whether its address is 16-byte aligned (Triton's
        divisibility); for any other argument the value itself (Triton specializes integers
        on == 1 and divisibility by 16 and types them by range: the value determines all of
        it) and its type (True is not 1); the named ones (constexprs, options) by name."""
        return (
            *[
                # a plain number is told by its type first (``isinstance`` is slow on it)
                (type(a), a)
                if type(a) in _PLAIN or not isinstance(a, torch.Tensor)
                else (a.dtype, a.get_device(), a.data_ptr() % 16 == 0)
                for a in args
            ],
            *[(name, type(v), v) for name, v in named.items()],
        )

    def launch(self, grid, args, named):
        if not FAST_LAUNCH or interpreted():
            return self._triton_launch(grid, args, named, _device_of(args))
        try:
            key = self.key(args, named)
            hit = self.compiled.get(key)
        except TypeError:  # an unhashable argument: Triton's own call
            return self._triton_launch(grid, args, named, _device_of(args))
        if hit is None:
            device = _device_of(args)
            compiled = self._triton_launch(grid, args, named, device)
            tail = self.params[len(args) :]
            if callable(getattr(compiled, "__getitem__", None)) and set(tail) <= set(named):
                if len(self.compiled) >= MAX_COMPILED:
                    self.compiled.clear()
                self.compiled[key] = (compiled, tail, device)
            return compiled
        compiled, tail, device = hit  # (the key holds every tensor's device)
        if foreign(device):  # launched on its tensors' device (``coda._device``)
            with torch.cuda.device(device):
                return self.launch(grid, args, named)
        grid = (*grid, 1, 1)[:3]  # the compiled kernel's launcher takes all three dimensions
        if _current_stream is None:
            return compiled[grid](*args, *[named[p] for p in tail])
        return compiled[grid](*args, *[named[p] for p in tail], stream=_current_stream())

    def _triton_launch(self, grid, args, named, device: int):
        """Triton's own launch (binding, specialization, its cache), on ``device``, the
        tensor arguments' (Triton's launcher takes the current device's)."""
        if foreign(device):
            with torch.cuda.device(device):
                return self.jit[grid](*args, **named)
        return self.jit[grid](*args, **named)


def _device_of(args) -> int:
    """The CUDA device index of a launch's first tensor argument (-1: a CPU tensor, or none)."""
    return next((a.get_device() for a in args if isinstance(a, torch.Tensor)), -1)


@functools.cache
def kernel(fn, debug: bool = False) -> Kernel:
    """``fn`` (a plain function written in ``triton.language``) as a Triton kernel: compiled
    for the GPU, or interpreted, by the mode triton was imported in; ``debug``: with its
    device-side assertions."""
    return Kernel(fn, debug)


def acc_type(t: torch.Tensor):
    """The kernels' accumulator type for inputs like ``t``: fp32, or fp64 for float64 (the
    CPU proofs), as ``_launch.acc_dtype``."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def cubin_sm90(
    fn,
    pointers: dict,
    consts: dict,
    num_warps: int = 4,
    arch: int = 90,
    divisible=(),
    part: str = "cubin",
    **options,
) -> bytes:
    """``fn`` compiled for ``sm_{arch}`` without a GPU (Triton ships ptxas): its cubin.
    ``pointers``: each pointer argument's Triton type ("*bf16", ...); ``consts``: the
    constexpr arguments; every other argument is an i32. ``divisible``: the arguments to
    compile as divisible by 16, as Triton's JIT specializes a call whose pointers and integers
    are (``benchmarks/sass_row_passes.py`` reads the code a launch runs); ``options``: further
    compile options the launch passes (``enable_fp_fusion``); ``part``: "ptx" for the PTX
    instead."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn).parameters)
    sig = {name: "constexpr" if name in consts else pointers.get(name, "i32") for name in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in divisible}
    src = ASTSource(fn=triton.jit(fn), signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    options = {"num_warps": num_warps, **options}
    return triton.compile(src, target=target, options=options).asm[part]


def compile_sm90(
    fn, pointers: dict, consts: dict, num_warps: int = 4, arch: int = 90, **options
) -> int:
    """``cubin_sm90``'s size in bytes: the CPU compile test."""
    return len(cubin_sm90(fn, pointers, consts, num_warps, arch, **options))
