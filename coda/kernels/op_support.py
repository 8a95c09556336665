"""What ``coda.kernels.library``'s custom ops share: a tile config as the seven ints that cross
an op's boundary and back, the fake implementations' empty outputs and their registration, an
eager call's way around the dispatcher (``either``), and the registration of every op as an
Inductor fallback kernel.

Why coda registers the fallbacks itself rather than leaving them to Inductor's implicit path:
that path first formats each argument's IR for an info log (built even when the log is off
in torch releases before the lazy message of 2.13, the version CI runs), and an argument deep
in a model's backward graph (the embedding's gradient under 16 layers) formats as a string
that grows exponentially with the depth (pytorch#139501). On the H200 image's torch 2.11 the
Llama-1B-shaped model's compile did not end in ~450 s (run 134), and its backward compile was
formatting IR when cut (run 136).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from coda.kernels.config import GemmConfig


def config_ints(c: GemmConfig) -> list[int]:
    """A config as the op's seven ints (its fields in order; pingpong as 0 / 1)."""
    return [int(v) for v in dataclasses.astuple(c)]


def config_of(c: list[int]) -> GemmConfig:
    """``config_ints``'s inverse."""
    return GemmConfig(c[0], c[1], c[2], c[3], bool(c[4]), c[5], c[6])


def new_empty(*shape, like, dtype=None):
    """An empty tensor of ``shape`` on ``like``'s device, in ``dtype`` or ``like``'s."""
    return like.new_empty(*shape, dtype=dtype or like.dtype)


def either(op, direct):
    """A launch function: the custom op ``op`` while ``torch.compile`` traces, else ``direct``
    (the kernel function: no dispatcher on an eager call's host path)."""

    def call(*args, **kwargs):
        return op(*args, **kwargs) if torch.compiler.is_compiling() else direct(*args, **kwargs)

    return call


def registered_fake(op, all_ops):
    """A decorator registering ``fn`` as ``op``'s fake implementation behind
    ``inductor_fallbacks(all_ops())`` (a fake implementation runs exactly when an op is
    traced)."""

    def register(fn):
        @functools.wraps(fn)
        def fake(*args, **kwargs):
            inductor_fallbacks(all_ops())
            return fn(*args, **kwargs)

        op.register_fake(fake)
        return fn

    return register


def library_fake(op):
    """``registered_fake`` behind every op of ``coda.kernels.library`` (whose ``OPS`` also
    lists the ops of ``library_head`` and ``library_mlp``, each module's ``_fake``)."""

    def all_ops():
        from coda.kernels.library import OPS

        return OPS

    return registered_fake(op, all_ops)


_FALLBACKS = {"made": False}


def inductor_fallbacks(names) -> None:
    """Every op ``torch.ops.coda.<name>`` of ``names`` lowered by Inductor as a fallback
    kernel with the layout constraint of its tag, which is what Inductor's implicit path
    makes, without that path's IR formatting (module docstring). Once, and only once Inductor
    is loaded (``torch.compile``'s default backend has imported it by the time it traces the
    joint graph); where a torch lacks these internals, Inductor's own path stays."""
    if _FALLBACKS["made"] or "torch._inductor.lowering" not in sys.modules:
        return
    _FALLBACKS["made"] = True
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag

        for name in names:
            target = getattr(torch.ops.coda, name).default
            if target not in lowering.lowerings:
                tag = get_layout_constraint_tag(target, with_default=True)
                constraint = lowering.tag_to_layout_constraint(tag)
                lowering.make_fallback(target, layout_constraint=constraint)
    except (ImportError, AttributeError, TypeError):  # another torch's internals
        pass
