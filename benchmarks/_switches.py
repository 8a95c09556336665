"""Variants of a benchmarked call as it ran before a feature: each runs the call with one or
more module-level switches of coda set False and puts them back after, also when the call
raises, so the old and the new behaviour are timed side by side in one run."""

from __future__ import annotations


def _switched_off(fn, *switches):
    """``fn`` run with each (object, attribute) switch set False, restored after: a variant of
    a call as it ran before a feature, timed beside the current one in the same run."""

    def run():
        before = [getattr(obj, name) for obj, name in switches]
        for obj, name in switches:
            setattr(obj, name, False)
        try:
            return fn()
        finally:
            for (obj, name), value in zip(switches, before):
                setattr(obj, name, value)

    return run


def without_row_kernels(fn):
    """``fn`` with coda's norm row kernels (``norm_rows.TRITON``) and the stack's shared RoPE
    tables (``drope.cached_head_rotation``) switched off: the step as it ran before them
    (session 12)."""
    from coda.kernels import drope, norm_rows

    return _switched_off(fn, (norm_rows, "TRITON"), (drope.cached_head_rotation, "enabled"))


def storing_for_backward(fn):
    """``fn`` with every layer forward storing what a backward would read, also where none
    can follow (``coda._autograd_support.LEAN_FORWARD`` off), as before session 61 (and in a
    non-reentrant checkpoint's first forward, as before session 64)."""
    from coda import _autograd_support

    return _switched_off(fn, (_autograd_support, "LEAN_FORWARD"))


def without_direct_triton(fn):
    """``fn`` with every coda Triton kernel launched through Triton's own call
    (``coda.kernels._triton.FAST_LAUNCH`` off), as before session 16."""
    from coda.kernels import _triton

    return _switched_off(fn, (_triton, "FAST_LAUNCH"))


def without_target_kernel(fn):
    """``fn`` with the loss's target range rule as its torch form and ``torch._assert_async``
    (``target_check.TRITON`` off: eight launches), as before session 46."""
    from coda.kernels import target_check

    return _switched_off(fn, (target_check, "TRITON"))


def without_loss_rows_kernels(fn):
    """``fn`` with the LM head's row weights and loss reduction as their torch forms
    (``loss_rows.TRITON`` off: twelve launches for two), as before session 47."""
    from coda.kernels import loss_rows

    return _switched_off(fn, (loss_rows, "TRITON"))


def without_plan_tapes(fn):
    """``fn`` with the public ops' plan tapes (``coda.ops.PLAN_TAPES``) switched off: every
    launch looks its plan up by key, as before session 15."""
    from coda import ops

    return _switched_off(fn, (ops, "PLAN_TAPES"))
