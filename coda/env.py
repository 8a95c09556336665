"""Which path an op runs, and why: the kernel path (an SM90 GPU) or the reference path.

coda's kernels run on Hopper (SM90) only. On the CPU and on other GPUs every op runs its
pure-torch reference through the same public call. The choice is never silent: the first
reference-path call of each op emits a ``CodaReferencePathWarning`` naming the reason, and
``last_path(op)`` tells what the latest call of an op ran. ``backend="kernel"`` forces the
kernel path and raises ``UnsupportedDeviceError`` where it cannot run.

``python -m coda`` prints the stack (torch, cutlass-dsl, quack, GPU, SM).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from coda._validate import check_choice

BACKENDS = ("auto", "kernel", "reference")


class CodaReferencePathWarning(UserWarning):
    """An op ran its pure-torch reference because the kernel path is unavailable."""


class UnsupportedDeviceError(RuntimeError):
    """``backend="kernel"`` was asked for where coda's kernels cannot run."""


_LAST: dict = {}
_WARNED: set = set()


def capturing(t: torch.Tensor | None = None) -> bool:
    """Whether work (on ``t``'s device, if given) would be recorded into a CUDA graph now
    instead of run: a device tensor built then holds nothing until the graph replays, so no
    cache may keep one beyond the capture (``capture_memo``)."""
    on_cuda = t.is_cuda if t is not None else torch.cuda.is_initialized()
    return on_cuda and torch.cuda.is_current_stream_capturing()


_CAPTURE_MEMO: dict | None = None  # the open ``capture_memo``'s entries


@contextlib.contextmanager
def capture_memo():
    """While coda records a CUDA graph (``coda.nn.GraphedStep``): the device tables a step
    derives once and every layer reads (``TensorMemo``'s and ``host_cache(device_tensors=
    True)``'s: RoPE's position rows and cos/sin) are remembered for the rest of the capture,
    where the graph makes them before their first reader, and forgotten when it ends (outside
    the graph they hold nothing). Without it each layer of a captured step rebuilt them: about
    a dozen small kernels per layer. Captures elsewhere (torch.compile's CUDA graph trees
    record traced code, which Inductor deduplicates) run uncached as before."""
    global _CAPTURE_MEMO
    outer, _CAPTURE_MEMO = _CAPTURE_MEMO, {}
    try:
        yield
    finally:
        _CAPTURE_MEMO = outer


def _in_capture(owner, key, build, keep=()):
    """``build()`` while capturing: remembered under (``owner``, ``key``) in the open
    ``capture_memo``, else run every time. The entry holds ``owner`` and ``keep`` (the objects
    whose ids ``key`` holds), so no id in a key is reused while it lives."""
    memo = _CAPTURE_MEMO
    if memo is None:
        return build()
    full = (id(owner), key)
    if full not in memo:
        memo[full] = (owner, keep, build())
    return memo[full][2]


