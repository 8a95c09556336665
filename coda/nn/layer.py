"""``DecoderLayer``: a Llama decoder layer (or Qwen3's, with QK-norm; or Qwen2's, with QKV
biases; or Llama's with ``attention_bias=True``, an O-projection bias too; or Gemma's, Gemma
2's and 3's: GeGLU, 1 + w gains, a norm after each sublayer) whose kernel path is
``coda.autograd.decoder_layer``'s fused sequence (``coda.autograd_post_norm``'s with norms
after the sublayers): pre-norm RMSNorm, GQA causal attention (SDPA by default, any attention
callable) with RoPE, SwiGLU (or GeGLU) MLP, residuals. Weights in coda's paired layouts
(``coda.nn``'s docstring); HF state dicts convert exactly."""

from __future__ import annotations

import torch
from torch import nn

from coda import _validate as v
from coda.autograd import (
    LayerDims,
    decoder_layer,
)
from coda.autograd_post_norm import post_norm_decoder_layer
from coda.autograd_sublayer import attention_sublayer, norm_rows
from coda.env import (
    BACKENDS,
    autocast_off,
    capturing,
    compute_dtype,
    resolve_backend,
)
from coda.kernels.gemm_rope import (
    context_freq_table,
    default_positions,
    mrope_rows,
    mrope_section_table,
    position_rows,
    shared_freq_table,
    text_rows,
)
from coda.kernels.gemm_swiglu import MLP_ACTIVATIONS
from coda.kernels.qk_norm import is_per_head
from coda.nn._common import FormerNames, in_dtype, norm_gains, tma_aligned, tma_rule
from coda.nn._hf_weights import GAINS, HFWeights
from coda.nn._layer_options import check_mlp_module, long_rope, mrope_flags
from coda.nn.activation import XIELU
from coda.reference.layer import LayerShape, decoder_layer_ref


