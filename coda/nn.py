"""nn.Modules for training: a Llama decoder layer and the final norm + LM head + loss.

``DecoderLayer``: pre-norm RMSNorm, GQA causal attention (torch SDPA / flash) with RoPE, SwiGLU
MLP, residuals. ``LMHeadLoss``: final RMSNorm, LM head and cross-entropy, logits never stored
on the kernel path. On an SM90 GPU with bf16 tensors they run ``coda.autograd``'s kernel
sequence; elsewhere the same math through the differentiable pure-torch reference
(``coda.env`` reports the choice).

Parameter layout (documented departure from HF): weights are (in, out) matrices in coda's
paired layouts, the ones the epilogues need: ``w_qkv`` = [q | k | v] with q and k in
adjacent-pair order, ``w_il`` = gate/up interleaved. Both are permutations of HF's weights,
so training in this layout is exactly training the HF model (elementwise optimizers are
unaffected; KERNELS.md [I3.3]). ``load_hf_state_dict`` / ``hf_state_dict`` convert exactly,
with HF's key names.
"""

from __future__ import annotations

import torch
from torch import nn

from coda import layouts
from coda.autograd import DecoderLayerFunction, LayerDims, LinearCrossEntropyFunction
from coda.env import resolve_backend
from coda.reference.cross_entropy import cross_entropy_ref
from coda.reference.layer import LayerShape, decoder_layer_ref
from coda.reference.rmsnorm import rmsnorm_ref


def _positions(batch: int, seq: int, device) -> torch.Tensor:
    return torch.arange(seq, device=device).repeat(batch)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        d: int,
        n_heads: int,
        n_kv_heads: int,
        ffn: int,
        head_dim: int = None,
        eps: float = 1e-5,
        rope_base: float = 10000.0,
        device=None,
        dtype=torch.bfloat16,
        backend: str = "auto",
    ):
        super().__init__()
        hd = head_dim or d // n_heads
        self.d, self.n_heads, self.n_kv_heads, self.head_dim, self.ffn = (
            d,
            n_heads,
            n_kv_heads,
            hd,
            ffn,
        )
        self.eps, self.rope_base, self.backend = eps, rope_base, backend
        nqkv = (n_heads + 2 * n_kv_heads) * hd
        kw = {"device": device, "dtype": dtype}
        self.g1 = nn.Parameter(torch.ones(d, **kw))
        self.w_qkv = nn.Parameter(torch.empty(d, nqkv, **kw))
        self.w_o = nn.Parameter(torch.empty(n_heads * hd, d, **kw))
        self.g2 = nn.Parameter(torch.ones(d, **kw))
        self.w_il = nn.Parameter(torch.empty(d, 2 * ffn, **kw))
        self.w_d = nn.Parameter(torch.empty(ffn, d, **kw))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w_qkv, self.w_o, self.w_il, self.w_d):
            nn.init.normal_(w, std=std)
        nn.init.ones_(self.g1)
        nn.init.ones_(self.g2)

    def _shape(self, batch, seq) -> LayerShape:
        return LayerShape(
            batch,
            seq,
            self.d,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.ffn,
            1,
            self.eps,
            self.rope_base,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, d) -> (batch, seq, d). Positions restart at 0 in every sequence."""
        B, S, d = x.shape
        xf = x.reshape(B * S, d)
        pos = _positions(B, S, x.device)
        if x.dtype != self.w_qkv.dtype:
            raise TypeError(
                f"DecoderLayer: x is {x.dtype} but the parameters are "
                f"{self.w_qkv.dtype}; cast one to the other"
            )
        if resolve_backend("DecoderLayer", self.backend, x.device, x.dtype) == "kernel":
            dims = LayerDims(
                B, S, self.n_heads, self.n_kv_heads, self.head_dim, self.eps, self.rope_base
            )
            out = DecoderLayerFunction.apply(
                xf.contiguous(),
                self.g1,
                self.w_qkv,
                self.w_o,
                self.g2,
                self.w_il,
                self.w_d,
                pos,
                dims,
            )
        else:
            w = {
                "g1": self.g1,
                "wqkv": self.w_qkv,
                "wo": self.w_o,
                "g2": self.g2,
                "w_il": self.w_il,
                "wd": self.w_d,
            }
            out = decoder_layer_ref(xf, w, self._shape(B, S), pos.cpu())
        return out.view(B, S, d)

    # -- Hugging Face weights ------------------------------------------------------------------
    def hf_state_dict(self, prefix: str = "") -> dict:
        """This layer's weights as HF ``LlamaDecoderLayer`` tensors (exact permutations)."""
        q, k, v = layouts.qkv_weight_to_hf(
            self.w_qkv.detach(),
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
        )
        gate, up = layouts.gate_up_weight_to_hf(self.w_il.detach())
        p = prefix
        return {
            f"{p}input_layernorm.weight": self.g1.detach().clone(),
            f"{p}self_attn.q_proj.weight": q,
            f"{p}self_attn.k_proj.weight": k,
            f"{p}self_attn.v_proj.weight": v,
            f"{p}self_attn.o_proj.weight": self.w_o.detach().t().contiguous(),
            f"{p}post_attention_layernorm.weight": self.g2.detach().clone(),
            f"{p}mlp.gate_proj.weight": gate,
            f"{p}mlp.up_proj.weight": up,
            f"{p}mlp.down_proj.weight": self.w_d.detach().t().contiguous(),
        }

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict, prefix: str = "") -> None:
        p = prefix
        self.g1.copy_(sd[f"{p}input_layernorm.weight"])
        self.w_qkv.copy_(
            layouts.qkv_weight_from_hf(
                sd[f"{p}self_attn.q_proj.weight"],
                sd[f"{p}self_attn.k_proj.weight"],
                sd[f"{p}self_attn.v_proj.weight"],
                n_heads=self.n_heads,
                n_kv_heads=self.n_kv_heads,
            )
        )
        self.w_o.copy_(sd[f"{p}self_attn.o_proj.weight"].t())
        self.g2.copy_(sd[f"{p}post_attention_layernorm.weight"])
        self.w_il.copy_(
            layouts.gate_up_weight_from_hf(
                sd[f"{p}mlp.gate_proj.weight"], sd[f"{p}mlp.up_proj.weight"]
            )
        )
        self.w_d.copy_(sd[f"{p}mlp.down_proj.weight"].t())


