"""``Embedding``: ``nn.Embedding`` (same parameters, state dict and initialization) whose
backward, for a bf16 weight on an SM90 GPU, is coda's sorted scatter of the output's gradient
rows (``coda.autograd.Embedding``: deterministic, one rounding per row); elsewhere, and with
``backend="reference"``, ``nn.Embedding`` itself.
"""

from __future__ import annotations

import torch
from torch import nn

from coda import _validate as v
from coda.autograd import Embedding as EmbeddingFunction
from coda.env import resolve_backend

_UNSUPPORTED = ("max_norm", "scale_grad_by_freq", "sparse")


class Embedding(nn.Embedding):
    """A token embedding table (vocab, d). ``padding_idx``, ``_weight``, ``_freeze``,
    ``device`` and ``dtype`` as ``nn.Embedding``'s; ``max_norm``, ``scale_grad_by_freq`` and
    ``sparse`` are refused (the kernel's backward has none of them)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, *,
                 backend: str = "auto", **kwargs):  # fmt: skip
        for name in _UNSUPPORTED:
            if kwargs.get(name):
                raise v.CodaInputError(f"Embedding: {name} is not supported")
        super().__init__(num_embeddings, embedding_dim, padding_idx, **kwargs)
        self.backend = backend

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if resolve_backend("Embedding", self.backend, w.device, w.dtype) != "kernel":
            return super().forward(tokens)
        pad = -1 if self.padding_idx is None else self.padding_idx
        return EmbeddingFunction.apply(tokens, w, pad)
