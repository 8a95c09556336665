"""The one module that imports quack-kernels (pinned 0.6.5, with nvidia-cutlass-dsl 4.8.1).

coda builds on quack's SM90 GEMM (TMA, WGMMA, warp-specialized, persistent) and on its
epilogue-op machinery (``quack.epilogue``). Every quack symbol coda uses is reached through
this file, so a quack upgrade that moves a path touches only here. Imports are lazy: importing
coda (the CPU reference path) does not load cutlass.

What is used, and why:
- ``gemm_epilogue`` and the EpiOps (RowVecLoad, ColVecLoad, TileLoad, TileStore,
  ColVecReduce, RowVecReduce, OnlineLSEReduce, ColVecSelect, and HeadRstd and MaxLog2 with
  the prepass): the GPU lowering target of a ``coda.primitives`` program
  (``coda/primitives/lowering.py``);
- ``pack`` / ``unpack`` / ``pexp`` / ``pexp2`` / ``sigmoid``: trace-time math on accumulator
  values;
- ``operand_transform.a_transform`` / ``host.transform_a_operand``: the mainloop's A-operand
  value transform and its strip bundle, the lowering of coda's ``ScaleA`` (CE-S);
- ``identity_epi``: the same mainloop with an empty epilogue, the "raw GEMM" ceiling;
- ``_compile_gemm_epi``'s jit cache: proof that a compile happened on a GPU-less machine.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings

import torch

from coda._device import foreign
from coda._metadata import matcher

# quack 0.6.5 calls cutlass-dsl 4.8.1 APIs that 4.8 deprecates (LayoutEnum, SmemAllocator, ...):
# dozens of DeprecationWarnings a user can do nothing about. They are silenced for those two
# packages only; coda's own warnings and everyone else's are untouched.
THIRD_PARTY_DEPRECATIONS = r"(quack|cutlass)(\..*)?$"

# The versions coda's kernels are built and tested on (pyproject.toml pins the same). coda
# reaches quack internals (its host runtime's jit cache, its EpiOps' signatures) that another
# release need not keep, so ``_modules`` refuses any other version by name, before a kernel
# meets it deep in the DSL; ``CODA_ALLOW_UNPINNED_QUACK=1`` runs them anyway, with a warning
# (for trying an upgrade, which then edits the pins here and in pyproject.toml).
QUACK_VERSION = "0.6.5"
CUTLASS_DSL_VERSION = "4.8.1"
ALLOW_UNPINNED = "CODA_ALLOW_UNPINNED_QUACK"


class UnpinnedStackError(ImportError):
    """quack-kernels or nvidia-cutlass-dsl is not the version coda's kernels are pinned to."""


class UnpinnedStackWarning(UserWarning):
    """The kernels run on an unpinned quack-kernels or nvidia-cutlass-dsl, as asked."""


def unpinned(found: dict) -> list[str]:
    """Each version of ``found`` (``versions()``'s form) that is not coda's pin, as "name
    version (coda pins name==pin)"."""
    pins = (
        ("quack-kernels", found["quack"], QUACK_VERSION),
        ("nvidia-cutlass-dsl", found["cutlass_dsl"], CUTLASS_DSL_VERSION),
    )
    return [f"{name} {have} (coda pins {name}=={pin})" for name, have, pin in pins if have != pin]


def check_pins(found: dict) -> None:
    """Raise ``UnpinnedStackError`` naming each installed version (``versions()``'s form) that
    is not coda's pin (a warning instead under ``CODA_ALLOW_UNPINNED_QUACK=1``)."""
    wrong = unpinned(found)
    if not wrong:
        return
    message = (
        f"coda's kernels need the versions they are built and tested on; installed: "
        f"{'; '.join(wrong)}. `pip install -e .` installs the pins; {ALLOW_UNPINNED}=1 runs "
        f"the kernels on these anyway"
    )
    if os.environ.get(ALLOW_UNPINNED) == "1":
        warnings.warn(message, UnpinnedStackWarning, stacklevel=3)
    else:
        raise UnpinnedStackError(message)


