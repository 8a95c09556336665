"""``GraphedStep``: one training step (forward, backward, optimizer step) that runs eagerly
for its first calls, is then captured once as a CUDA graph, and is replayed from then on, so
a step costs the GPU its kernels and the host one replay.

Why: a small model's eager step is bound by the host, which enqueues each of its kernels from
Python (the d=1024 demo model on the H200: 5.9 ms of kernels, a 15.9 ms eager step + AdamW,
6.8 ms through this object; benchmarks/NOTES.md, session 18). coda's kernel path has no host
syncs and keeps its launch plans per shape, so a step of ``coda.nn.CausalLM`` or of a stack of
coda layers captures as it is; this is PyTorch's whole-network capture recipe as one object
that behaves as the eager step it replaces:

    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4, device="cuda"),
                            fused=True, capturable=True)
    step = coda.nn.GraphedStep(model, opt)
    for tokens, targets in batches:
        loss = step(tokens, targets)  # zero_grad; model(tokens, targets).backward(); opt.step()

A model may return the loss or an output holding it as ``.loss`` and take keyword arguments:
``step(input_ids=ids, labels=ids)`` for a Hugging Face model patched by
``coda.transformers.apply_coda``, whose own code must then be free of host syncs as well.
With sdpa attention it is (captured on the H200: transformers sees the capture and skips its
mask probes; 5.17 then builds the causal mask as a tensor, which the patched layers drop where
it is the plain causal one, ``coda.transformers``). With HF's eager attention it is not (its
mask building copies a host scalar): a capture that fails raises naming the rule and keeps
nothing.

Each call is one step on the batch it is given: the first ``warmup`` calls run eagerly (on a
side stream: compiles, the allocator and the optimizer's state warm up there), the next one
captures the step and replays it, the rest replay. A replay copies the call's tensors into the
graph's own input buffers; parameters and optimizer state change in place, as eagerly; after
a call every ``.grad`` holds that step's gradient (graph memory, rewritten by the next call).

Rules, each a ``CodaInputError`` naming itself: the optimizer runs ``capturable=True`` with a
tensor learning rate (a float lr would be frozen into the graph, and a scheduler's later
changes ignored without a word; a tensor one is read by every replay, and torch's schedulers
update it in place); every call after the first passes the first call's arguments (by
position and by name) as tensors of its shapes, dtypes and devices, and any other argument
equal to it (the graph holds one shape); the model's parameters sit on one GPU (a CUDA graph
records one device's work), on whose streams the step warms up, is captured and replays
whichever device is current (as coda's kernels launch on their tensors': ``coda._device``).
On the CPU, where CUDA graphs do not exist, every call runs eagerly and nothing is checked
beyond what the eager step checks.
"""

from __future__ import annotations

import torch

from coda import _validate as v
from coda._device import foreign
from coda.env import capture_memo


def check_capturable(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer can run inside a CUDA graph and stays schedulable there."""
    for i, group in enumerate(optimizer.param_groups):
        if not group.get("capturable", False):
            raise v.CodaInputError(
                f"optimizer: param group {i} is not capturable; build the optimizer with "
                f"capturable=True (e.g. torch.optim.AdamW(..., fused=True, capturable=True))"
            )
        if not isinstance(group.get("lr"), torch.Tensor):
            raise v.CodaInputError(
                f"optimizer: param group {i} has a float lr, which a CUDA graph freezes at "
                f"capture (a scheduler's changes would be ignored); pass "
                f"lr=torch.tensor(lr, device='cuda')"
            )


def check_one_device(params) -> None:
    """A CUDA graph records one device's work: every trained parameter on one GPU."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise v.CodaInputError(
            f"model: its parameters are on {', '.join(devices)}; a CUDA graph records one "
            f"device's step: place the model on one GPU (one GraphedStep per rank), or train "
            f"without GraphedStep"
        )