def host_cache(maxsize: int | None = None, device_tensors: bool = False):
    """``functools.lru_cache`` for a host-side helper of plain values (a device's capability, a
    positions table, a compiled row kernel): cached in eager calls; inside a torch.compile
    trace it runs uncached, as Dynamo runs it anyway (Dynamo ignores an lru_cache wrapper and
    warns each time it meets one). ``device_tensors``: it returns device tensors, so while a
    CUDA graph is captured it is cached only for that capture (``capture_memo``), as a tensor
    built then holds nothing until the graph replays; and it is called where a torch.compile
    trace sees it, never from a custom op's implementation (which CUDA graph trees warm up in
    their memory pool). ``cache_clear`` / ``cache_info`` as lru_cache's."""

    def decorate(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            if device_tensors and capturing():
                key = (args, tuple(sorted(kwargs.items())))
                return _in_capture(call, key, lambda: fn(*args, **kwargs))
            return cached(*args, **kwargs)

        call.cache_clear, call.cache_info = cached.cache_clear, cached.cache_info
        return call

    return decorate


class TensorMemo:
    """``fn(t, *args)`` remembered while tensor ``t`` is the same object, unchanged
    (``t._version``), with the same ``args`` (plain values, or tensors taken by identity only:
    tables coda builds and never writes): for device tables derived from a tensor that every
    layer of a step is given (positions -> their float rows, positions -> RoPE's cos/sin), so
    a stack computes them once per step, or once in all when the tensor is reused. Keeps the
    ``maxsize`` entries made last (each holds its tensors, so their ids stay unique); runs
    ``fn`` uncached inside a torch.compile trace and for an inference tensor (made under
    ``torch.inference_mode``: in-place writes to it move no version), and while a CUDA graph
    is captured remembers only for that capture (``capture_memo``)."""

    def __init__(self, fn, maxsize: int = 8):
        self.fn, self.maxsize, self._memo = fn, maxsize, {}
        self.enabled = True  # False: every call runs ``fn`` (the benchmarks' comparison)
        functools.update_wrapper(self, fn)

    def __call__(self, t: torch.Tensor, *args):
        if not self.enabled or torch.compiler.is_compiling() or t.is_inference():
            return self.fn(t, *args)  # (an inference tensor has no version to key on)
        # tensors by identity; an entry holds them, so no id is reused while it lives
        ids = tuple(id(a) if isinstance(a, torch.Tensor) else a for a in args)
        key = (id(t), t._version, *ids)
        if capturing(t):
            return _in_capture(self, key, lambda: self.fn(t, *args), keep=(t, args))
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= self.maxsize:
                self._memo.pop(next(iter(self._memo)))
            hit = self._memo[key] = (t, args, self.fn(t, *args))
        return hit[2]

    def cache_clear(self) -> None:
        self._memo.clear()


@host_cache(maxsize=64)
def kernel_support(device: torch.device, dtype: torch.dtype | None = None) -> tuple[bool, str]:
    """(True, "") when coda's kernels can run on ``device`` (and ``dtype``, if given), else
    (False, the reason). Cached: a device's capability does not change within a process, and
    querying it costs microseconds on every call."""
    if device.type != "cuda":
        return False, f"tensors are on {device.type}; coda's kernels need an SM90 CUDA GPU"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(device)
        return False, f"{name} is sm_{major}{minor}; coda's kernels need SM90 (H100/H200)"
    if dtype is not None and dtype != torch.bfloat16:
        return False, f"dtype is {dtype}; coda's kernels take torch.bfloat16"
    return True, ""


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a module call computes in: bfloat16 inside ``torch.autocast`` for x's device
    type with dtype bfloat16 (fp32 activations and parameters are then cast per call, as
    autocast casts a linear layer's: the standard mixed-precision recipe, fp32 master weights,
    runs the bf16 kernels); otherwise x's own dtype. Another autocast dtype (float16) keeps
    x's: coda's kernels are bf16 only, and the reference path is plain torch under autocast."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == torch.bfloat16:
        return torch.bfloat16
    return x.dtype


def autocast_off(device: torch.device):
    """A context without autocast on ``device``'s type, for a kernel sequence whose tensors
    are already in its compute dtype (its fp32 glue must stay fp32); a no-op context, with no
    host cost, when autocast is off."""
    kind = device.type
    if torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


REFERENCE_ASKED = "backend='reference' was asked for"  # reference paths not warned of:
NO_TOKENS = "no tokens (an empty batch: nothing to launch)"  # ... and this one
UNWARNED = (REFERENCE_ASKED, NO_TOKENS)


def resolve_backend(
    op: str, backend: str, device: torch.device, dtype=None, empty: bool = False
) -> str:
    """'kernel' or 'reference' for one call of ``op``; records and reports the choice
    (``record``). ``empty``: the call has no tokens, so where the kernel could run the
    reference path returns its empty result (and zero gradients) instead of launching kernels
    over nothing."""
    check_choice("backend", backend, BACKENDS)
    if backend == "reference":
        path, reason = "reference", REFERENCE_ASKED
    else:
        ok, reason = kernel_support(device, dtype)
        if ok:
            path, reason = ("reference", NO_TOKENS) if empty else ("kernel", "SM90 GPU")
        elif backend == "kernel":
            raise UnsupportedDeviceError(f"{op}: backend='kernel' cannot run: {reason}")
        else:
            path = "reference"
    record(op, path, reason)
    return path


def record(op: str, path: str, reason: str) -> None:
    """One call of ``op`` ran ``path`` for ``reason``: kept for ``last_path``, and the first
    reference-path call of each (op, reason) not asked for warns. Nothing while
    ``torch.compile`` traces: the choice is then fixed in the graph by its guards on the
    device and dtype, and global bookkeeping would only force recompiles."""
    if not torch.compiler.is_compiling():
        note(op, path, reason)


def note(op: str, path: str, reason: str) -> None:
    """``record`` where the caller already knows no torch.compile trace is running (the
    ops' checks memo: a remembered signature's path, noted on each call)."""
    if path == "reference" and reason not in UNWARNED and (op, reason) not in _WARNED:
        _WARNED.add((op, reason))
        warnings.warn(
            f"coda.{op} runs its pure-torch reference path: {reason}",
            CodaReferencePathWarning,
            stacklevel=4,
        )
    _LAST[op] = (path, reason)


def last_path(op: str) -> tuple[str, str] | None:
    """(path, reason) of the latest call of ``op``, or None if it has not run."""
    return _LAST.get(op)


def describe() -> dict:
    """The stack as ``python -m coda`` prints it and a result record keeps it."""
    from coda import _quack

    info = {"torch": torch.__version__, **_quack.versions()}
    # (another version than the pins is refused at the first kernel call: ``_quack``)
    info["pinned"] = not _quack.unpinned(info)
    info["cuda"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["sm"] = "sm_%d%d" % torch.cuda.get_device_capability(dev)
        info["kernel_path"], why = kernel_support(dev)
    else:
        info["kernel_path"], why = False, "torch sees no CUDA device"
    if why:  # (what every op then runs instead: its reference)
        info["why_not"] = why
    return info
