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


def unsupported(max_norm=None, scale_grad_by_freq=False, sparse=False) -> list[str]:
    """The ``nn.Embedding`` features set here that the kernel's backward has not (empty: it
    covers the embedding)."""
    used = {
        "max_norm": max_norm is not None,
        "scale_grad_by_freq": scale_grad_by_freq,
        "sparse": sparse,
    }
    return [name for name, on in used.items() if on]


class Embedding(nn.Embedding):
    """A token embedding table (vocab, d). ``padding_idx``, ``_weight``, ``_freeze``,
    ``device`` and ``dtype`` as ``nn.Embedding``'s; ``max_norm``, ``scale_grad_by_freq`` and
    ``sparse`` are refused (the kernel's backward has none of them)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, *,
                 backend: str = "auto", max_norm=None, scale_grad_by_freq=False, sparse=False,
                 **kwargs):  # fmt: skip
        for name in unsupported(max_norm, scale_grad_by_freq, sparse):
            raise v.CodaInputError(f"Embedding: {name} is not supported")
        v.check_param_dtype(kwargs.get("dtype"))
        super().__init__(num_embeddings, embedding_dim, padding_idx, **kwargs)
        self.backend = backend

    @classmethod
    def adopt(cls, embed: nn.Embedding, backend: str = "auto") -> bool:
        """``embed`` made this class in place (the same module, parameter, tie, hooks and
        padding row) where it is a plain ``nn.Embedding`` whose features the kernel's backward
        covers; returns whether it was."""
        if type(embed) is not nn.Embedding:
            return False
        if unsupported(embed.max_norm, embed.scale_grad_by_freq, embed.sparse):
            return False
        embed.__class__ = cls
        embed.backend = backend
        return True

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.weight
        empty = tokens.numel() == 0
        if resolve_backend("Embedding", self.backend, w.device, w.dtype, empty) != "kernel":
            return super().forward(tokens)
        pad = -1 if self.padding_idx is None else self.padding_idx
        return EmbeddingFunction.apply(tokens, w, pad)
