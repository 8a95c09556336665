"""Input checks: bad input becomes a clear error naming the argument and the rule, before
anything reaches the DSL (where it would be a crash or, worse, a wrong result).

One module, used by every public entry point (``coda.ops``, ``coda.nn`` at construction and at
forward, ``coda.layouts``, HF state-dict loading), with the same rules on the kernel path and
the reference path. The only rule that depends on tensor *values*, a target's range, is checked
without a host sync on a GPU, by a device-side assertion (the way PyTorch's own cross-entropy
reports an out-of-range target: ``coda.kernels.target_check``); on the CPU it is a plain check.
NaN and Inf in inputs are not errors: they propagate as they do in PyTorch.
"""

from __future__ import annotations

import math
import numbers

import torch


class CodaInputError(ValueError, TypeError):
    """An argument breaks one of an op's documented rules. It is both a ``ValueError`` and a
    ``TypeError``, so code that catches torch's own errors for the same mistake still works."""


REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int32, torch.int64)


# -- tensors -----------------------------------------------------------------------------------
def is_integer(t: torch.Tensor) -> bool:
    """Whether ``t`` holds integers (bool is not: as token positions it would read as 0, 1)."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise CodaInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise CodaInputError(f"{name}: nested tensors are not supported; pass a padded tensor")


def check_matrix(name: str, t, rows=None, cols=None) -> None:
    check_tensor(name, t)
    if t.dim() != 2:
        raise CodaInputError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    for axis, want in ((0, rows), (1, cols)):
        if want is not None and t.shape[axis] != want[1]:
            raise CodaInputError(
                f"{name}: dim {axis} must equal {want[0]} = {want[1]}, got shape {tuple(t.shape)}"
            )


def check_vector(name: str, t, length) -> None:
    check_tensor(name, t)
    if t.dim() != 1 or t.shape[0] != length[1]:
        raise CodaInputError(
            f"{name}: expected shape ({length[0]},) = ({length[1]},), got {tuple(t.shape)}"
        )


def check_same_device(named: dict) -> torch.device:
    devices = {n: t.device for n, t in named.items() if t is not None}
    first = next(iter(devices.values()))
    if any(dv != first for dv in devices.values()):
        listing = ", ".join(f"{k} on {v}" for k, v in devices.items())
        raise CodaInputError(f"all tensors must be on one device; got {listing}")
    return first


def check_float_dtypes(named: dict, allowed) -> torch.dtype:
    dtypes = {n: t.dtype for n, t in named.items() if t is not None}
    first = next(iter(dtypes.values()))
    for n, dt in dtypes.items():
        if dt not in allowed:
            raise CodaInputError(f"{n}: dtype must be one of {list(allowed)}, got {dt}")
        if dt != first:
            listing = ", ".join(f"{k}={v}" for k, v in dtypes.items())
            raise CodaInputError(f"all tensors must share one dtype; got {listing}")
    return first


def check_tma_operand(name: str, t: torch.Tensor, *, either_major: bool = False) -> None:
    """The TMA unit reads 2-D tiles: one unit stride, the other stride and the base address
    16-byte aligned. ``either_major`` accepts a unit stride on either axis (weights)."""
    es = t.element_size()
    # a unit stride on a dim longer than 1 first: a dim of length 1 has no meaningful stride
    unit = [ax for ax in (1, 0) if t.stride(ax) == 1 and t.shape[ax] > 1]
    unit += [ax for ax in (1, 0) if ax not in unit and (t.stride(ax) == 1 or t.shape[ax] == 1)]
    if not unit or (not either_major and 1 not in unit):
        want = "one unit stride" if either_major else "a unit stride on its last dim"
        raise CodaInputError(
            f"{name}: the TMA needs {want} (a contiguous row-major tensor), got strides "
            f"{t.stride()}; call .contiguous()"
        )
    other = 0 if unit[0] == 1 else 1
    if t.shape[other] > 1 and (t.stride(other) * es) % 16:  # one row: its stride is never used
        raise CodaInputError(
            f"{name}: rows must be 16-byte aligned for the TMA: dim {unit[0]} of length "
            f"{t.shape[unit[0]]} x {es} B (stride {t.stride(other)}) is not a multiple of 16 B; "
            f"pad that dim to a multiple of {16 // es}"
        )
    if t.data_ptr() % 16:
        raise CodaInputError(f"{name}: base address must be 16-byte aligned for the TMA")


# -- plain values ------------------------------------------------------------------------------
def check_positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise CodaInputError(f"{name}: must be a positive integer, got {v!r}")
    return int(v)


def check_finite_number(name: str, value) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):
        raise CodaInputError(f"{name}: must be a finite number, got {value!r}")
    return float(value)


def check_positive_number(name: str, value) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not 0 < value < float("inf"):
        raise CodaInputError(f"{name}: must be a finite positive number, got {value!r}")
    return float(value)


def check_eps(eps) -> float:
    return check_positive_number("eps", eps)


def check_param_dtype(dtype) -> None:
    """A module's parameter dtype: a floating dtype, or None (torch's default dtype)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CodaInputError(f"dtype: parameters need a floating dtype, got {dtype!r}")


