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
import torch.utils.checkpoint
from torch import nn

from coda import _validate as v
from coda import layouts
from coda.autograd import (
    LM_HEAD_METHODS,
    LayerDims,
    LinearCrossEntropyFunction,
    decoder_layer,
    resolve_lm_head_method,
)
from coda.env import (
    BACKENDS,
    autocast_off,
    capturing,
    compute_dtype,
    resolve_backend,
)
from coda.kernels.gemm_rope import default_positions, position_rows, shared_freq_table
from coda.reference.cross_entropy import cross_entropy_ref
from coda.reference.layer import LayerShape, decoder_layer_ref
from coda.reference.rmsnorm import rmsnorm_ref


def _in_dtype(dtype, *tensors):
    """``tensors`` cast to ``dtype`` (autocast's per-call casts, differentiable), each left as
    it is when already in it: a no-op ``.to`` still costs ~1 us of host time per tensor."""
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


def _tma_rule(**dims) -> str | None:
    """The kernel path's GEMMs read and write rows through the TMA: 16-byte rows, so every
    K and N is a multiple of 8 bf16 elements. Returns the first broken rule, or None."""
    for name, n in dims.items():
        if n % 8:
            return f"{name} = {n} is not a multiple of 8 (the TMA needs 16-byte rows in bf16)"
    return None


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer. ``attention``: a callable (q, k, v) -> o on
    (batch, heads, seq, head_dim) tensors (k, v with n_kv_heads heads; causal), used by both
    paths in place of the default causal GQA SDPA (e.g. a flash-attention or HF attention
    function); it is differentiated by autograd. ``qk_norm``: Qwen3's per-head RMSNorm of q
    and k before RoPE (weights ``q_norm``, ``k_norm`` of head_dim, eps = ``eps``)."""

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
        attention=None,
        inv_freq=None,
        qk_norm: bool = False,
    ):
        super().__init__()
        hd = v.check_heads(d, n_heads, n_kv_heads, head_dim)
        if inv_freq is None:
            inv_freq = rope_base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        v.check_tensor("inv_freq", inv_freq)
        if inv_freq.shape != (hd // 2,):
            raise v.CodaInputError(
                f"inv_freq: expected shape (head_dim / 2,) = ({hd // 2},), got "
                f"{tuple(inv_freq.shape)}"
            )
        # RoPE's inverse frequencies (plain attributes, not buffers: ``.to(dtype)`` must not
        # round them); the kernel's float-float table is derived once per device
        self._inv_freq = inv_freq.detach().to("cpu", torch.float64)
        self._rope_tables = {}
        if attention is not None and not callable(attention):
            raise v.CodaInputError(
                f"attention: must be a callable (q, k, v) -> o, got {attention!r}"
            )
        self.attention = attention
        v.check_positive_int("ffn", ffn)
        v.check_eps(eps)
        if not rope_base > 0:
            raise v.CodaInputError(f"rope_base: must be positive, got {rope_base!r}")
        v.check_choice("backend", backend, BACKENDS)
        self._kernel_rule = _tma_rule(
            d=d,
            ffn=ffn,
            **{
                "n_heads * head_dim": n_heads * hd,
                "(n_heads + 2 n_kv_heads) head_dim": (n_heads + 2 * n_kv_heads) * hd,
            },
        )
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
        # Qwen3's per-head QK-norm weights (hd,), in the adjacent-pair order of w_qkv's heads
        self.q_norm = nn.Parameter(torch.ones(hd, **kw)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd, **kw)) if qk_norm else None
        self.reset_parameters()
        self._build_rope_tables()

    def _build_rope_tables(self):
        """The RoPE tables for the device the layer's weights are on, built when the layer is
        made or moved (``_apply``), so that a call never fills them: a table cached inside a
        torch.compile trace would change what the trace's guards saw, and recompile the next
        call. A call on another device still builds its own on first use."""
        self._rope_tables.clear()
        device = self.g1.device
        self._on_device("inv_freq", device, lambda d: self._inv_freq.to(d))
        self._freq_table(device)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .double(), ...: tables follow
        out = super()._apply(fn, recurse)
        self._build_rope_tables()
        return out

    @property
    def qk_norm(self) -> bool:
        """Whether the layer has Qwen3's QK-norm (its q_norm / k_norm weights)."""
        return self.q_norm is not None

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w_qkv, self.w_o, self.w_il, self.w_d):
            nn.init.normal_(w, std=std)
        for g in (self.g1, self.g2, self.q_norm, self.k_norm):
            if g is not None:
                nn.init.ones_(g)

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

    def forward(
        self, x: torch.Tensor, positions=None, rope_cos_sin=None, attention=None
    ) -> torch.Tensor:
        """x (batch, seq, d) -> (batch, seq, d).

        ``positions`` (batch, seq) integer token positions (packed sequences restart them per
        document); default 0..seq-1 in every sequence. ``rope_cos_sin``: HF's (cos, sin)
        tables (batch, seq, head_dim), used as given by the reference path (so a patched HF
        model computes exactly its own RoPE); the kernel path forms the same angles in its
        epilogue from positions and the layer's inverse frequencies. ``attention`` overrides
        the layer's attention callable for this call (HF's, with its mask and cache)."""
        attention = attention or self.attention
        v.check_activation("DecoderLayer", x, self.d, self.w_qkv)
        B, S, d = x.shape
        pos = self._positions(positions, B, S, x.device)
        if resolve_backend("DecoderLayer", self.backend, x.device, compute_dtype(x)) == "kernel":
            if self._kernel_rule:
                raise v.CodaInputError(f"DecoderLayer (kernel path): {self._kernel_rule}")
            return self._kernel_forward(x, pos, attention)
        w = {
            "g1": self.g1,
            "wqkv": self.w_qkv,
            "wo": self.w_o,
            "g2": self.g2,
            "w_il": self.w_il,
            "wd": self.w_d,
        }
        if self.qk_norm:
            w["q_norm"], w["k_norm"] = self.q_norm, self.k_norm
        if rope_cos_sin is not None:  # HF's halves -> coda's adjacent (cos, sin) pairs
            half = self.head_dim // 2
            cos, sin = (t.expand(B, S, -1).reshape(B * S, -1)[:, :half] for t in rope_cos_sin)
            cs = torch.stack([cos, sin], dim=-1).flatten(1)
        else:
            inv = self._on_device("inv_freq", pos.device, lambda d: self._inv_freq.to(d))
            ang = pos.to(torch.float64)[:, None] * inv[None, :]
            cs = torch.stack([ang.cos(), ang.sin()], dim=-1).flatten(1)
        out = decoder_layer_ref(x.reshape(B * S, d), w, self._shape(B, S), None, attention, cs)
        return out.view(B, S, d)

    def _positions(self, positions, B, S, device):
        if positions is None:
            return default_positions(B, S, device)
        v.check_tensor("positions", positions)
        n = positions.numel()
        if positions.is_floating_point() or positions.shape[-1] != S or n not in (S, B * S):
            raise v.CodaInputError(
                f"positions: expected integer (batch, seq) = ({B}, {S}) or (seq,), got "
                f"{positions.dtype} {tuple(positions.shape)}"
            )
        return position_rows(positions, B, device)

    def _on_device(self, name, device, build):
        """A RoPE table derived from the inverse frequencies, built once per device (a host to
        device copy on every call would stall the stream)."""
        key = (name, device)
        if key not in self._rope_tables:
            if capturing():  # built inside a CUDA graph capture: used there, never kept
                return build(device)
            self._rope_tables[key] = build(device)
        return self._rope_tables[key]

    def _freq_table(self, device):
        """The RoPE epilogue's per-column frequency table (float-float turns)."""
        heads = (self.n_heads + self.n_kv_heads, self.n_kv_heads)
        return self._on_device(
            "freq", device, lambda d: shared_freq_table(self._inv_freq, heads, d)
        )

    def _kernel_forward(self, x: torch.Tensor, positions=None, attention=None) -> torch.Tensor:
        """The kernel sequence (``coda.autograd``). On an SM90 GPU its GEMMs are the SM90
        kernels; with CPU tensors every epilogue program runs through the tile interpreter
        (``coda.kernels._launch``), which is how CI tests this exact code path. Inside
        ``torch.autocast`` (bf16) x and the parameters are cast to bf16 first (``compute_dtype``;
        the casts are differentiable: fp32 parameters get fp32 gradients, as under autocast)."""
        B, S, d = x.shape
        pos = default_positions(B, S, x.device) if positions is None else positions
        dims = LayerDims(
            B, S, self.n_heads, self.n_kv_heads, self.head_dim, self.eps, self.rope_base
        )
        dtype = compute_dtype(x)
        x, g1, w_qkv, w_o, g2, w_il, w_d = _in_dtype(
            dtype, x, self.g1, self.w_qkv, self.w_o, self.g2, self.w_il, self.w_d
        )
        qk = _in_dtype(dtype, self.q_norm, self.k_norm) if self.qk_norm else None
        with autocast_off(x.device):
            out = decoder_layer(
                x.reshape(B * S, d).contiguous(),
                g1,
                w_qkv,
                w_o,
                g2,
                w_il,
                w_d,
                pos,
                dims,
                attention or self.attention,
                self._freq_table(x.device),
                qk,
            )
        return out.view(B, S, d)

    # -- Hugging Face weights ------------------------------------------------------------------
    def hf_state_dict(self, prefix: str = "", grad: bool = False) -> dict:
        """This layer's weights (or, with ``grad``, their gradients) as HF
        ``LlamaDecoderLayer`` tensors (exact permutations)."""

        def t(p):
            return (p.grad if grad else p).detach()

        q, k, v = layouts.qkv_weight_to_hf(
            t(self.w_qkv),
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
        )
        gate, up = layouts.gate_up_weight_to_hf(t(self.w_il))
        p = prefix
        return {
            f"{p}input_layernorm.weight": t(self.g1).clone(),
            f"{p}self_attn.q_proj.weight": q,
            f"{p}self_attn.k_proj.weight": k,
            f"{p}self_attn.v_proj.weight": v,
            f"{p}self_attn.o_proj.weight": t(self.w_o).t().contiguous(),
            f"{p}post_attention_layernorm.weight": t(self.g2).clone(),
            f"{p}mlp.gate_proj.weight": gate,
            f"{p}mlp.up_proj.weight": up,
            f"{p}mlp.down_proj.weight": t(self.w_d).t().contiguous(),
            **(
                {
                    f"{p}self_attn.q_norm.weight": layouts.head_weight_to_hf(t(self.q_norm)),
                    f"{p}self_attn.k_norm.weight": layouts.head_weight_to_hf(t(self.k_norm)),
                }
                if self.qk_norm
                else {}
            ),
        }

    def hf_shapes(self, prefix: str = "") -> dict:
        """{HF key: shape} of this layer's weights in a ``LlamaDecoderLayer`` state dict."""
        d, f = self.d, self.ffn
        nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        shapes = {
            "input_layernorm.weight": (d,),
            "self_attn.q_proj.weight": (nq, d),
            "self_attn.k_proj.weight": (nkv, d),
            "self_attn.v_proj.weight": (nkv, d),
            "self_attn.o_proj.weight": (d, nq),
            "post_attention_layernorm.weight": (d,),
            "mlp.gate_proj.weight": (f, d),
            "mlp.up_proj.weight": (f, d),
            "mlp.down_proj.weight": (d, f),
        }
        if self.qk_norm:
            shapes["self_attn.q_norm.weight"] = (self.head_dim,)
            shapes["self_attn.k_norm.weight"] = (self.head_dim,)
        return {prefix + k: s for k, s in shapes.items()}

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict, prefix: str = "") -> None:
        """Load HF ``LlamaDecoderLayer`` weights (keys under ``prefix``); a missing key or a
        wrong shape raises ``CodaInputError`` naming the key."""
        for name, t in self.params_from_hf(sd, prefix).items():
            getattr(self, name).copy_(t)

    def params_from_hf(self, sd: dict, prefix: str = "") -> dict:
        """{parameter name: tensor in coda's layout} from HF ``LlamaDecoderLayer`` (or
        ``Qwen3DecoderLayer``) weights under ``prefix``, validated (exact permutations)."""
        v.check_state_dict(sd, self.hf_shapes(prefix))

        def hf(key):
            return sd[prefix + key]

        out = {
            "g1": hf("input_layernorm.weight"),
            "w_qkv": layouts.qkv_weight_from_hf(
                hf("self_attn.q_proj.weight"),
                hf("self_attn.k_proj.weight"),
                hf("self_attn.v_proj.weight"),
                n_heads=self.n_heads,
                n_kv_heads=self.n_kv_heads,
            ),
            "w_o": hf("self_attn.o_proj.weight").t(),
            "g2": hf("post_attention_layernorm.weight"),
            "w_il": layouts.gate_up_weight_from_hf(
                hf("mlp.gate_proj.weight"), hf("mlp.up_proj.weight")
            ),
            "w_d": hf("mlp.down_proj.weight").t(),
        }
        if self.qk_norm:
            out["q_norm"] = layouts.head_weight_from_hf(hf("self_attn.q_norm.weight"))
            out["k_norm"] = layouts.head_weight_from_hf(hf("self_attn.k_norm.weight"))
        return out


