"""Does a call's arguments' metadata equal one seen before? The question both host-side memos
ask on every call: the ops' checks memo (``coda.ops._checked``: a signature's verdict, tile
configs and plan tape) and the launch-plan cache (``coda._quack.run_epi_gemm``: a metadata
class's quack plan).

Metadata is what a verdict or a compiled plan depends on and the data never changes: each
tensor's Python type, device, dtype, shape, strides and requires_grad; any other value
itself. ``matcher(values)`` returns a predicate over a later call's values. Tensors are
compared by torch's C++ tensor guards (``torch._C._dynamo.guards.TensorGuards``, what Dynamo
guards a compiled graph's inputs with), about a fifth of the host time of building and
hashing a Python tuple per tensor; they are internal to torch, so they are used only where
they exist and tell apart everything above (probed once at import). Elsewhere, and for
values that are not tensors, the predicate compares ``signature`` tuples and values.
"""

from __future__ import annotations

import operator

import torch


def signature(v) -> tuple:
    """A value's metadata as a plain tuple: a tensor's type, layout, dtype, device, shape,
    strides and requires_grad; any other value's type and the value."""
    if isinstance(v, torch.Tensor):
        return (type(v), v.layout, v.dtype, v.device, v.shape, v.stride(), v.requires_grad)
    return (type(v), v)


def _probe_tensor_guards():
    """torch's tensor guards as ``make(*tensors) -> guards`` with ``guards.check(*tensors)``,
    if this torch has them and they tell apart what ``signature`` does; else None."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(*tensors):
            return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)

        check = make(torch.empty(2, 4)).check
        differ = (
            torch.empty(4, 2).t(),  # strides
            torch.empty(2, 3),  # shape
            torch.empty(2, 4, dtype=torch.float64),  # dtype
            torch.empty(2, 4, requires_grad=True),  # requires_grad
            torch.nn.Parameter(torch.empty(2, 4), requires_grad=False),  # Python type
            torch.empty(2, 4, device="meta"),  # device
            None,
        )
        if check(torch.empty(2, 4)) and not any(check(t) for t in differ):
            return make
    except (ImportError, AttributeError, TypeError, RuntimeError):
        pass
    return None


TENSOR_GUARDS = _probe_tensor_guards()


def matcher(values: tuple):
    """``matches(*later)``: whether ``later`` (as many values) has the metadata of ``values``.
    May raise TypeError for a later value that is neither a tensor nor None where a tensor
    was (the ops' memo treats it as a miss and runs its checks, which name the rule)."""
    if TENSOR_GUARDS is None:
        want = tuple(map(signature, values))
        return lambda *vs: tuple(map(signature, vs)) == want
    at = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    rest = tuple((i, type(v), v) for i, v in enumerate(values) if i not in at)
    if not at:
        return lambda *vs: all(type(vs[i]) is t and vs[i] == v for i, t, v in rest)
    check = TENSOR_GUARDS(*(values[i] for i in at)).check
    if not rest:
        return check
    tensors = operator.itemgetter(*at, at[-1])  # a tuple even for one index; the extra dropped
    n = len(at)

    def matches(*vs):
        for i, t, v in rest:
            if type(vs[i]) is not t or vs[i] != v:
                return False
        return check(*tensors(vs)[:n])

    return matches