def check_ce_options(label_smoothing, z_loss) -> tuple[float, float]:
    """Cross-entropy options: label_smoothing in [0, 1] (as ``F.cross_entropy``), z_loss >= 0."""
    ok = isinstance(label_smoothing, numbers.Real) and not isinstance(label_smoothing, bool)
    if not ok or not 0.0 <= label_smoothing <= 1.0:
        raise CodaInputError(
            f"label_smoothing: must be a number in [0, 1], got {label_smoothing!r}"
        )
    ok = isinstance(z_loss, numbers.Real) and not isinstance(z_loss, bool)
    if not ok or not 0.0 <= z_loss < float("inf"):
        raise CodaInputError(f"z_loss: must be a finite number >= 0, got {z_loss!r}")
    return float(label_smoothing), float(z_loss)


def check_softcap(softcap, label_smoothing: float, method: str):
    """The logits' soft-cap (Gemma 2's ``final_logit_softcapping``): None, or a finite
    positive number, without label smoothing (its uniform term is a sum over the logits that
    the programs form by linearity, which a cap breaks) and for the "recompute" or
    "scaled_exp" program (whose stored numerators carry each entry's slope), or "auto",
    which picks one of them; CE-C's ("chunked") do not."""
    if softcap is None:
        return None
    check_positive_number("softcap", softcap)
    if label_smoothing:
        raise CodaInputError("softcap: not supported with label_smoothing")
    if method not in ("auto", "recompute", "scaled_exp"):
        raise CodaInputError(
            f"softcap: runs the 'recompute' or 'scaled_exp' program (method 'auto', "
            f"'recompute' or 'scaled_exp'), got method {method!r}"
        )
    return float(softcap)