@functools.lru_cache(maxsize=1)
def _modules():
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=THIRD_PARTY_DEPRECATIONS)
    with warnings.catch_warnings():  # import time: torch.jit deprecations raised by cutlass too
        warnings.simplefilter("ignore", DeprecationWarning)
        import quack

        # (before quack's submodules: another release may have moved them)
        check_pins(versions())
        import quack.activation as activation
        import quack.cache as cache
        import quack.epilogue.head_rmsnorm as head_rmsnorm
        import quack.epilogue.library as library
        import quack.epilogue.math as math
        import quack.epilogue.ops as ops
        import quack.epilogue.rotary as rotary
        import quack.epilogue.scaled_exp as scaled_exp
        import quack.gemm_runtime.host as host
        from quack.epilogue.frontend import gemm_epilogue

    # Edits to coda's epilogue programs must invalidate quack's on-disk .o cache.
    coda_dir = os.path.dirname(os.path.abspath(__file__))
    if coda_dir not in cache.EXTRA_SOURCE_DIRS:
        cache.EXTRA_SOURCE_DIRS.append(coda_dir)
    return {
        "quack": quack,
        "activation": activation,
        "head_rmsnorm": head_rmsnorm,
        "library": library,
        "math": math,
        "ops": ops,
        "rotary": rotary,
        "scaled_exp": scaled_exp,
        "host": host,
        "gemm_epilogue": gemm_epilogue,
    }


def versions() -> dict:
    """Versions of the GPU-side stack, for result records and ``python -m coda``."""
    out = {}
    for mod, key in (("quack", "quack"), ("cutlass", "cutlass_dsl")):
        try:
            out[key] = __import__(mod).__version__
        except Exception as e:  # reported, not hidden: the record says what is missing
            out[key] = f"unavailable ({type(e).__name__})"
    return out


# -- trace-time math on accumulator values ------------------------------------------------------
def unpack(value):
    return _modules()["math"].unpack(value)


def pack(a, b):
    return _modules()["math"].pack(a, b)


def exp(value):
    return _modules()["math"].pexp(value)


def exp2(value):
    return _modules()["math"].pexp2(value)


def expm1(value):
    """exp(value) - 1, accurate near 0 (CUDA's expm1f, within an ulp; not fast math)."""
    import cutlass.cute as cute

    return cute.math.expm1(value, fastmath=False)


def sigmoid(value):
    return _modules()["activation"].sigmoid(value)


def relu(value):
    return _modules()["activation"].relu(value)


def select(cond, a, b):
    """``a`` where the traced comparison ``cond`` holds, else ``b`` (one select; Float32)."""
    import cutlass

    return cutlass.Float32(cutlass.select_(cond, cutlass.Float32(a), cutlass.Float32(b)))


def sincos_turns(pos, freq):
    """(sin, cos) of pos * freq turns, freq a float-float pair (quack's RoPE angle math)."""
    rotary = _modules()["rotary"]
    return rotary._sincos_turns(*rotary._angle_turns(pos, freq))


# -- lowering targets ---------------------------------------------------------------------------
def op_classes():
    """The quack EpiOp classes a primitive lowers onto, by coda primitive family."""
    ops = _modules()["ops"]
    return {
        "Scalar": ops.Scalar,
        "DeviceScalar": _device_scalar(),
        "RowLoad": ops.RowVecLoad,
        "ColLoad": ops.ColVecLoad,
        "TileLoad": ops.TileLoad,
        "TileStore": ops.TileStore,
        "RowPartials": ops.ColVecReduce,  # quack names reductions by the vector they produce
        "ColPartials": ops.RowVecReduce,
        "OnlineLSE": ops.OnlineLSEReduce,
        "ColSelect": ops.ColVecSelect,
        "GroupRstd": _modules()["head_rmsnorm"].HeadRstd,  # a grouped prepass statistic
        "TileMaxLog2": _modules()["scaled_exp"].MaxLog2,  # a whole-tile max prepass statistic
    }


@functools.lru_cache(maxsize=1)
def _device_scalar():
    """quack's ``Scalar`` op always in its device-pointer mode (coda's ``DeviceScalar``): its
    compile is keyed as a pointer whatever a launch passes, so it compiles on a machine with
    no GPU from a CPU example tensor; a launch still checks the tensor (CUDA, fp32, one
    element) as quack's own pointer mode does."""

    class DeviceScalar(_modules()["ops"].Scalar):
        def host_arg_key(self, value):
            return self.host_key_for_mode(2)

    return DeviceScalar


def make_epi_mod(fn, **declarations):
    """quack's ``@gemm_epilogue(**declarations)(fn)``: a launchable, cached epilogue GEMM."""
    return _modules()["gemm_epilogue"](**declarations)(fn)


def chunked_linear_cross_entropy():
    """quack's own chunked linear cross-entropy (a benchmark peer, not used by coda)."""
    _modules()
    from quack.linear_cross_entropy import chunked_linear_cross_entropy as fn

    return fn


def identity_mod():
    return _modules()["library"].identity_epi