class LMHeadLoss(nn.Module):
    """Final RMSNorm + LM head + cross-entropy. ``weight`` is (vocab, d), as ``nn.Linear``'s
    and HF's ``lm_head.weight``; ``w_lm`` is its (d, vocab) view, logits = y @ w_lm. Stored so,
    the kernel path's fp32 (vocab, d) weight-gradient accumulator leaves as the gradient without
    a transpose, and the exact target terms read each target's weights as one contiguous row
    (2.5 % of the step at d = 4096, vocab = 128256 on the H200: benchmarks/NOTES.md, session 15).

    ``method`` picks the kernel path's cross-entropy program: "auto" (the default: "scaled_exp"
    when vocab % 128 == 0, else "recompute"), "scaled_exp" (CE-S: three GEMMs, the forward
    stores the softmax numerators and the dX and dW GEMMs read them back; the fastest coda
    method on the H200 at every measured shape, benchmarks/NOTES.md; an fp32 vocab x d
    gradient buffer and ~1 GiB of numerators per token chunk), "recompute" (CE-A: the logits
    are recomputed in the backward, 4 GEMMs, least memory) or "chunked" (CE-C: 3 GEMMs, the
    logits stored per token chunk). With reduction "none" every method runs the recompute
    program. The three-GEMM programs form their gradients in fp32 at an upstream gradient
    g = 1 and apply g in the backward before the one rounding to bf16, so any g (a mean loss,
    gradient accumulation, loss scaling) gives PyTorch's rounding.
    ``label_smoothing`` is ``F.cross_entropy``'s; ``z_loss`` adds z * logsumexp(logits)^2 per
    non-ignored token (PaLM's auxiliary loss), reduced with the loss."""

    def __init__(
        self,
        d: int,
        vocab: int,
        eps: float = 1e-5,
        ignore_index: int = -100,
        chunk: int = 16384,
        method: str = "auto",
        device=None,
        dtype=torch.bfloat16,
        backend: str = "auto",
        label_smoothing: float = 0.0,
        z_loss: float = 0.0,
    ):
        super().__init__()
        self.label_smoothing, self.z_loss = v.check_ce_options(label_smoothing, z_loss)
        v.check_positive_int("d", d)
        v.check_positive_int("vocab", vocab)
        v.check_positive_int("chunk", chunk)
        v.check_eps(eps)
        v.check_choice("method", method, LM_HEAD_METHODS)
        v.check_choice("backend", backend, BACKENDS)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise v.CodaInputError(f"ignore_index: must be an int, got {ignore_index!r}")
        self.d, self.vocab = d, vocab
        self.eps, self.ignore_index, self.chunk, self.backend = eps, ignore_index, chunk, backend
        self.method = method
        self.gf = nn.Parameter(torch.ones(d, device=device, dtype=dtype))
        self.weight = nn.Parameter(torch.empty(vocab, d, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)

    @property
    def w_lm(self) -> torch.Tensor:
        """The LM head as the (d, vocab) matrix of logits = y @ w_lm: a view of ``weight``."""
        return self.weight.t()

    def __setattr__(self, name, value):
        # nn.Module registers an assigned Parameter under its name before any property
        # setter runs: ``head.w_lm = p`` would add a parameter the loss never reads
        if name == "w_lm":
            raise AttributeError(
                "LMHeadLoss.w_lm is the (d, vocab) view of weight (vocab, d): assign weight"
            )
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor, target: torch.Tensor, reduction: str = "mean"):
        """x (batch, seq, d) or (tokens, d), target (batch, seq) or (tokens,) int64/int32 in
        [0, vocab) or ``ignore_index`` -> the loss (fp32). reduction: "mean" (NaN when every
        target is ignored, as in PyTorch), "sum" or "none" (per-token losses)."""
        return lm_head_loss(
            x,
            self.gf,
            self.w_lm,
            target,
            eps=self.eps,
            ignore_index=self.ignore_index,
            reduction=reduction,
            method=self.method,
            chunk=self.chunk,
            backend=self.backend,
            label_smoothing=self.label_smoothing,
            z_loss=self.z_loss,
        )

    def _kernel_loss(self, xf, t, reduction):
        """The kernel sequence on (tokens, d) rows (on CPU tensors: through the interpreter)."""
        return _kernel_lm_head_loss(
            xf,
            self.gf,
            self.w_lm,
            t,
            self.eps,
            self.ignore_index,
            reduction,
            self.chunk,
            self.method,
            self.label_smoothing,
            self.z_loss,
        )

    def hf_state_dict(self) -> dict:
        return {
            "model.norm.weight": self.gf.detach().clone(),
            "lm_head.weight": self.weight.detach().clone(),
        }

    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict) -> None:
        """Load HF ``model.norm.weight`` and ``lm_head.weight``; a missing key or a wrong shape
        raises ``CodaInputError`` naming the key."""
        shapes = {"model.norm.weight": (self.d,), "lm_head.weight": (self.vocab, self.d)}
        v.check_state_dict(sd, shapes)
        self.gf.copy_(sd["model.norm.weight"])
        self.weight.copy_(sd["lm_head.weight"])