def check_ignore_index(ignore_index) -> int:
    """Cross-entropy's ``ignore_index``: an integer (any, as ``F.cross_entropy``'s)."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise CodaInputError(f"ignore_index: must be an int, got {ignore_index!r}")
    return int(ignore_index)


def check_choice(name: str, value, allowed) -> str:
    if value not in allowed:
        raise CodaInputError(f"{name}: must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_heads(
    d: int, n_heads: int, n_kv_heads: int, head_dim=None, *, what: str = "layer"
) -> int:
    """Attention geometry of a Llama/GQA layer; returns head_dim (default d // n_heads)."""
    check_positive_int("d", d)
    check_positive_int("n_heads", n_heads)
    check_positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise CodaInputError(
            f"n_kv_heads ({n_kv_heads}) must divide n_heads ({n_heads}): each key/value head "
            f"serves n_heads / n_kv_heads query heads (GQA)"
        )
    if head_dim is None:
        if d % n_heads:
            raise CodaInputError(
                f"{what}: d ({d}) is not a multiple of n_heads ({n_heads}); pass head_dim"
            )
        head_dim = d // n_heads
    check_positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise CodaInputError(f"head_dim: must be even (RoPE rotates pairs), got {head_dim}")
    return int(head_dim)


# -- modules: activations, targets, state dicts ------------------------------------------------
def check_activation(owner: str, x, d: int, like: torch.Tensor, *, ndim=(3,)) -> None:
    """A module input: a tensor of ``ndim`` dims with last dim d, on the parameters' device
    and of their dtype (or any float dtype inside ``torch.autocast``, which casts both)."""
    check_tensor("x", x)
    if x.dim() not in ndim or x.shape[-1] != d:
        want = " or ".join("(batch, seq, d)" if n == 3 else "(tokens, d)" for n in ndim)
        hint = "; add a batch dim: x[None]" if x.dim() == 2 and 2 not in ndim else ""
        raise CodaInputError(
            f"{owner}: x must be {want} with d = {d}, got shape {tuple(x.shape)}{hint}"
        )
    if x.device != like.device:
        raise CodaInputError(
            f"{owner}: x is on {x.device} but the parameters are on {like.device}; "
            f"move one to the other"
        )
    if x.dtype != like.dtype and not torch.is_autocast_enabled(x.device.type):
        raise CodaInputError(
            f"{owner}: x is {x.dtype} but the parameters are {like.dtype}; cast one to the other"
        )


def check_tokens(tokens, vocab: int) -> None:
    """``tokens``: an integer (batch, seq) tensor of ids in [0, vocab). The range is checked on
    the host for CPU tensors outside a torch.compile trace; on a GPU the embedding's gather
    asserts on the device (``F.embedding``'s own check: no host sync, no extra launch)."""
    check_tensor("tokens", tokens)
    if tokens.dim() != 2 or tokens.is_floating_point() or tokens.is_complex():
        raise CodaInputError(
            f"tokens: must be an integer (batch, seq) tensor, got {tokens.dtype} "
            f"{tuple(tokens.shape)}"
        )
    if not torch.compiler.is_compiling() and tokens.device.type == "cpu" and tokens.numel():
        bad = (tokens < 0) | (tokens >= vocab)
        if bool(bad.any()):
            first = int(tokens[bad][0])
            raise CodaInputError(f"tokens: ids must be in [0, {vocab}), got {first}")


def check_rope_cos_sin(cos_sin, batch: int, seq: int, head_dim: int) -> None:
    """HF's RoPE tables: a (cos, sin) pair, each (batch or 1, seq, head_dim)."""

    def fits(t) -> bool:
        return (
            isinstance(t, torch.Tensor)
            and t.dim() == 3
            and t.shape[0] in (1, batch)
            and (tuple(t.shape[1:]) == (seq, head_dim))
        )

    pair = isinstance(cos_sin, (tuple, list)) and len(cos_sin) == 2
    if not (pair and all(map(fits, cos_sin))):
        got = [getattr(t, "shape", t) for t in cos_sin] if pair else type(cos_sin).__name__
        raise CodaInputError(
            f"rope_cos_sin: must be (cos, sin) tensors, each (batch or 1, seq, head_dim) = "
            f"({batch}, {seq}, {head_dim}), got {got}"
        )


def check_attention_output(o, q) -> None:
    """An attention callable's result: a tensor shaped as its q, (batch, heads, seq, head_dim)."""
    if not isinstance(o, torch.Tensor) or o.shape != q.shape:
        got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
        raise CodaInputError(
            f"attention: must return a tensor shaped as q, (batch, heads, seq, head_dim) = "
            f"{tuple(q.shape)}, got {got}"
        )


def check_target_tensor(target, shape, name: str = "target") -> torch.Tensor:
    """``target`` of ``shape``, int32/int64. Returns it flattened. (Its values' rule is
    ``coda.kernels.target_check.checked_targets``', which calls this first.) ``name``: the
    argument's name where the caller's differs (HF's ``labels``)."""
    check_tensor(name, target)
    if target.dtype not in TARGET_DTYPES:
        raise CodaInputError(f"{name}: dtype must be int32 or int64, got {target.dtype}")
    if tuple(target.shape) != tuple(shape):
        raise CodaInputError(f"{name}: expected shape {tuple(shape)}, got {tuple(target.shape)}")
    return target.reshape(-1)


def check_state_dict(sd: dict, expected: dict) -> None:
    """Every key of ``expected`` ({key: shape}) is in ``sd`` as a tensor of that shape."""
    if not isinstance(sd, dict):
        raise CodaInputError(f"state_dict: expected a dict of tensors, got {type(sd).__name__}")
    for key, shape in expected.items():
        if key not in sd:
            raise CodaInputError(f"state_dict: missing key {key!r}")
        t = sd[key]
        if not isinstance(t, torch.Tensor):
            raise CodaInputError(f"state_dict[{key!r}]: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape):
            raise CodaInputError(
                f"state_dict[{key!r}]: expected shape {tuple(shape)}, got {tuple(t.shape)}"
            )