class LMHeadLoss(nn.Module):
    """Final RMSNorm + LM head + cross-entropy. ``w_lm`` is (d, vocab).

    ``method`` picks the kernel path's cross-entropy program: "recompute" (CE-A: the logits
    are recomputed in the backward, 4 GEMMs, least memory, any reduction) or "chunked" (CE-C:
    3 GEMMs, gradients formed in the forward chunk by chunk; reduction "mean" or "sum")."""

    def __init__(
        self,
        d: int,
        vocab: int,
        eps: float = 1e-5,
        ignore_index: int = -100,
        chunk: int = 16384,
        method: str = "recompute",
        device=None,
        dtype=torch.bfloat16,
        backend: str = "auto",
    ):
        super().__init__()
        if method not in ("recompute", "chunked"):
            raise ValueError(f"method must be 'recompute' or 'chunked', got {method!r}")
        self.eps, self.ignore_index, self.chunk, self.backend = eps, ignore_index, chunk, backend
        self.method = method
        self.gf = nn.Parameter(torch.ones(d, device=device, dtype=dtype))
        self.w_lm = nn.Parameter(torch.empty(d, vocab, device=device, dtype=dtype))
        nn.init.normal_(self.w_lm, std=0.02)

    def forward(self, x: torch.Tensor, target: torch.Tensor, reduction: str = "mean"):
        """x (..., d), target (...) -> the loss (fp32)."""
        xf, t = x.reshape(-1, x.shape[-1]), target.reshape(-1)
        if x.dtype != self.w_lm.dtype:
            raise TypeError(
                f"LMHeadLoss: x is {x.dtype} but the parameters are "
                f"{self.w_lm.dtype}; cast one to the other"
            )
        if self.method == "chunked" and reduction == "none":
            raise ValueError("LMHeadLoss(method='chunked') takes reduction 'mean' or 'sum'")
        if resolve_backend("LMHeadLoss", self.backend, x.device, x.dtype) == "kernel":
            return LinearCrossEntropyFunction.apply(
                xf.contiguous(),
                self.gf,
                self.w_lm,
                t,
                self.eps,
                self.ignore_index,
                reduction,
                self.chunk,
                self.method,
            )
        logits = rmsnorm_ref(xf, self.gf, self.eps) @ self.w_lm  # HF: in x's dtype; CE in fp32+
        return cross_entropy_ref(logits, t, self.ignore_index, reduction)

    def hf_state_dict(self) -> dict:
        return {
            "model.norm.weight": self.gf.detach().clone(),
            "lm_head.weight": self.w_lm.detach().t().contiguous(),
        }

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict) -> None:
        self.gf.copy_(sd["model.norm.weight"])
        self.w_lm.copy_(sd["lm_head.weight"].t())
