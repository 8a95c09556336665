"""A Llama-style causal LM in plain PyTorch with Hugging Face conventions: the peer every demo
and benchmark compares coda against (eager, ``torch.compile``, or with Liger's ops swapped in).

Weights come from an HF-layout state dict (``nn.Linear`` weights (out, in); keys as
``LlamaForCausalLM`` names them: ``model.embed_tokens.weight``, ``model.layers.{i}.*``,
``model.norm.weight``, ``lm_head.weight``; with Qwen3's ``self_attn.q_norm`` / ``k_norm``
weights present, q and k get its per-head RMSNorm before RoPE), so a coda model's
``hf_state_dict()`` builds the same function exactly. RMSNorm is ``F.rms_norm``, RoPE HF's
rotate_half, attention SDPA (causal, GQA), the loss ``F.cross_entropy`` on fp32 logits, as HF
computes them.

``ops`` swaps in other implementations by name (Liger's, in the benchmarks): ``rms_norm(h,
gamma, eps)``, ``rope(q, k, cos, sin)`` on (B, H, S, hd), ``swiglu(gate, up)``, and
``linear_ce(y, w_lm, target)`` (fused LM head + loss on the normed (tokens, d) activations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from coda.reference.rope import apply_rope_hf, hf_cos_sin

LAYER_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
QK_NORM_KEYS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # Qwen3's, optional


class LlamaLayerParams(nn.ParameterDict):
    """One layer's weights (keys as ``LAYER_KEYS`` with "_" for "."), callable as a module so
    per-layer wrappers (FSDP2's ``fully_shard``, ``torch.compile``) see the layer's forward:
    ``layer(x, cos, sin, model)`` runs ``model.layer`` on these weights."""

    __call__ = nn.Module.__call__  # ParameterDict itself refuses to be called

    def forward(self, x, cos, sin, model):
        return model.layer(x, self, cos, sin)


class TorchLlama(nn.Module):
    def __init__(
        self,
        hf_state_dict: dict,
        *,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        eps: float = 1e-5,
        rope_base: float = 10000.0,
        ops: dict | None = None,
    ):
        super().__init__()
        sd = hf_state_dict
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.eps, self.rope_base, self.ops = eps, rope_base, dict(ops or {})
        self.embed = nn.Parameter(sd["model.embed_tokens.weight"].detach().clone())
        self.layers = nn.ModuleList()
        for i in range(n_layers):
            p = LlamaLayerParams()
            for k in LAYER_KEYS + QK_NORM_KEYS:
                key = f"model.layers.{i}.{k}"
                if k in LAYER_KEYS or key in sd:  # Qwen3's QK-norm weights when present
                    p[k.replace(".", "_")] = nn.Parameter(sd[key].detach().clone())
            self.layers.append(p)
        self.norm = nn.Parameter(sd["model.norm.weight"].detach().clone())
        self.lm_head = nn.Parameter(sd["lm_head.weight"].detach().clone())

    @classmethod
    def of(cls, model, ops: dict | None = None) -> "TorchLlama":
        """The same model in plain PyTorch, from a coda model (anything with
        ``hf_state_dict()`` and ``layers`` of ``DecoderLayer`` shape attributes, e.g.
        ``coda.nn.CausalLM``): same weights, same function."""
        layer = model.layers[0]
        return cls(
            model.hf_state_dict(),
            n_layers=len(model.layers),
            n_heads=layer.n_heads,
            n_kv_heads=layer.n_kv_heads,
            head_dim=layer.head_dim,
            eps=layer.eps,
            rope_base=layer.rope_base,
            ops=ops,
        )

    def _norm(self, h, gamma):
        if "rms_norm" in self.ops:
            return self.ops["rms_norm"](h, gamma, self.eps)
        return F.rms_norm(h, (h.shape[-1],), gamma, self.eps)

    def layer(self, x, p, cos, sin):
        B, S, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv_heads, self.head_dim
        y = self._norm(x, p["input_layernorm_weight"])
        q = F.linear(y, p["self_attn_q_proj_weight"]).view(B, S, H, hd).transpose(1, 2)
        k = F.linear(y, p["self_attn_k_proj_weight"]).view(B, S, Hkv, hd).transpose(1, 2)
        v = F.linear(y, p["self_attn_v_proj_weight"]).view(B, S, Hkv, hd).transpose(1, 2)
        if "self_attn_q_norm_weight" in p:  # Qwen3: per-head RMSNorm of q and k before RoPE
            q, k = (
                self._norm(q, p["self_attn_q_norm_weight"]),
                self._norm(k, p["self_attn_k_norm_weight"]),
            )
        if "rope" in self.ops:
            q, k = self.ops["rope"](q, k, cos[None], sin[None])
        else:
            q, k = apply_rope_hf(q, cos, sin), apply_rope_hf(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + F.linear(o.transpose(1, 2).reshape(B, S, H * hd), p["self_attn_o_proj_weight"])
        y = self._norm(x, p["post_attention_layernorm_weight"])
        gate, up = F.linear(y, p["mlp_gate_proj_weight"]), F.linear(y, p["mlp_up_proj_weight"])
        s = self.ops["swiglu"](gate, up) if "swiglu" in self.ops else F.silu(gate) * up
        return x + F.linear(s, p["mlp_down_proj_weight"])

    def hidden(self, tokens):
        """The final hidden states, before the final norm: (B, S, d)."""
        x = F.embedding(tokens, self.embed)
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = hf_cos_sin(pos, self.head_dim, self.rope_base, x.dtype)
        for p in self.layers:
            x = p(x, cos, sin, self)
        return x

    def forward(self, tokens, targets, ignore_index: int = -100):
        """Mean cross-entropy of next-token ``targets`` (B, S) given ``tokens`` (B, S)."""
        y = self._norm(self.hidden(tokens), self.norm).flatten(0, 1)
        t = targets.reshape(-1)
        if "linear_ce" in self.ops:
            return self.ops["linear_ce"](y, self.lm_head, t)
        logits = F.linear(y, self.lm_head)
        return F.cross_entropy(logits.float(), t, ignore_index=ignore_index)


def single_layer_model(layer) -> TorchLlama:
    """The plain PyTorch form of one decoder layer (anything with ``hf_state_dict()`` and the
    layer's shape attributes, e.g. ``coda.nn.DecoderLayer``): a one-layer ``TorchLlama`` on its
    HF weights, whose ``layer(x, layers[0], cos, sin)`` is HF's layer. The embedding, final
    norm and head are unused placeholders."""
    sd = {f"model.layers.0.{k}": t for k, t in layer.hf_state_dict().items()}
    d = layer.d
    sd["model.embed_tokens.weight"] = torch.zeros(1, d)
    sd["model.norm.weight"] = torch.zeros(d)
    sd["lm_head.weight"] = torch.zeros(1, d)
    return TorchLlama(
        sd,
        n_layers=1,
        n_heads=layer.n_heads,
        n_kv_heads=layer.n_kv_heads,
        head_dim=layer.head_dim,
        eps=layer.eps,
        rope_base=layer.rope_base,
    )


def rope_tables(seq: int, head_dim: int, base: float, dtype, device):
    """HF's (cos, sin) tables for positions 0..seq-1: as HF's model code builds them (fp32
    angles), or, for float64, from exact float64 angles (the reference of the proofs)."""
    pos = torch.arange(seq, device=device)
    if dtype != torch.float64:
        return hf_cos_sin(pos, head_dim, base, dtype)
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    ang = pos.double()[:, None] * inv
    emb = torch.cat([ang, ang], -1)
    return emb.cos(), emb.sin()


def hf_layer_step(layer, x, dy):
    """HF's layer (``single_layer_model``) forward and backward on x (B, S, d) with output
    gradient dy: returns (output, dx, the layer's parameters with their ``.grad``)."""
    ref = single_layer_model(layer)
    xr = x.detach().clone().requires_grad_(True)
    cos, sin = rope_tables(x.shape[1], layer.head_dim, layer.rope_base, x.dtype, x.device)
    p = ref.layers[0]
    out = ref.layer(xr, p, cos, sin)
    out.backward(dy)
    return out.detach(), xr.grad, p