class DecoderLayer(FormerNames, HFWeights, nn.Module):
    """Pre-norm Llama decoder layer. ``attention``: a callable (q, k, v) -> o on
    (batch, heads, seq, head_dim) tensors (k, v with n_kv_heads heads; causal), used by both
    paths in place of the default causal GQA SDPA (e.g. a flash-attention or HF attention
    function); it is differentiated by autograd. ``qk_norm``: an RMSNorm of q and k before
    RoPE (eps = ``eps``), True or "head" Qwen3's per head (weights ``q_norm``, ``k_norm`` of
    head_dim), "whole" OLMo's over the whole projections (of n_heads and n_kv_heads
    head_dim).
    ``qkv_bias``: Qwen2's biases of the q, k and v projections (``bias_qkv``, (Nqkv,) in
    ``w_qkv``'s column order, added before RoPE; not with ``qk_norm``). ``o_bias``: the O
    projection's bias (``bias_o``, (d,), added in F3's epilogue); with ``qkv_bias``, Llama's
    ``attention_bias=True``. ``mrope_sections``: multimodal RoPE (Qwen2-VL's, with
    ``qkv_bias``; Qwen3-VL's, with ``qk_norm``): each of the head_dim / 2 frequencies'
    position row, 0 (time), 1 (height) or 2 (width); positions then (3, batch, seq) (a
    (batch, seq) or (seq,) one is every row's). ``long_inv_freq`` and ``long_after``:
    LongRoPE (Phi-3.5's): a second set of inverse frequencies, used by every call whose
    largest position is at least ``long_after`` (the original context length), chosen on the
    device (``gemm_rope.context_freq_table``). ``activation``: the MLP's gate, "silu"
    (SwiGLU) or "gelu_tanh" (GeGLU: GELU's tanh form, Gemma's MLP), in the same epilogues, or
    "relu2" (relu(x)^2 without a gate, Arcee's MLP: ``w_il`` is then W_up alone, (d, ffn)),
    or "xielu" (xIELU without a gate, Apertus's MLP, its learned numbers in ``mlp.act_fn``, a
    ``coda.nn.activation.XIELU``: HF's keys; not with ``post_norms``).
    ``norm_offset``: the two norms scale by ``norm_offset + gain`` (Gemma's 1 + w), that sum
    formed in fp32 and applied before the one rounding, as HF's ``GemmaRMSNorm`` does (a
    bf16 1 + w would round w to 2^-8); the gains then start at 1 - norm_offset.
    ``post_norms``: Gemma 2's and 3's RMSNorm of the attention's and the MLP's outputs
    before each residual add (gains ``post_attention_norm``, ``post_ffn_norm``, with
    ``norm_offset`` as the others; kernel path: ``coda.autograd_post_norm``); with
    ``qkv_bias`` (GLM-4's), not with ``o_bias`` or ``mrope_sections``. ``pre_norms`` False
    (with ``post_norms``): no norms before the sublayers (EXAONE 4's layer; no
    ``attention_norm``, ``ffn_norm``). ``fp32_gains``: every norm (QK-norm's too) scales
    by its gain in fp32 before the one rounding (OLMo's norms: ``norm_offset`` 0 in
    that form). ``residual_scale``: each sublayer's output times this multiplier before its
    residual add (Granite's ``residual_multiplier``; in F3's and F5's epilogues, in fp32; with
    ``post_norms`` folded into their gains, c PN(y) = norm(y) (c g), HyperCLOVAX's; not with
    ``o_bias``). ``qk_norm_after_rope``: the per-head QK-norm
    norms the rotated q and k (Hunyuan's; with ``qk_norm`` "head"). ``norm_gains`` False:
    weightless norms (NanoChat's), every norm's gain (QK-norm's too) a constant 1, kept as a
    buffer (``GAINS``: no parameter, no gradient, not in the state dict). ``mlp``: the second
    sublayer as a module of its own (a mixture of experts), its norm included: it takes x1
    (batch, seq, d), the attention sublayer's output after its residual add, and returns its
    output y, x2 = x1 + c y (``residual_scale`` c); the layer then holds no ``ffn_norm``,
    ``w_il`` or ``w_d`` (``ffn`` 0) and its kernel path ends at x1
    (``coda.autograd_sublayer``), the module differentiated by autograd (a subclass may
    override ``ffn_sublayer`` to call modules of its own around it: HF's layers); not with
    ``activation``, ``post_norms`` or ``o_bias``.

    Parameters: ``attention_norm`` and ``ffn_norm`` (the two RMSNorm gains, (d,)), ``w_qkv``,
    ``w_o``, ``w_il``, ``w_d`` (the projections, (in, out), in coda's paired layouts). The
    norm gains' names end in ``_norm`` and the biases' begin with ``bias`` so that name-based
    rules (the HF Trainer's: no weight decay on norms and biases) treat them as a model's
    norms and biases; before session 21 the gains were ``g1`` and ``g2``, before session 63
    the biases ``b_qkv`` and ``b_o``, and state dicts saved under those names still load."""

    RENAMED = {"g1": "attention_norm", "g2": "ffn_norm", "b_qkv": "bias_qkv", "b_o": "bias_o"}
    # (the defaults of layers pickled before LongRoPE, multimodal RoPE and GeGLU)
    _long_inv_freq = long_after = _mrope = None
    activation, norm_offset, fp32_gains, residual_scale = "silu", 0.0, False, 1.0
    qk_norm_after_rope, norm_gains = False, True

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
        qk_norm: bool | str = False,
        qkv_bias: bool = False,
        o_bias: bool = False,
        long_inv_freq=None,
        long_after: int = None,
        mrope_sections=None,
        activation: str = "silu",
        norm_offset: float = 0.0,
        post_norms: bool = False,
        pre_norms: bool = True,
        fp32_gains: bool = False,
        residual_scale: float = 1.0,
        qk_norm_after_rope: bool = False,
        norm_gains: bool = True,
        mlp: nn.Module | None = None,
    ):
        super().__init__()
        check_mlp_module(mlp, ffn, activation, post_norms, o_bias)
        self.activation = v.check_choice("activation", activation, MLP_ACTIVATIONS)
        self.residual_scale = v.check_positive_number("residual_scale", residual_scale)
        if activation == "xielu" and post_norms:
            raise v.CodaInputError(
                "DecoderLayer: activation 'xielu' with post_norms is not supported"
            )
        if residual_scale != 1.0 and o_bias:
            raise v.CodaInputError("DecoderLayer: residual_scale with o_bias is not supported")
        self.norm_offset = v.check_finite_number("norm_offset", norm_offset)
        self.fp32_gains = bool(fp32_gains)
        v.check_choice("qk_norm", qk_norm, (None, False, True, "head", "whole"))
        qk_norm = "head" if qk_norm is True else qk_norm or False  # (True: Qwen3's)
        self.qk_norm_after_rope = bool(qk_norm_after_rope)
        if qk_norm_after_rope and qk_norm != "head":
            raise v.CodaInputError("DecoderLayer: qk_norm_after_rope needs qk_norm='head'")
        if qk_norm and qkv_bias:
            raise v.CodaInputError("DecoderLayer: qk_norm and qkv_bias together are not supported")
        if not (pre_norms or post_norms):
            raise v.CodaInputError(
                "DecoderLayer: pre_norms=False (no norm before each sublayer) needs its norms "
                "after them: post_norms=True"
            )
        if post_norms and o_bias:
            raise v.CodaInputError("DecoderLayer: post_norms with o_bias is not supported")
        hd = v.check_heads(d, n_heads, n_kv_heads, head_dim)
        v.check_positive_number("rope_base", rope_base)
        v.check_param_dtype(dtype)
        if inv_freq is None:
            steps = torch.arange(0, hd, 2, dtype=torch.float64, device="cpu")
            inv_freq = rope_base ** (-steps / hd)
        v.check_tensor("inv_freq", inv_freq)
        if inv_freq.shape != (hd // 2,):
            raise v.CodaInputError(
                f"inv_freq: expected shape (head_dim / 2,) = ({hd // 2},), got "
                f"{tuple(inv_freq.shape)}"
            )
        # RoPE's inverse frequencies (plain attributes, not buffers: ``.to(dtype)`` must not
        # round them); the kernel's float-float table is derived once per device
        self._inv_freq = inv_freq.detach().to("cpu", torch.float64)
        self._long_inv_freq, self.long_after = long_rope(long_inv_freq, long_after, hd)
        self._mrope = mrope_flags(mrope_sections, hd, qkv_bias or qk_norm, long_inv_freq)
        self._rope_tables = {}
        if attention is not None and not callable(attention):
            raise v.CodaInputError(
                f"attention: must be a callable (q, k, v) -> o, got {attention!r}"
            )
        self.attention = attention
        if mlp is None:
            v.check_positive_int("ffn", ffn)
        v.check_eps(eps)
        v.check_choice("backend", backend, BACKENDS)
        self._kernel_rule = tma_rule(
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
        # the norms before each sublayer (none in EXAONE 4's and OLMo's layers: ``pre_norms``)
        self.attention_norm = nn.Parameter(torch.ones(d, **kw)) if pre_norms else None
        self.w_qkv = nn.Parameter(torch.empty(d, nqkv, **kw))
        self.w_o = nn.Parameter(torch.empty(n_heads * hd, d, **kw))
        own_mlp = mlp is None  # (else the module's, its norm included)
        self.ffn_norm = nn.Parameter(torch.ones(d, **kw)) if pre_norms and own_mlp else None
        # the MLP's input projection: gate and up interleaved (d, 2 ffn), or up alone (d, ffn)
        # for an activation without a gate (Arcee's relu2)
        n_il = ffn if self._ungated() else 2 * ffn
        self.w_il = nn.Parameter(torch.empty(d, n_il, **kw)) if own_mlp else None
        self.w_d = nn.Parameter(torch.empty(ffn, d, **kw)) if own_mlp else None
        # QK-norm weights, in the adjacent-pair order of w_qkv's heads: Qwen3's per head (hd,),
        # OLMo's over the whole q and k projections (n_heads hd,), (n_kv_heads hd,)
        whole = qk_norm == "whole"
        q_len, k_len = (n_heads * hd, n_kv_heads * hd) if whole else (hd, hd)
        self.q_norm = nn.Parameter(torch.ones(q_len, **kw)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(k_len, **kw)) if qk_norm else None
        # Qwen2's q, k, v biases (Nqkv,), in w_qkv's column order
        self.bias_qkv = nn.Parameter(torch.zeros(nqkv, **kw)) if qkv_bias else None
        # the O projection's bias (d,) (Llama's attention_bias=True)
        self.bias_o = nn.Parameter(torch.zeros(d, **kw)) if o_bias else None
        # Gemma 2's and 3's norms of the attention's and the MLP's outputs (d,)
        self.post_attention_norm = nn.Parameter(torch.ones(d, **kw)) if post_norms else None
        self.post_ffn_norm = nn.Parameter(torch.ones(d, **kw)) if post_norms else None
        if activation == "xielu":  # its numbers, where HF's layer keeps them
            self.mlp = nn.ModuleDict({"act_fn": XIELU(**kw)})
        if mlp is not None:
            self.mlp = mlp
        self.reset_parameters()
        self.norm_gains = bool(norm_gains)
        if not norm_gains:  # weightless norms: every gain a constant, an effective gain of 1
            for name in GAINS:
                gain = getattr(self, name)
                if gain is not None:
                    delattr(self, name)
                    self.register_buffer(name, gain.detach(), persistent=False)
        self._build_rope_tables()

    def _build_rope_tables(self):
        """The RoPE tables for the device the layer's weights are on, built when the layer is
        made or moved (``_apply``), so that a call never fills them: a table cached inside a
        torch.compile trace would change what the trace's guards saw, and recompile the next
        call. A call on another device still builds its own on first use."""
        self._rope_tables.clear()
        device = self.w_qkv.device
        self._inverse_frequencies(device)
        self._freq_table(device)
        if self._mrope is not None:
            self._mrope_table(device)

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .double(), ...: tables follow
        out = super()._apply(fn, recurse)
        self._build_rope_tables()
        return out

    def extra_repr(self) -> str:
        qk = f", qk_norm={self.qk_norm_span!r}" if self.qk_norm else ""
        qk += ", qkv_bias=True" if self.qkv_bias else ""
        qk += ", o_bias=True" if self.o_bias else ""
        qk += f", long_after={self.long_after}" if self.long_after else ""
        qk += f", activation={self.activation!r}" if self.activation != "silu" else ""
        qk += f", norm_offset={self.norm_offset}" if self.norm_offset else ""
        qk += ", post_norms=True" if self.post_norms else ""
        qk += ", pre_norms=False" if not self.pre_norms else ""
        qk += ", fp32_gains=True" if self.fp32_gains else ""
        qk += f", residual_scale={self.residual_scale}" if self.residual_scale != 1.0 else ""
        qk += ", qk_norm_after_rope=True" if self.qk_norm_after_rope else ""
        qk += ", mlp=<module>" if self.mlp_module else ""
        return (
            f"d={self.d}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
            f"head_dim={self.head_dim}, ffn={self.ffn}{qk}"
        )

    @property
    def qk_norm(self) -> bool:
        """Whether the layer has a QK-norm (its q_norm / k_norm weights; ``qk_norm_span``
        says which: "head", Qwen3's, or "whole", OLMo's)."""
        return self.q_norm is not None

    @property
    def qk_norm_span(self) -> str | None:
        """The QK-norm's groups, read from its weights: "head" (head_dim long: Qwen3's), "whole"
        (OLMo's: n_heads and n_kv_heads head_dim), None without a QK-norm."""
        if self.q_norm is None:
            return None
        return "head" if is_per_head(self.q_norm, self.k_norm, self.head_dim) else "whole"

    @property
    def qkv_bias(self) -> bool:
        """Whether the q, k and v projections have biases (Qwen2's ``bias_qkv``)."""
        return self.bias_qkv is not None

    @property
    def post_norms(self) -> bool:
        """Whether the attention's and the MLP's outputs are normed before their residual adds
        (Gemma 2's and 3's ``post_attention_norm``, ``post_ffn_norm``)."""
        return getattr(self, "post_attention_norm", None) is not None  # (pickled before: none)

    @property
    def pre_norms(self) -> bool:
        """Whether the attention and the MLP read their input through a norm (``attention_norm``,
        ``ffn_norm``; not EXAONE 4's layer, which norms after each sublayer only)."""
        return self.attention_norm is not None

    @property
    def mlp_module(self) -> bool:
        """Whether the second sublayer is a module of its own (``mlp``; then ``ffn_sublayer``)."""
        return self.w_d is None

    def ffn_sublayer(self, x1: torch.Tensor, kernel_path: bool = False) -> torch.Tensor:
        """The second sublayer's output y for x1 (batch, seq, d) where it is a module of its
        own (``mlp``): the module's, its norm included. ``kernel_path``: whether the layer's
        kernel sequence formed x1 (a subclass may run coda's row passes there: HF's MoE
        layers' norm before the experts)."""
        return self.mlp(x1)

    def rows_norm(self, x1: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x1 by ``weight`` in the layer's norm form and eps as coda's row passes
        (``autograd_sublayer.norm_rows``): for an ``mlp`` module's own norm on the kernel path
        (HF's MoE layers' norm before the experts, whose GEMMs take no deferred row scale)."""
        gain = norm_gains((weight,), x1.dtype, self.norm_offset, self.fp32_gains)[0]
        return norm_rows(x1, gain, self.eps)

    def _after_attention(self, x1: torch.Tensor, kernel_path: bool = False) -> torch.Tensor:
        """x2 = x1 + c y, y the second sublayer's (``ffn_sublayer``) output, c as HF's layers
        round it (a multiplier of the output, then the add)."""
        y = self.ffn_sublayer(x1, kernel_path)
        return x1 + (y if self.residual_scale == 1.0 else y * self.residual_scale)

    @property
    def o_bias(self) -> bool:
        """Whether the O projection has a bias (``bias_o``: Llama's ``attention_bias=True``)."""
        return self.bias_o is not None

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w_qkv, self.w_o, self.w_il, self.w_d):
            if w is not None:  # (no MLP weights: ``mlp``, a module of its own)
                nn.init.normal_(w, std=std)
        for g in self._norm_gains():
            nn.init.constant_(g, 1.0 - self.norm_offset)  # an effective gain of 1
        for g in (self.q_norm, self.k_norm):
            if g is not None:
                nn.init.constant_(g, 1.0 - self.norm_offset)
        for b in (self.bias_qkv, self.bias_o):
            if b is not None:
                nn.init.zeros_(b)
        if self.activation == "xielu":
            self.mlp.act_fn.reset_parameters()

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
            self.activation,
            self.residual_scale,
            self.qk_norm_after_rope,
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
        path = resolve_backend(
            "DecoderLayer", self.backend, x.device, compute_dtype(x), empty=x.numel() == 0
        )
        if path == "kernel":
            if self._kernel_rule:
                raise v.CodaInputError(f"DecoderLayer (kernel path): {self._kernel_rule}")
            return self._kernel_forward(x, pos, attention)
        g1, g2 = self._gains(compute_dtype(x), cast=False)
        w = {"g1": g1, "wqkv": self.w_qkv, "wo": self.w_o}
        if not self.mlp_module:  # (else the reference ends at x1: ``_after_attention``)
            w.update(g2=g2, w_il=self.w_il, wd=self.w_d)
        if self.qk_norm:
            w["q_norm"], w["k_norm"] = self._gains(compute_dtype(x), False, "qk")
        if self.qkv_bias:
            w["bqkv"] = self.bias_qkv
        if self.o_bias:
            w["bo"] = self.bias_o
        if self.post_norms:
            w["g_attn_out"], w["g_ffn_out"] = self._gains(compute_dtype(x), False, "post")
        if self.activation == "xielu":
            w["act"] = self.mlp.act_fn.numbers()
        if rope_cos_sin is not None:  # HF's halves -> coda's adjacent (cos, sin) pairs
            v.check_rope_cos_sin(rope_cos_sin, B, S, self.head_dim)
            half = self.head_dim // 2
            cos, sin = (t.expand(B, S, -1).reshape(B * S, -1)[:, :half] for t in rope_cos_sin)
            cs = torch.stack([cos, sin], dim=-1).flatten(1)
        elif self._mrope is not None:  # each frequency's angle from its section's row
            inv = self._inverse_frequencies(pos.device)
            rows = pos.to(torch.float64).index_select(0, self._mrope.to(pos.device))
            ang = rows.t() * inv[None, :]
            cs = torch.stack([ang.cos(), ang.sin()], dim=-1).flatten(1)
        else:
            inv = self._inverse_frequencies(pos.device, pos)
            ang = pos.to(torch.float64)[:, None] * inv[None, :]
            cs = torch.stack([ang.cos(), ang.sin()], dim=-1).flatten(1)
        out = decoder_layer_ref(
            x.reshape(B * S, d), w, self._shape(B, S), None, attention, cs, rows=(B, S)
        )
        return self._after_attention(out) if self.mlp_module else out

    def _norm_gains(self) -> tuple:
        """Every norm's gain: the two pre-norms', then the post-norms', those the layer has."""
        post = (self.post_attention_norm, self.post_ffn_norm) if self.post_norms else ()
        return tuple(g for g in (self.attention_norm, self.ffn_norm, *post) if g is not None)

    def _gains(self, dtype, cast: bool = True, which: str = "pre"):
        """The gains of the two pre-norms (``which`` "pre"), the two post-norms ("post") or the
        QK-norm ("qk") as the kernels (``cast``: in the compute dtype) and the reference (as
        they are, as HF's norms take their weights) apply them, or with ``norm_offset`` (or
        ``fp32_gains``) the fp32 (float64 for float64 compute) sum ``norm_offset + gain``
        (differentiable: the gain's gradient is the sum's)."""
        gains = {
            "pre": (self.attention_norm, self.ffn_norm),
            "post": (self.post_attention_norm, self.post_ffn_norm),
            "qk": (self.q_norm, self.k_norm),
        }[which]
        return norm_gains(gains, dtype, self.norm_offset, self.fp32_gains, cast)

    def _positions(self, positions, B, S, device):
        if self._mrope is not None:
            return self._mrope_positions(positions, B, S, device)
        return self._plain_positions(positions, B, S, device)

    def _plain_positions(self, positions, B, S, device):
        if positions is None:
            return default_positions(B, S, device)
        v.check_tensor("positions", positions)
        n = positions.numel()
        if not v.is_integer(positions) or positions.shape[-1] != S or n not in (S, B * S):
            raise v.CodaInputError(
                f"positions: expected integer (batch, seq) = ({B}, {S}) or (seq,), got "
                f"{positions.dtype} {tuple(positions.shape)}"
            )
        return position_rows(positions, B, device)

    def _mrope_positions(self, positions, B, S, device):
        """Multimodal RoPE's (3, M) rows: (3, batch, seq) positions, or one (batch, seq) /
        (seq,) / default set for all three rows (text alone)."""
        if positions is None or positions.dim() != 3:
            rows = self._plain_positions(positions, B, S, device)
            return text_rows(rows)
        v.check_tensor("positions", positions)
        n, shape = positions.numel(), tuple(positions.shape)
        if not v.is_integer(positions) or shape[::2] != (3, S) or n not in (3 * S, 3 * B * S):
            raise v.CodaInputError(
                f"positions: expected integer (3, batch, seq) = (3, {B}, {S}) multimodal "
                f"positions, got {positions.dtype} {shape}"
            )
        return mrope_rows(positions, B, device)

    def _mrope_table(self, device):
        """F1's multimodal section flags (``gemm_rope.mrope_section_table``)."""
        heads = (self.n_heads + self.n_kv_heads, self.n_kv_heads)
        return self._on_device(
            "mrope", device, lambda d: mrope_section_table(self._mrope, *heads, d)
        )

    def _on_device(self, name, device, build):
        """A RoPE table derived from the inverse frequencies, built once per device (a host to
        device copy on every call would stall the stream)."""
        key = (name, device)
        if key not in self._rope_tables:
            if capturing():  # built inside a CUDA graph capture: used there, never kept
                return build(device)
            self._rope_tables[key] = build(device)
        return self._rope_tables[key]

    def _inverse_frequencies(self, device, pos=None):
        """The reference path's inverse frequencies on ``device`` (LongRoPE's set for
        positions ``pos``)."""
        short = self._on_device("inv_freq", device, lambda d: self._inv_freq.to(d))
        if self._long_inv_freq is None:
            return short
        long = self._on_device("inv_freq_long", device, lambda d: self._long_inv_freq.to(d))
        return short if pos is None else context_freq_table(pos, short, long, self.long_after)

    def _freq_table(self, device, pos=None):
        """The RoPE epilogue's per-column frequency table (float-float turns); LongRoPE's set
        for positions ``pos``."""
        heads = (self.n_heads + self.n_kv_heads, self.n_kv_heads)
        short = self._on_device(
            "freq", device, lambda d: shared_freq_table(self._inv_freq, heads, d)
        )
        if self._long_inv_freq is None:
            return short
        long = self._on_device(
            "freq_long", device, lambda d: shared_freq_table(self._long_inv_freq, heads, d)
        )
        return short if pos is None else context_freq_table(pos, short, long, self.long_after)

    def _kernel_forward(self, x: torch.Tensor, positions=None, attention=None) -> torch.Tensor:
        """The kernel sequence (``coda.autograd``). On an SM90 GPU its GEMMs are the SM90
        kernels; with CPU tensors every epilogue program runs through the tile interpreter
        (``coda.kernels._launch``), which is how CI tests this exact code path. Inside
        ``torch.autocast`` (bf16) x and the parameters are cast to bf16 first (``compute_dtype``;
        the casts are differentiable: fp32 parameters get fp32 gradients, as under autocast)."""
        B, S, d = x.shape
        pos = self._positions(None, B, S, x.device) if positions is None else positions
        dims = LayerDims(
            B,
            S,
            self.n_heads,
            self.n_kv_heads,
            self.head_dim,
            self.eps,
            self.rope_base,
            self.activation,
            self.residual_scale,
            self.qk_norm_after_rope,
        )
        dtype = compute_dtype(x)
        x, w_qkv, w_o, w_il, w_d = in_dtype(dtype, x, self.w_qkv, self.w_o, self.w_il, self.w_d)
        g1, g2 = self._gains(dtype)
        qk = self._gains(dtype, which="qk") if self.qk_norm else None
        bias = in_dtype(dtype, self.bias_qkv)[0] if self.qkv_bias else None
        o_bias = in_dtype(dtype, self.bias_o)[0] if self.o_bias else None
        x_rows = tma_aligned(x.reshape(B * S, d).contiguous())
        rows = (x_rows, g1, w_qkv, w_o, g2, w_il, w_d)
        rope = (pos, dims, attention or self.attention, self._freq_table(x.device, pos))
        with autocast_off(x.device):
            mrope = None if self._mrope is None else self._mrope_table(x.device)
            if self.mlp_module:  # coda's up to x1; the module of its own after (under autocast)
                x1 = attention_sublayer(x_rows, g1, w_qkv, w_o, *rope, qk, bias, mrope)
            elif self.post_norms:
                post = self._gains(dtype, which="post")  # (c: into them, ``dims``)
                return post_norm_decoder_layer(*rows, post, *rope, qk, mrope, qkv_bias=bias)
            else:
                act = self.mlp.act_fn.numbers() if self.activation == "xielu" else None
                return decoder_layer(*rows, *rope, qk, bias, o_bias, mrope, act)
        return self._after_attention(x1, kernel_path=True)