def _kernel_lm_head_loss(xf, gamma, w_lm, t, eps, ignore_index, reduction, chunk, method, *opts):
    """The LM head's kernel sequence on validated (tokens, d) rows (``coda.autograd``); the
    program is chosen once here, knowing whether a gradient will be taken
    (``resolve_lm_head_method``)."""
    needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in (xf, gamma, w_lm))
    method = resolve_lm_head_method(method, w_lm.shape[1], needs_grad)
    args = (eps, ignore_index, reduction, chunk, method, *opts)
    # bf16 inside torch.autocast, as DecoderLayer's kernel path; w_lm is cast inside the
    # Function, which returns its gradient in w_lm's own dtype (fp32 unrounded, for CE-C/CE-S)
    xf, gamma = _in_dtype(compute_dtype(xf), xf, gamma)
    with autocast_off(xf.device):
        return LinearCrossEntropyFunction.apply(xf.contiguous(), gamma, w_lm, t, *args)


def lm_head_loss(
    x,
    gamma,
    w_lm,
    target,
    *,
    eps: float = 1e-5,
    ignore_index: int = -100,
    reduction: str = "mean",
    method: str = "auto",
    chunk: int = 16384,
    backend: str = "auto",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
):
    """Final RMSNorm (``gamma``) + LM head (``w_lm`` (d, vocab), either major: an HF
    ``lm_head.weight.t()`` view is fine) + cross-entropy, with parameters given: what
    ``LMHeadLoss`` computes, for models that own their weights (``coda.transformers``)."""
    v.check_tensor("w_lm", w_lm)
    if w_lm.dim() != 2:
        raise v.CodaInputError(f"w_lm: expected a 2-D (d, vocab) tensor, got {tuple(w_lm.shape)}")
    d, vocab = w_lm.shape
    v.check_activation("lm_head_loss", x, d, w_lm, ndim=(2, 3))
    v.check_vector("gamma", gamma, ("d", d))
    v.check_choice("reduction", reduction, v.REDUCTIONS)
    v.check_choice("method", method, LM_HEAD_METHODS)
    label_smoothing, z_loss = v.check_ce_options(label_smoothing, z_loss)
    t = v.check_targets(target, x.shape[:-1], vocab, ignore_index)
    xf = x.reshape(-1, d)
    if resolve_backend("LMHeadLoss", backend, x.device, compute_dtype(x)) == "kernel":
        rule = _tma_rule(d=d, vocab=vocab)
        if rule and vocab % 8:  # the usual case: a token added to a vocabulary
            rule += (
                "; an HF model can pad its embedding and head: "
                "model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=128)"
            )
        if not rule and method == "scaled_exp" and vocab % 128:
            rule = f"method 'scaled_exp' needs vocab % 128 == 0 (its strips), got {vocab}"
        if rule:
            raise v.CodaInputError(f"LMHeadLoss (kernel path): {rule}")
        loss = _kernel_lm_head_loss(
            xf, gamma, w_lm, t, eps, ignore_index, reduction, chunk, method, label_smoothing, z_loss
        )
    else:
        logits = rmsnorm_ref(xf, gamma, eps) @ w_lm  # as HF: in x's dtype, the loss in fp32+
        loss = cross_entropy_ref(logits, t, ignore_index, reduction, label_smoothing, z_loss)
    return loss.view(target.shape) if reduction == "none" else loss