# (mod, config, add_to_output, A's shape, epilogue argument names) -> ((matches, plan), ...),
# newest first: each plan with a predicate over (A, B, D, C, *epilogue values) saying whether
# a launch has the metadata it was built for (``coda._metadata.matcher``: every tensor's
# type, device, dtype, shape, strides and requires_grad, never the pointer; other values
# themselves). Bounded:
# with many distinct token counts (dynamic batches) it is emptied when full, and the next
# call of each shape re-plans through quack's frontend (its own cache still holds it).
_PLANS: dict = {}
MAX_PLANS = 4096
MAX_PLANS_PER_KEY = 8


class PlanTape:
    """The plans of one op's launches, in launch order, replayed without a per-launch key.

    An op's launches are fixed by its input signature (dtypes, devices, shapes, strides) and
    plain arguments: its outputs and scratch buffers are fresh tensors sized from the inputs,
    so every launch's program, config and argument metadata repeat. ``coda.ops`` keeps one
    tape per op signature beside its check verdict: within ``with tape:`` the first call
    records each plan ``run_epi_gemm`` resolves, and later calls take them in order instead
    of matching every argument's metadata against the plan cache per launch. A recorded plan whose
    program or config is not the one launched (a sequence that changed) turns the tape off for
    good (the keyed lookup serves every launch); a call that raises before its recording is
    complete leaves the recording to the next call. A tape serves the thread that made it,
    once at a time: entered on another thread, or again inside itself, it is not active there
    and that region's launches are keyed."""

    __slots__ = ("plans", "state", "owner", "at")

    def __init__(self):
        self.plans: list = []
        self.state = "record"  # -> "replay" after one complete call; "off" if it diverged
        self.owner = threading.get_ident()
        self.at = None  # the replay cursor while the tape is active, else None

    def __enter__(self):
        active = _ACTIVE
        active.outer.append(active.tape)
        if self.owner == threading.get_ident() and self.at is None:
            self.at = 0
            active.tape = self
        else:  # another thread's tape, or this tape already active further out
            active.tape = None
        return self

    def __exit__(self, exc_type, exc, tb):
        active = _ACTIVE
        mine = active.tape is self
        active.tape = active.outer.pop()
        if mine:
            self.at = None
            if self.state == "record":
                if exc_type is None:
                    self.state = "replay"
                else:
                    self.plans.clear()
        return False

    def take(self, mod, config):
        """The next recorded plan if it was resolved for ``mod`` and ``config``, else None."""
        if self.state != "replay":
            return None
        at = self.at
        if at < len(self.plans):
            rec_mod, rec_config, plan = self.plans[at]
            if rec_mod is mod and (rec_config is config or rec_config == config):
                self.at = at + 1
                return plan
        self.state, self.plans = "off", []
        return None

    def keep(self, mod, config, plan) -> None:
        if self.state == "record":
            self.plans.append((mod, config, plan))


class _Active(threading.local):
    """Per thread: the PlanTape of the op call running, and the enclosing ones."""

    tape = None

    def __init__(self):
        self.outer: list = []


_ACTIVE = _Active()


def _scale_a(x, u):
    """The A-operand value transform x -> x * u (u: the strip's value for x's block)."""
    return x * u


@functools.cache
def scale_a_mod(kind: str):
    """quack's ``@a_transform`` of ``_scale_a`` with its strip of ``kind`` ("colvec_ktile":
    one value per (row, k-tile); "kvec_m64": one per (64-row block, column))."""
    _modules()
    from quack.operand_transform import a_transform

    return a_transform(vec_size=8, args={"u": kind})(_scale_a)


def _split_k(config) -> dict:
    """quack's split-K arguments for ``config.split_k`` (SERIAL: deterministic combine)."""
    if config.split_k == 1:
        return {}
    from quack.gemm_config import SplitKMode

    return {"split_k": config.split_k, "split_k_mode": SplitKMode.SERIAL}


