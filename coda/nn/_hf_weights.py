"""``DecoderLayer``'s Hugging Face weights: which HF ``LlamaDecoderLayer`` keys each coda
weight is made from (``HF_KEYS``; ``POST_NORM_KEYS`` for a layer with a norm after each
sublayer), and the exact conversions both ways (coda's paired layouts are permutations of HF's
weights: ``coda.layouts``), as a mixin of the layer."""

from __future__ import annotations

import torch

from coda import _validate as v
from coda import layouts
from coda.kernels.gemm_swiglu import UNGATED

HF_KEYS = {  # each weight of a layer: the HF ``LlamaDecoderLayer`` weights it is made from
    "attention_norm": ("input_layernorm.weight",),
    "w_qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "w_o": ("self_attn.o_proj.weight",),
    "ffn_norm": ("post_attention_layernorm.weight",),
    "w_il": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "w_d": ("mlp.down_proj.weight",),
    "q_norm": ("self_attn.q_norm.weight",),
    "k_norm": ("self_attn.k_norm.weight",),
    "bias_qkv": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "bias_o": ("self_attn.o_proj.bias",),
}
# every norm gain a layer may have: weightless norms (``DecoderLayer(norm_gains=False)``,
# NanoChat's) keep them as constant buffers, which HF's layer has no key for
GAINS = ("attention_norm", "ffn_norm", "q_norm", "k_norm", "post_attention_norm", "post_ffn_norm")
# a layer with a norm after each sublayer (Gemma 2's and 3's): HF's pre-MLP norm is
# ``pre_feedforward_layernorm``, and ``post_attention_layernorm`` norms the attention's output
POST_NORM_KEYS = {
    **HF_KEYS,
    "ffn_norm": ("pre_feedforward_layernorm.weight",),
    "post_attention_norm": ("post_attention_layernorm.weight",),
    "post_ffn_norm": ("post_feedforward_layernorm.weight",),
}


class HFWeights:
    """``DecoderLayer``'s HF state-dict methods (the layer's dimensions, weights and
    ``post_norms`` are the layer's own)."""

    def _hf_keys(self) -> dict:
        """{coda weight: its HF keys}: ``HF_KEYS``, or ``POST_NORM_KEYS`` with post-norms;
        without a gate (Arcee's MLP) W_il is ``up_proj`` alone."""
        keys = POST_NORM_KEYS if self.post_norms else HF_KEYS
        return {**keys, "w_il": ("mlp.up_proj.weight",)} if self._ungated() else keys

    def _ungated(self) -> bool:
        """Whether the MLP has no gate (W_il is W_up alone: ``gemm_swiglu.UNGATED``)."""
        return self.activation in UNGATED

    def _hf_weights(self) -> list[str]:
        """This layer's weights that HF has (``HF_KEYS``; q_norm / k_norm with QK-norm only,
        bias_qkv and bias_o with those biases only, the post-norms' with them only; no gains
        for weightless norms)."""
        return [
            name
            for name in self._hf_keys()
            if getattr(self, name) is not None and (self.norm_gains or name not in GAINS)
        ]

    def hf_state_dict(self, prefix: str = "", grad: bool = False) -> dict:
        """This layer's weights (or, with ``grad``, their gradients) as HF
        ``LlamaDecoderLayer`` tensors (exact permutations), keyed as ``HF_KEYS`` says. With
        ``grad`` a weight without a gradient (frozen, or no backward yet) is left out."""
        heads = {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}
        to_hf = {
            "w_qkv": lambda x: layouts.qkv_weight_to_hf(x, **heads, head_dim=self.head_dim),
            "w_il": (lambda x: (x.t().contiguous(),))
            if self._ungated()
            else layouts.gate_up_weight_to_hf,
            "w_o": lambda x: (x.t().contiguous(),),
            "w_d": lambda x: (x.t().contiguous(),),
            "q_norm": lambda x: (layouts.head_weight_to_hf(x, self.head_dim),),
            "k_norm": lambda x: (layouts.head_weight_to_hf(x, self.head_dim),),
            "bias_qkv": lambda x: layouts.qkv_bias_to_hf(x, **heads, head_dim=self.head_dim),
        }
        out = {}
        for name in self._hf_weights():
            t = getattr(self, name)
            t = t.grad if grad else t
            if t is None:  # (no gradient)
                continue
            hf = to_hf.get(name, lambda x: (x.clone(),))(t.detach())
            out.update({prefix + k: x for k, x in zip(self._hf_keys()[name], hf)})
        return out

    def hf_shapes(self, prefix: str = "") -> dict:
        """{HF key: shape} of this layer's weights in a ``LlamaDecoderLayer`` state dict."""
        return self._llama_shapes(prefix)

    def _llama_shapes(self, prefix: str = "") -> dict:
        d, f, hd = self.d, self.ffn, self.head_dim
        nq, nkv = self.n_heads * hd, self.n_kv_heads * hd
        qk = (hd, hd) if self.q_norm is None else (self.q_norm.shape[0], self.k_norm.shape[0])
        shapes = {
            "attention_norm": [(d,)],
            "w_qkv": [(nq, d), (nkv, d), (nkv, d)],
            "w_o": [(d, nq)],
            "ffn_norm": [(d,)],
            "w_il": [(f, d)] if self._ungated() else [(f, d), (f, d)],
            "w_d": [(d, f)],
            "q_norm": [(qk[0],)],
            "k_norm": [(qk[1],)],
            "bias_qkv": [(nq,), (nkv,), (nkv,)],
            "bias_o": [(d,)],
            "post_attention_norm": [(d,)],
            "post_ffn_norm": [(d,)],
        }
        return {
            prefix + key: shape
            for name in self._hf_weights()
            for key, shape in zip(self._hf_keys()[name], shapes[name])
        }

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict, prefix: str = "") -> None:
        """Load HF ``LlamaDecoderLayer`` weights (keys under ``prefix``); a missing key or a
        wrong shape raises ``CodaInputError`` naming the key."""
        for name, t in self.params_from_hf(sd, prefix).items():
            getattr(self, name).copy_(t)

    def params_from_hf(self, sd: dict, prefix: str = "") -> dict:
        """{parameter name: tensor in coda's layout} from HF ``LlamaDecoderLayer`` (or
        ``Qwen3DecoderLayer``) weights under ``prefix``, validated (exact permutations)."""
        v.check_state_dict(sd, self._llama_shapes(prefix))
        heads = {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads}
        keys = self._hf_keys()
        from_hf = {
            "w_qkv": lambda q, k, v_: layouts.qkv_weight_from_hf(q, k, v_, **heads),
            "w_il": (lambda w: w.t()) if self._ungated() else layouts.gate_up_weight_from_hf,
            "w_o": lambda w: w.t(),
            "w_d": lambda w: w.t(),
            "q_norm": lambda w: layouts.head_weight_from_hf(w, self.head_dim),
            "k_norm": lambda w: layouts.head_weight_from_hf(w, self.head_dim),
            "bias_qkv": lambda q, k, v_: layouts.qkv_bias_from_hf(q, k, v_, **heads),
        }
        return {
            name: from_hf.get(name, lambda x: x)(*(sd[prefix + k] for k in keys[name]))
            for name in self._hf_weights()
        }
