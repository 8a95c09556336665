"""What every kernel-path autograd.Function (``coda.autograd``, ``coda.autograd_post_norm``)
shares: the checks a backward or a traced float needs, and whether a backward can follow the
forward that is running (what a lean forward may leave unsaved)."""

from __future__ import annotations

import torch
import torch.utils.checkpoint

from coda._validate import CodaInputError


def root_float_use(value: float) -> None:
    """Checks ``value > 0`` outside every autograd.Function: under ``torch.compile(...,
    dynamic=True)`` a float module attribute becomes symbolic, and Dynamo (torch 2.13) fails
    ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer") when such a
    float is first used inside one Function's traced forward and then again outside it or in
    another Function. Used here first, the float belongs to the outer graph, which every
    Function may read. In eager mode a plain comparison."""
    torch._check(value > 0)


def differentiable_once(name: str) -> None:
    """Called first by every backward here. The kernel path's backward runs kernels autograd
    cannot see through, so the gradients it returns carry no graph: a second derivative
    (``create_graph=True``: a gradient penalty, a Hessian-vector product) would silently miss
    their share. It raises instead, saying what has one. (Inside a torch.compile trace the
    backward is traced with grad mode off: never raised there.)"""
    if torch.is_grad_enabled():
        raise CodaInputError(
            f"{name}: coda's kernel path is differentiable once; a backward with "
            f"create_graph=True (a second derivative) needs backend='reference', whose "
            f"torch ops autograd differentiates again (attention as far as its SDPA "
            f"backend allows: the math one does)"
        )


# False: every layer forward stores what a backward would read, as before session 61 (the
# layer benchmark's same-run comparison, ``benchmarks._switches.storing_for_backward``)
LEAN_FORWARD = True


def backward_can_follow(*inputs) -> bool:
    """Whether a backward will read what a Function applied to ``inputs`` now saves (grad mode
    on, an input requiring a gradient, and not the first forward of torch's non-reentrant
    activation checkpointing, whose backward reruns the forward and reads the rerun's
    tensors): where none will, its forward stores nothing only that backward would read
    (``stand_in`` takes its place among the saved tensors; always stored with
    ``LEAN_FORWARD`` off)."""
    if not LEAN_FORWARD:
        return True
    recorded = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    return recorded and not checkpoint_first_pass()


def checkpoint_first_pass() -> bool:
    """Whether this forward runs inside ``torch.utils.checkpoint.checkpoint(...,
    use_reentrant=False)``'s first pass (HF's activation checkpointing by default since
    transformers 5, and ``coda.nn.CausalLM(checkpoint=True)``): the innermost saved-tensor
    hooks are that checkpoint's, which keep no tensor but its metadata. Told by the pack
    hook's code object (torch defines it inside ``_checkpoint_hook.__init__``); a torch
    without one reads False, storing as before. False inside a torch.compile trace (which
    decides what a checkpointed region saves itself)."""
    if torch.compiler.is_compiling() or _CHECKPOINT_PACK is None:
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__code__", None) is _CHECKPOINT_PACK


def _checkpoint_pack_code():
    hook = getattr(torch.utils.checkpoint, "_checkpoint_hook", None)
    try:  # (the query as ``checkpoint_first_pass`` makes it)
        torch._C._autograd._top_saved_tensors_default_hooks(False)
    except (AttributeError, TypeError):  # another torch's internals
        return None
    consts = hook.__init__.__code__.co_consts if hook is not None else ()
    return next((c for c in consts if getattr(c, "co_name", None) == "pack_hook"), None)


_CHECKPOINT_PACK = _checkpoint_pack_code()


def stand_in(shape, like: torch.Tensor) -> torch.Tensor:
    """Saved in place of a tensor that only a Function's backward reads, where no backward
    will read this run's (``backward_can_follow`` False): one element expanded to the
    tensor's shape, in ``like``'s dtype and on its device. Non-reentrant checkpointing checks
    that its rerun saves tensors of the first pass's number, shapes, dtypes and devices; the
    rerun saves the real ones."""
    return like.new_empty(()).expand(shape)