def run_epi_gemm(
    mod,
    A,
    B,
    D,
    C,
    epi_args,
    config,
    *,
    launch=True,
    add_to_output=False,
    replay=True,
    a_scale=None,
    clipped=None,
):
    """Run (or, with ``launch=False``, only compile and plan) ``mod`` on the quack SM90 GEMM.

    ``A`` is (M, K); ``B`` is (K, N) in either major order; ``config`` a ``GemmConfig``.

    The first call of a metadata class goes through quack's frontend (validation, kind
    inference, compile-cache lookup) and keeps the resolved plan; every later call with the
    same dtypes, shapes and strides replays it through quack's ``run_gemm_epi_plan``, which
    makes no host decisions. coda files plans by a few plain values and matches the launch's
    tensors with torch's C++ tensor guards (``coda._metadata``), a fraction of what quack's
    generic warm-path key reads (its ~40 fields, every op's host key); within an op's
    ``PlanTape`` the plan comes from the tape and nothing is matched.
    ``replay=False`` always takes quack's frontend (the benchmarks' "quack raw" baseline).
    ``a_scale`` = (kind, strip, tile_k): A enters as quack's transform bundle and the mainloop
    scales it (``scale_a_mod``); such calls always take quack's frontend (no replay).
    ``clipped``: None, or a callable giving {name: full shape} of the tile stores given a
    narrower buffer, called only where a plan is built (a replay never needs it): the
    frontend, which checks every output's full shape, plans with empty stand-ins of that
    shape, and the plan launches with the narrow buffers (the compiled TMA store clips at
    their bound). The launch runs on A's device, made current for it where it is not
    (``coda._device``)."""
    device = A.get_device() if launch else -1
    if foreign(device):  # launched on its tensors' device (``coda._device``)
        with torch.cuda.device(device):
            return run_epi_gemm(
                mod, A, B, D, C, epi_args, config, launch=launch, add_to_output=add_to_output,
                replay=replay, a_scale=a_scale, clipped=clipped,
            )  # fmt: skip
    transform = {}
    if a_scale is not None:
        kind, strip, tile_k = a_scale
        tmod = scale_a_mod(kind)
        from quack.operand_transform.host import transform_a_operand

        A = transform_a_operand(tmod, A, {"u": strip}, config.tile_m, tile_k)
        transform, replay = {"transform_a": tmod, "tile_K": tile_k}, False
    key = None
    tape = _ACTIVE.tape if launch and replay else None
    if tape is not None:
        plan = tape.take(mod, config)
        if plan is not None:
            _modules()["host"].run_gemm_epi_plan(plan, A, B, D, C, epi_args)
            return plan
    if launch and replay:  # a lookup only where a plan is looked up and kept
        key = (mod, config, add_to_output, A.shape, *epi_args)
        values = (A, B, D, C, *epi_args.values())
        for matches, plan in _PLANS.get(key, ()):
            if matches(*values):
                _modules()["host"].run_gemm_epi_plan(plan, A, B, D, C, epi_args)
                if tape is not None:
                    tape.keep(mod, config, plan)
                return plan
    clipped = clipped() if clipped is not None else None
    if clipped:
        assert replay and a_scale is None, "a clipped store launches through a plan"
        stand_ins = {n: epi_args[n].new_empty(shape) for n, shape in clipped.items()}
    plan = mod.gemm(
        A,
        B,
        D,
        C,
        epi_args={**epi_args, **stand_ins} if clipped else epi_args,
        b_kn=True,
        tile_M=config.tile_m,
        tile_N=config.tile_n,
        cluster_M=config.cluster_m,
        cluster_N=config.cluster_n,
        pingpong=config.pingpong,
        persistent=True,
        max_swizzle_size=config.max_swizzle_size,
        add_to_output=add_to_output,
        _launch=launch and not clipped,
        **transform,
        **_split_k(config),
    )
    if launch and clipped:
        _modules()["host"].run_gemm_epi_plan(plan, A, B, D, C, epi_args)
    if key is not None:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = ((matcher(values), plan), *_PLANS.get(key, ())[: MAX_PLANS_PER_KEY - 1])
        if tape is not None:
            tape.keep(mod, config, plan)
    return plan


def compile_only(
    mod, A, B, D, C, epi_args, config, add_to_output=False, a_scale=None, clipped=None
) -> int:
    """Compile ``mod`` for sm_90a on a machine with no GPU; returns the number of kernel
    compiles this call performed (0 when the jit cache already held it; ``count_compiles``)."""
    return count_compiles(
        lambda: run_epi_gemm(
            mod,
            A,
            B,
            D,
            C,
            epi_args,
            config,
            launch=False,
            add_to_output=add_to_output,
            a_scale=a_scale,
            clipped=clipped,
        )
    )


def count_compiles(plan) -> int:
    """Run ``plan`` (a call that only plans a quack GEMM: ``launch=False``, or an EpiMod's
    ``gemm(..., _launch=False)``) and return the kernel compiles it did.

    quack compiles inside plan building and then asks the CUDA driver for occupancy, which
    fails without a driver. That failure is accepted only when the compile step ran and
    returned (the jit cache counted the lookup); any compile error propagates, and a call that
    never reached the compile step raises."""
    compile_fn = _modules()["host"]._compile_gemm_epi
    before = compile_fn.cache_info()
    try:
        plan()
    except Exception as e:
        after = compile_fn.cache_info()
        looked_up = (after.hits + after.misses) > (before.hits + before.misses)
        if not (looked_up and "cuda" in str(e).lower()):
            raise
    after = compile_fn.cache_info()
    if after.hits + after.misses == before.hits + before.misses:
        raise RuntimeError("count_compiles: quack's compile step was not reached")
    return after.misses - before.misses