def _signature(args: tuple, kwargs: dict) -> dict:
    """{position or name: what a graph fixes of that argument}."""
    named = {**dict(enumerate(args)), **kwargs}
    return {
        k: ("tensor", tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else a
        for k, a in named.items()
    }


def _describe(sig) -> str:
    if isinstance(sig, tuple) and sig[:1] == ("tensor",):
        return "tensor {} {} on {}".format(*sig[1:])
    return repr(sig)


def _loss_of(out) -> torch.Tensor:
    loss = getattr(out, "loss", out)  # a Hugging Face ModelOutput holds it as .loss
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise v.CodaInputError(
            "model: GraphedStep needs the model to return a 0-dim loss tensor, or an output "
            f"with one as .loss (pass the labels); got {type(out).__name__}"
        )
    return loss


class GraphedStep:
    """``step(*inputs)`` = ``optimizer.zero_grad(set_to_none=True)``; ``loss =
    model(*inputs)``; ``loss.backward()``; (``clip_grad_norm_`` to ``max_grad_norm`` if
    given); ``optimizer.step()``; returns the loss (detached, a tensor of its own). Eager for
    the first ``warmup`` calls, then one CUDA graph (module docstring). ``grad_norm``: the
    last step's total gradient norm before clipping, when ``max_grad_norm`` is given."""

    def __init__(self, model, optimizer, warmup: int = 3, max_grad_norm: float | None = None):
        """``model``: called with a step's arguments, it returns the loss (or an output with
        ``.loss``); ``optimizer``: over its parameters (``capturable=True`` on a GPU)."""
        self.model, self.optimizer = model, optimizer
        self.warmup = v.check_positive_int("warmup", warmup)
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise v.CodaInputError(f"max_grad_norm: must be > 0 or None, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cuda = bool(self.params) and self.params[0].is_cuda
        if self.cuda:
            check_one_device(self.params)
            check_capturable(optimizer)
        self.device_index = self.params[0].get_device() if self.cuda else -1
        self.grad_norm = None
        self._calls, self._signature, self._graph = 0, None, None
        self._args = self._kwargs = self._loss = None

    @property
    def graphed(self) -> bool:
        """Whether calls now replay the captured graph."""
        return self._graph is not None

    def _step(self, args, kwargs):
        self.optimizer.zero_grad(set_to_none=True)  # inside a capture: .grad in its pool
        loss = _loss_of(self.model(*args, **kwargs))
        loss.backward()
        if self.max_grad_norm is not None:  # no host sync: capturable
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        return loss.detach()

    def _check(self, args, kwargs) -> None:
        sig = _signature(args, kwargs)
        if self._signature is None:
            self._signature = sig
        if sig.keys() != self._signature.keys():
            raise v.CodaInputError(
                f"inputs: the graphed step takes the arguments of its first call "
                f"({_names(self._signature)}); got {_names(sig)}"
            )
        for k, want in self._signature.items():
            if sig[k] != want:
                raise v.CodaInputError(
                    f"{_name(k)}: the graphed step holds one shape, its first call's "
                    f"({_describe(want)}); got {_describe(sig[k])}. Pad batches to one "
                    f"shape, or build one GraphedStep per shape"
                )

    def _capture(self, args, kwargs) -> None:
        """Record the step once; on failure nothing is kept (the next call tries again)."""
        buffers = [_buffer(a) for a in args], {k: _buffer(a) for k, a in kwargs.items()}
        graph = torch.cuda.CUDAGraph()
        try:
            with capture_memo(), torch.cuda.graph(graph):  # a step's tables made once in it
                loss = self._step(*buffers)
        except RuntimeError as e:
            raise RuntimeError(
                f"model: its training step could not be captured as a CUDA graph ({e}). A "
                f"captured step must not wait on the host or copy from pageable host memory. "
                f"Hugging Face's eager attention builds its mask from a host scalar (transformers "
                f"5.x): pass attn_implementation='sdpa', or train without GraphedStep"
            ) from e
        self._graph, (self._args, self._kwargs), self._loss = graph, buffers, loss

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if not self.cuda:
            return self._step(args, kwargs)
        if foreign(self.device_index):  # the model's GPU current for the step, its streams used
            with torch.cuda.device(self.device_index):
                return self(*args, **kwargs)
        self._check(args, kwargs)
        if self._graph is None and self._calls < self.warmup:
            self._calls += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._step(args, kwargs)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self._graph is None:  # capture records the step without running it
            self._capture(args, kwargs)
        pairs = [*zip(self._args, args), *((self._kwargs[k], kwargs[k]) for k in kwargs)]
        for buffer, a in pairs:
            if isinstance(a, torch.Tensor):
                buffer.copy_(a)
        self._graph.replay()
        return self._loss.clone()


def _buffer(a):
    return a.clone() if isinstance(a, torch.Tensor) else a


def _name(key) -> str:
    return f"inputs[{key}]" if isinstance(key, int) else key


def _names(sig) -> str:
    return ", ".join(_name(k) for k in sig) or "none"
