"""nn.Modules for training: a Llama decoder layer, the final norm + LM head + loss, and a
causal LM built from them.

``DecoderLayer`` (``coda.nn.layer``): pre-norm RMSNorm, GQA causal attention (torch SDPA /
flash) with RoPE, SwiGLU (or GeGLU) MLP, residuals. ``LMHeadLoss`` and ``lm_head_loss``
(``coda.nn.head``): final RMSNorm, LM head and cross-entropy, logits never stored on the
kernel path. ``CausalLM`` (``coda.nn.model``): embedding, layers, head. On an SM90 GPU with
bf16 tensors they run ``coda.autograd``'s kernel sequences; elsewhere the same math through
the differentiable pure-torch reference (``coda.env`` reports the choice). ``GraphedStep``
(``coda.nn.graph``): a training step of any of them, captured once as a CUDA graph.
``Embedding`` (``coda.nn.embedding``): ``nn.Embedding`` with coda's deterministic backward
on the GPU. ``XIELU`` (``coda.nn.activation``): the learned numbers of a layer's xIELU MLP
activation (``DecoderLayer(activation="xielu")``, Apertus's), kept as HF keeps them.

Parameter layout (documented departure from HF): a layer's weights are (in, out) matrices in
coda's paired layouts, the ones the epilogues need: ``w_qkv`` = [q | k | v] with q and k in
adjacent-pair order, ``w_il`` = gate/up interleaved. Both are permutations of HF's weights,
so training in this layout is exactly training the HF model (elementwise optimizers are
unaffected; KERNELS.md [I3.3]). ``load_hf_state_dict`` / ``hf_state_dict`` convert exactly,
with HF's key names. The LM head's weight is (vocab, d), as HF's.
"""

from coda.nn.embedding import Embedding
from coda.nn.graph import GraphedStep
from coda.nn.head import LM_HEAD_METHODS, LMHeadLoss, lm_head_loss
from coda.nn.layer import DecoderLayer
from coda.nn.model import CausalLM

__all__ = [
    "LM_HEAD_METHODS",
    "CausalLM",
    "DecoderLayer",
    "Embedding",
    "GraphedStep",
    "LMHeadLoss",
    "lm_head_loss",
]
