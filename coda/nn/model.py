"""``CausalLM``: a Llama-style causal LM from coda's modules (embedding, ``DecoderLayer``s,
``LMHeadLoss``), with HF ``LlamaForCausalLM`` state-dict names."""

from __future__ import annotations

import torch
import torch.utils.checkpoint
from torch import nn

from coda import _validate as v
from coda.nn.embedding import Embedding
from coda.nn.head import LMHeadLoss
from coda.nn.layer import DecoderLayer


class CausalLM(nn.Module):
    """A Llama-style causal LM built from coda's modules: token embedding (``coda.nn.Embedding``:
    its backward coda's sorted scatter), ``n_layers``
    ``DecoderLayer``s, and ``LMHeadLoss`` (final norm + LM head + cross-entropy, logits never
    stored on the kernel path). ``forward(tokens, targets)`` returns the loss, ``logits(tokens)``
    the logits (for evaluation and sampling).

    ``hf_state_dict`` / ``load_hf_state_dict`` use ``LlamaForCausalLM``'s key names, exactly.
    ``tie_embeddings``: the LM head's (vocab, d) weight is the embedding's, one parameter (HF's
    ``tie_word_embeddings``, as in Llama-3.2-1B and Qwen3-0.6B); its gradient is the sum of both
    uses, and a loaded state dict's ``lm_head.weight`` must then equal its embedding.
    ``checkpoint``: activation checkpointing per layer
    (``torch.utils.checkpoint``, non-reentrant): each layer keeps only its input and reruns
    its forward in the backward. ``activation``: the layers' MLP activation, "silu" (SwiGLU),
    "gelu_tanh" (GeGLU), or without a gate "relu2" or "xielu" (``DecoderLayer``'s)."""

    def __init__(
        self,
        vocab: int,
        d: int,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        ffn: int,
        head_dim: int = None,
        eps: float = 1e-5,
        rope_base: float = 10000.0,
        method: str = "auto",
        device=None,
        dtype=torch.bfloat16,
        backend: str = "auto",
        checkpoint: bool = False,
        tie_embeddings: bool = False,
        activation: str = "silu",
    ):
        super().__init__()
        v.check_positive_int("n_layers", n_layers)
        v.check_param_dtype(dtype)
        self.checkpoint = bool(checkpoint)
        kw = {"device": device, "dtype": dtype, "backend": backend}
        layer_kw = {**kw, "activation": activation}
        # made uninitialized (nn.Embedding's own N(0, 1) draw skipped), then drawn here, so
        # the constructor draws in reset_parameters' order: embedding, layers, head
        weight = torch.empty(vocab, d, device=device, dtype=dtype)
        self.embed = Embedding(vocab, d, _weight=weight, backend=backend)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(
            DecoderLayer(d, n_heads, n_kv_heads, ffn, head_dim, eps, rope_base, **layer_kw)
            for _ in range(n_layers)
        )
        self.head = LMHeadLoss(d, vocab, eps, method=method, **kw)
        self._tied = bool(tie_embeddings)
        if self._tied:
            self.head.weight = self.embed.weight

    def _apply(self, fn, recurse=True):
        # a move that makes new tensors (``to_empty`` off the meta device) gives the two uses
        # of a tied weight two parameters: tie them again
        out = super()._apply(fn, recurse)
        if self._tied and self.head.weight is not self.embed.weight:
            self.head.weight = self.embed.weight
        return out

    def reset_parameters(self, std: float = 0.02):
        """Every weight ~ N(0, std), every norm gain 1, in one fixed order: a model made under
        ``torch.device("meta")`` (sharded before any memory is spent, as FSDP2 recipes do),
        then ``to_empty(device=...)`` and this, holds what the constructor would have made
        under the same seed. A tied LM head is the embedding, initialized once."""
        nn.init.normal_(self.embed.weight, std=std)
        for layer in self.layers:
            layer.reset_parameters(std)
        if self._tied:
            nn.init.ones_(self.head.final_norm)
        else:
            self.head.reset_parameters(std)

    @property
    def tie_embeddings(self) -> bool:
        """Whether the LM head's weight is the embedding's (one parameter)."""
        return self.head.weight is self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
        """tokens, targets (batch, seq) -> the loss (fp32)."""
        return self.head(self._hidden(tokens), targets, reduction)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab), for evaluation and sampling
        (``LMHeadLoss.logits``: the training loss never forms them)."""
        return self.head.logits(self._hidden(tokens))

    def _hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last layer's output rows, before the final norm."""
        v.check_tokens(tokens, self.embed.num_embeddings)
        x = self.embed(tokens)
        for layer in self.layers:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x

    def hf_state_dict(self) -> dict:
        sd = {"model.embed_tokens.weight": self.embed.weight.detach().clone()}
        for i, layer in enumerate(self.layers):
            sd.update(layer.hf_state_dict(f"model.layers.{i}."))
        return {**sd, **self.head.hf_state_dict()}

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict) -> None:
        v.check_state_dict(sd, {"model.embed_tokens.weight": tuple(self.embed.weight.shape)})
        if self.tie_embeddings and "lm_head.weight" in sd:
            if not torch.equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
                raise v.CodaInputError(
                    "lm_head.weight: a tied model (tie_embeddings=True) needs it equal to "
                    "model.embed_tokens.weight"
                )
        if self.tie_embeddings:  # HF drops the tied head's key when it saves
            sd = {"lm_head.weight": sd["model.embed_tokens.weight"], **sd}
        self.embed.weight.copy_(sd["model.embed_tokens.weight"])
        for i, layer in enumerate(self.layers):
            layer.load_hf_state_dict(sd, f"model.layers.{i}.")
        self.head.load_hf_state_dict(sd)