class CausalLM(nn.Module):
    """A Llama-style causal LM built from coda's modules: token embedding, ``n_layers``
    ``DecoderLayer``s, and ``LMHeadLoss`` (final norm + LM head + cross-entropy, logits never
    stored on the kernel path). ``forward(tokens, targets)`` returns the loss.

    ``hf_state_dict`` / ``load_hf_state_dict`` use ``LlamaForCausalLM``'s key names, exactly.
    ``tie_embeddings``: the LM head's (vocab, d) weight is the embedding's, one parameter (HF's
    ``tie_word_embeddings``, as in Llama-3.2-1B and Qwen3-0.6B); its gradient is the sum of both
    uses, and a loaded state dict's ``lm_head.weight`` must then equal its embedding.
    ``checkpoint``: activation checkpointing per layer
    (``torch.utils.checkpoint``, non-reentrant): each layer keeps only its input and reruns
    its forward in the backward."""

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
    ):
        super().__init__()
        v.check_positive_int("n_layers", n_layers)
        self.checkpoint = bool(checkpoint)
        kw = {"device": device, "dtype": dtype, "backend": backend}
        self.embed = nn.Embedding(vocab, d, device=device, dtype=dtype)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(
            DecoderLayer(d, n_heads, n_kv_heads, ffn, head_dim, eps, rope_base, **kw)
            for _ in range(n_layers)
        )
        self.head = LMHeadLoss(d, vocab, eps, method=method, **kw)
        if tie_embeddings:
            self.head.weight = self.embed.weight

    @property
    def tie_embeddings(self) -> bool:
        """Whether the LM head's weight is the embedding's (one parameter)."""
        return self.head.weight is self.embed.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
        """tokens, targets (batch, seq) -> the loss (fp32)."""
        v.check_tensor("tokens", tokens)
        if tokens.dim() != 2 or tokens.is_floating_point():
            raise v.CodaInputError(
                f"tokens: must be an integer (batch, seq) tensor, got {tokens.dtype} "
                f"{tuple(tokens.shape)}"
            )
        x = self.embed(tokens)
        for layer in self.layers:
            if self.checkpoint and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(x, targets, reduction)

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
