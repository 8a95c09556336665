"""The kernel path's own code, run on the CPU: ``coda.autograd``'s layer and LM-head
Functions (F0..F6, B1..B13, every buffer, every AUX) with each epilogue program executed by the
tile interpreter instead of the SM90 GEMM (``coda.kernels._launch``). In float64 it must equal
the reference path (and so HF's math), output and every gradient, to round-off: this proves the
wiring of the kernel sequence in CI, where no GPU runs it."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import rel_err

import coda
import coda.nn as cnn

F64 = torch.float64


def _grads(module, x, run, dy=None):
    for p in (*module.parameters(), x):
        p.grad = None
    out = run()
    out.backward(dy if dy is not None else torch.ones_like(out))
    return out.detach(), [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


@pytest.mark.parametrize("seed", range(9))
def test_layer_kernel_sequence_equals_reference_float64(seed):
    rng = random.Random(seed)
    Hkv = rng.choice([1, 2])
    H, hd = Hkv * rng.choice([1, 2, 4]), rng.choice([2, 6, 16])
    d, f = rng.randrange(3, 70), rng.randrange(1, 60)
    B, S = rng.choice([1, 2, 3]), rng.choice([1, 2, 5, 13])
    torch.manual_seed(seed)
    # seeds 1, 4, 7: Qwen3's QK-norm; 2, 5, 8: Qwen2's QKV biases (large: Qwen2's k bias is);
    # 0, 5, 8: an O-projection bias (5, 8: Llama's attention_bias=True, biases on all four)
    eps, qk_norm, qkv_bias = rng.choice([1e-5, 1e-2]), seed % 3 == 1, seed % 3 == 2
    o_bias = seed in (0, 5, 8)
    # GeGLU's MLP, Arcee's ungated relu(x)^2 (seeds 0, 8), Apertus's ungated xIELU (6), SwiGLU's
    activation = "gelu_tanh" if seed in (2, 3, 4, 7) else "relu2" if seed in (0, 8) else "silu"
    activation = "xielu" if seed == 6 else activation
    norm_offset = 1.0 if seed in (3, 6, 7) else 0.0  # Gemma's 1 + w gains
    # seeds 1, 2, 6: a branch multiplier (Granite's residual_multiplier; not with an o bias)
    residual_scale = {1: 0.22, 2: 3.0, 6: 0.7}.get(seed, 1.0)
    after_rope = seed in (4, 7)  # the QK-norm of the rotated heads (Hunyuan's)
    if qk_norm and S == 1:  # (one position: attention's q and k gradients are 0, and so
        S = 5  # would be every QK-norm gain's: seeds 4 and 7 drew it)
    # seeds 0, 4: weightless norms (NanoChat's; 4: with its RoPE by -theta, and relu^2 at 0)
    norm_gains = seed not in (0, 4)
    inv_freq = None
    if seed == 4:
        inv_freq = -(10000.0 ** (-torch.arange(0, hd, 2, dtype=F64) / hd))
    layer = cnn.DecoderLayer(
        d, H, Hkv, f, head_dim=hd, eps=eps, dtype=F64, qk_norm=qk_norm, qkv_bias=qkv_bias,
        o_bias=o_bias, activation=activation, norm_offset=norm_offset,
        residual_scale=residual_scale, qk_norm_after_rope=after_rope, norm_gains=norm_gains,
        inv_freq=inv_freq,
    )  # fmt: skip
    weighted = any(n.endswith("norm") for n in layer.state_dict())  # (gains: parameters)
    assert weighted == norm_gains
    with torch.no_grad():
        for gam in (layer.attention_norm, layer.ffn_norm, layer.q_norm, layer.k_norm):
            if gam is not None and norm_gains:
                gam.add_(0.1 * torch.randn_like(gam))
        if qkv_bias:
            layer.bias_qkv.copy_(10 * torch.randn_like(layer.bias_qkv))
        if o_bias:
            layer.bias_o.copy_(torch.randn_like(layer.bias_o))
        if activation == "xielu":  # (apart, so that a swap shows)
            layer.mlp.act_fn.alpha_p.fill_(0.4)
            layer.mlp.act_fn.alpha_n.fill_(-1.1)
    x = torch.randn(B, S, d, dtype=F64, requires_grad=True)
    dy = torch.randn(B, S, d, dtype=F64)
    out_k, g_k = _grads(layer, x, lambda: layer._kernel_forward(x), dy)
    out_r, g_r = _grads(layer, x, lambda: layer(x), dy)
    assert rel_err(out_k, out_r) < 1e-12
    floor = max(float(g.abs().max()) for g in g_r)  # q/k gradients are 0 when S == 1
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, g_k, g_r):
        assert rel_err(a, b, floor=floor) < 1e-11, name
        if name in ("q_norm", "k_norm"):  # (compared, not vacuously 0)
            assert b.abs().max() > 1e-3 * floor, name


@pytest.mark.parametrize("kv", [1, 2])
def test_layer_kernel_sequence_gains_after_rope_in_the_epilogue(kv):
    """Hunyuan's QK-norm of the rotated heads at a head_dim F1's epilogue takes (32: the
    seeds above run the row pass), float64 against the reference path: the forward's gains
    after RoPE in the epilogue (``qk_norm.post_rows``), their gradients in B11's pass."""
    from coda.kernels.qk_norm import qk_norm_config

    hd = 32
    assert qk_norm_config(hd) is not None  # (the epilogue path, not the row pass)
    torch.manual_seed(kv)
    layer = cnn.DecoderLayer(
        40, 2 * kv, kv, 24, head_dim=hd, dtype=F64, qk_norm=True, qk_norm_after_rope=True
    )
    with torch.no_grad():
        for gam in (layer.attention_norm, layer.ffn_norm, layer.q_norm, layer.k_norm):
            gam.add_(0.5 * torch.randn_like(gam))
    x = torch.randn(2, 7, 40, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 7, 40, dtype=F64)
    out_k, g_k = _grads(layer, x, lambda: layer._kernel_forward(x), dy)
    out_r, g_r = _grads(layer, x, lambda: layer(x), dy)
    assert rel_err(out_k, out_r) < 1e-12
    floor = max(float(g.abs().max()) for g in g_r)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, g_k, g_r):
        assert rel_err(a, b, floor=floor) < 1e-11, name


def test_a_residual_scale_coda_cannot_run_is_refused_named():
    """A branch multiplier runs in the pre-norm layer's F3 / F5 epilogues (in a post-norm
    layer's post-norm gains: ``test_post_norm``): with an O-projection bias it is refused, as
    is a value that is no number."""
    with pytest.raises(coda.CodaInputError, match="residual_scale with o_bias"):
        cnn.DecoderLayer(16, 2, 1, 8, residual_scale=0.5, o_bias=True)
    with pytest.raises(coda.CodaInputError, match="residual_scale"):
        cnn.DecoderLayer(16, 2, 1, 8, residual_scale=float("nan"))
    assert "residual_scale=0.5" in repr(cnn.DecoderLayer(16, 2, 1, 8, residual_scale=0.5))
    with pytest.raises(coda.CodaInputError, match="qk_norm_after_rope needs qk_norm='head'"):
        cnn.DecoderLayer(16, 2, 1, 8, qk_norm="whole", qk_norm_after_rope=True)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_frozen_weights_skip_their_gradient_gemms(qk_norm, monkeypatch):
    """Partial fine-tuning on the kernel path: a frozen weight's gradient GEMM is not run
    (each of the four weight-gradient launches counted), it gets no gradient, and every other
    gradient equals the all-trainable step's (float64)."""
    import coda.autograd as ca

    torch.manual_seed(0)
    layer = cnn.DecoderLayer(24, 4, 2, 20, head_dim=6, dtype=F64, qk_norm=qk_norm)
    x = torch.randn(2, 5, 24, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 5, 24, dtype=F64)
    _, want = _grads(layer, x, lambda: layer._kernel_forward(x), dy)
    launches = []
    for name, target in (("wgrad", ca), ("wgrad_gamma_rows", ca.lib)):
        real = getattr(target, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            launches.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(target, name, counted)
    names = [n for n, _ in layer.named_parameters()]
    for frozen in (("w_qkv",), ("w_o", "w_d"), ("w_il",), ("w_qkv", "w_o", "w_il", "w_d")):
        for n, p in layer.named_parameters():
            p.requires_grad_(n not in frozen)
        launches.clear()
        for p in (*layer.parameters(), x):
            p.grad = None
        layer._kernel_forward(x).backward(dy)
        assert len(launches) == 4 - len(frozen), (frozen, launches)
        assert rel_err(x.grad, want[0]) < 1e-12
        for n, p, g in zip(names, layer.parameters(), want[1:]):
            if n in frozen:
                assert p.grad is None, n
            else:
                assert rel_err(p.grad, g) < 1e-12, (frozen, n)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("method", ["auto", "recompute", "chunked", "scaled_exp"])
def test_lm_head_kernel_sequence_equals_reference_float64(seed, method):
    rng = random.Random(seed)
    d, V, M = rng.randrange(2, 50), rng.randrange(2, 300), rng.randrange(1, 70)
    if method == "scaled_exp":  # its vocabulary is a multiple of 128
        V = -(-V // 128) * 128
    reduction = rng.choice(["mean", "sum"] + (["none"] if method in ("recompute", "auto") else []))
    reduction = "none" if method == "scaled_exp" and seed == 3 else reduction  # via recompute
    torch.manual_seed(seed)
    head = cnn.LMHeadLoss(d, V, method=method, chunk=rng.choice([7, 64, 16384]), dtype=F64)
    with torch.no_grad():
        head.final_norm.add_(0.1 * torch.randn_like(head.final_norm))
    t = torch.randint(0, V, (M,))
    t[torch.rand(M) < 0.2] = -100
    x = torch.randn(M, d, dtype=F64, requires_grad=True)
    if seed == 1:  # strided targets and a column-strided hidden state (HF hands views)
        t = torch.stack([t, t]).t().reshape(-1)[::2]
        x = torch.randn(d, M, dtype=F64).t().requires_grad_(True)
    # any upstream gradient (the three-GEMM programs form theirs at 1 and apply it after)
    dl = torch.randn(M if reduction == "none" else (), dtype=F64)
    out_k, g_k = _grads(head, x, lambda: head._kernel_loss(x, t, reduction), dl)
    out_r, g_r = _grads(head, x, lambda: head(x, t, reduction), dl)
    if torch.isnan(out_r).all():
        assert torch.isnan(out_k).all()
    else:
        assert rel_err(out_k, out_r, floor=1.0) < 1e-12
    for name, a, b in zip(("x", "final_norm", "w_lm"), g_k, g_r):
        assert rel_err(a, b, floor=max(float(b.abs().max()), 1e-300)) < 1e-11, name


def _manual_attention(q, k, v):
    """Causal GQA attention written out (no SDPA): a stand-in for a user's attention."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = s.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ v


def test_pluggable_attention_on_both_paths_float64():
    torch.manual_seed(7)
    layer = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=F64, attention=_manual_attention)
    plain = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=F64)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(2, 9, 40, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 9, 40, dtype=F64)
    out_k, g_k = _grads(layer, x, lambda: layer._kernel_forward(x), dy)
    out_r, g_r = _grads(layer, x, lambda: layer(x), dy)
    out_p, g_p = _grads(plain, x, lambda: plain(x), dy)  # the default attention, same math
    assert rel_err(out_k, out_r) < 1e-12 and rel_err(out_r, out_p) < 1e-12
    floor = max(float(g.abs().max()) for g in g_p)
    for a, b, c in zip(g_k, g_r, g_p):
        assert rel_err(a, b, floor=floor) < 1e-11 and rel_err(b, c, floor=floor) < 1e-11
    with pytest.raises(coda.CodaInputError, match="attention: must be a callable"):
        cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, attention="sdpa")


def test_dswiglu_runs_its_own_tile_and_stays_exact(monkeypatch):
    """The MLP's backward asks for dSwiGLU's own config (``tuned.DSWIGLU``, 128 x 128: its
    widen epilogue ran 2x slower on the 192-wide default, run 32) at a shape with no tuned
    entry, and at an ffn where that tile cuts the columns differently from the default's (300:
    3 column tiles of 128 against 2 of 192) the kernel sequence still equals the reference."""
    from coda.kernels import library as lib
    from coda.kernels.config import DEFAULT
    from coda.kernels.tuned import DSWIGLU

    assert DSWIGLU.grid(8, 300)[1] != DEFAULT.grid(8, 300)[1]
    seen, dswiglu = [], lib.dswiglu
    monkeypatch.setattr(lib, "dswiglu", lambda *a: seen.append(a[4]) or dswiglu(*a))
    torch.manual_seed(3)
    layer = cnn.DecoderLayer(24, 2, 1, 300, head_dim=12, dtype=F64)
    x = torch.randn(1, 5, 24, dtype=F64, requires_grad=True)
    dy = torch.randn(1, 5, 24, dtype=F64)
    out_k, g_k = _grads(layer, x, lambda: layer._kernel_forward(x), dy)
    assert seen == [DSWIGLU]
    out_r, g_r = _grads(layer, x, lambda: layer(x), dy)
    assert rel_err(out_k, out_r) < 1e-12
    floor = max(float(g.abs().max()) for g in g_r)
    for a, b in zip(g_k, g_r):
        assert rel_err(a, b, floor=floor) < 1e-11


@pytest.mark.parametrize("B, S", [(2, 24), (1, 1)])
def test_bf16_kernel_path_runs_on_cpu_with_the_tma_layouts(B, S):
    """bf16 through the interpreter: every GEMM's operands pass the TMA layout checks the GPU
    enforces (16-byte rows, a unit stride), and the loss and gradients are finite and close to
    the reference path's; also for a one-token batch (its wgrad operand is a single column)."""
    torch.manual_seed(0)
    layer = cnn.DecoderLayer(64, 4, 2, 96, head_dim=16)
    x = torch.randn(B, S, 64, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 256, (B, S))
    for method in ("recompute", "chunked"):
        head = cnn.LMHeadLoss(64, 256, method=method)

        def kernel_path(head=head):
            return head._kernel_loss(
                layer._kernel_forward(x).reshape(-1, 64), t.reshape(-1), "mean"
            )

        mods = torch.nn.ModuleList([layer, head])
        loss_k, g_k = _grads(mods, x, kernel_path)
        loss_r, g_r = _grads(mods, x, lambda head=head: head(layer(x), t))
        assert abs(float(loss_k) - float(loss_r)) < 1e-2 * abs(float(loss_r))
        for a, b in zip(g_k, g_r):
            assert torch.isfinite(a).all() and rel_err(a, b) < 0.05


def test_layer_backward_fills_no_zero_gradients():
    """The layer's Functions leave non-differentiable outputs without a gradient: autograd
    filled an (M, d) and an (M,) tensor of zeros for ``AttentionOutput``'s a1 and r1 at every
    backward (16 fills, 0.36 ms of a Llama-1B step on the H200, run 116). No zeroing op of a
    token-shaped tensor runs inside the layer's backward nodes (the interpreter's own (M, 1)
    and (1, d) partials buffers are not such tensors)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    B, S, d = 2, 8, 64
    layer = cnn.DecoderLayer(d, 4, 2, 96, head_dim=16, dtype=F64)
    x = torch.randn(B, S, d, dtype=F64, requires_grad=True)
    out = layer._kernel_forward(x)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out.backward(torch.ones_like(out))
    nodes = ("AttentionInputBackward", "AttentionOutputBackward", "MLPBackward")
    assert {n for n in nodes if any(n in e.name for e in prof.events())} == set(nodes)

    def node_of(e):
        while e is not None and not any(n in e.name for n in nodes):
            e = e.cpu_parent
        return e

    token_shaped = ([B * S, d], [B * S])
    fills = [
        (e.name, e.input_shapes[0], node_of(e).name)
        for e in prof.events()
        if e.name in ("aten::zero_", "aten::fill_") and node_of(e) is not None
    ]
    assert fills, "the interpreter's partials buffers: the profile sees zeroing ops"
    assert not [f for f in fills if f[1] in token_shaped], fills


@pytest.mark.parametrize("post_norms", [False, True], ids=["llama", "post_norms"])
@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_activation_checkpointing_gives_the_same_gradients(path, post_norms):
    """torch.utils.checkpoint (non-reentrant) over coda layers: the backward re-runs the
    forward (the kernel path's Functions included; with ``post_norms``, Gemma 2's and 3's
    layer) and the gradients are the same, exactly."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(3)
    layers = torch.nn.ModuleList(
        cnn.DecoderLayer(32, 4, 2, 40, head_dim=8, dtype=F64, post_norms=post_norms)
        for _ in range(2)
    )
    x = torch.randn(2, 6, 32, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 6, 32, dtype=F64)

    def run(ckpt):
        for p in (x, *layers.parameters()):
            p.grad = None
        h = x
        for layer in layers:
            fn = layer._kernel_forward if path == "kernel" else layer
            h = checkpoint(fn, h, use_reentrant=False) if ckpt else fn(h)
        h.backward(dy)
        return [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


def test_causal_lm_checkpoint_option_gives_the_same_gradients():
    """``CausalLM(checkpoint=True)``: per-layer activation checkpointing, same loss and
    gradients as without (float64, bit for bit)."""
    torch.manual_seed(4)
    kw = dict(vocab=50, d=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=40, dtype=F64)
    plain = cnn.CausalLM(**kw)
    ckpt = cnn.CausalLM(**kw, checkpoint=True)
    ckpt.load_state_dict(plain.state_dict())
    tokens, targets = torch.randint(0, 50, (2, 9)), torch.randint(0, 50, (2, 9))
    grads = []
    for model in (plain, ckpt):
        loss = model(tokens, targets)
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["float64", "bfloat16", "autocast"])
def test_causal_lm_kernel_path_forced_on_cpu(mode, monkeypatch):
    """A whole ``CausalLM`` (embedding, layers, checkpointing, LM head) through its public
    forward with the kernel path forced on the CPU (``kernel_support`` answers yes: every
    layer and the loss run the kernel sequence through the interpreter), against the same
    model on its reference path in float64: equal to round-off in float64; within bf16
    distance in bf16 (TMA layout rules enforced) and for fp32 parameters under bf16 autocast
    (their gradients fp32)."""
    import copy

    import coda.env

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    torch.manual_seed(7)
    kw = dict(vocab=128, d=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=96)
    dtype = {"float64": F64, "bfloat16": torch.bfloat16}.get(mode, torch.float32)
    model = cnn.CausalLM(**kw, dtype=dtype, checkpoint=True)
    ref = copy.deepcopy(model).double()
    for m in ref.modules():
        if hasattr(m, "backend"):
            m.backend = "reference"
    tokens, targets = torch.randint(0, 128, (2, 9)), torch.randint(0, 128, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        loss = model(tokens, targets)
    loss.backward()
    assert coda.last_path("DecoderLayer")[0] == coda.last_path("LMHeadLoss")[0] == "kernel"
    loss_r = ref(tokens, targets)
    loss_r.backward()
    tol = 1e-10 if mode == "float64" else 3e-2
    assert rel_err(loss, loss_r) < tol
    floor = max(float(p.grad.abs().max()) for p in ref.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == dtype, name
        assert rel_err(p.grad, q.grad, floor=floor) < tol, name


def test_tma_check_ignores_the_stride_of_a_length_one_dim():
    """A one-token batch's wgrad operand h^T, (d, 1) with strides (1, d): one column, so its
    column stride is never used (the H200 ran it in the layer fuzz); a (d, 3) view whose
    columns are not 16 bytes apart is still refused."""
    from coda._validate import check_tma_operand

    h = torch.randn(1, 40).bfloat16()
    check_tma_operand("A", h.t(), either_major=True)
    check_tma_operand("D", h)
    bad = torch.randn(3, 44).bfloat16()[:, :40].t()  # (40, 3), columns 88 B apart
    with pytest.raises(coda.CodaInputError, match="16-byte aligned"):
        check_tma_operand("A", bad, either_major=True)


def test_kernel_path_names_the_vocabulary_rule_and_the_hf_remedy(monkeypatch):
    """An LM head whose vocabulary is not a multiple of 8 cannot take the kernel path (16-byte
    TMA rows): the error names the rule and, since a token added to a vocabulary is the usual
    cause, HF's way to pad it."""
    import coda.env

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    head = cnn.LMHeadLoss(64, 97)
    with pytest.raises(coda.CodaInputError, match=r"vocab = 97 .*resize_token_embeddings"):
        head(torch.randn(5, 64, dtype=torch.bfloat16), torch.randint(0, 97, (5,)))


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_causal_lm_tied_embeddings(backend, monkeypatch):
    """``CausalLM(tie_embeddings=True)``: one (vocab, d) parameter serves the embedding and
    the LM head, and its gradient is the sum of the two uses' gradients in the untied model
    with equal weights (float64; the kernel path through the interpreter). Its HF state dict
    loads into an untied model, and a tied model refuses a head that differs from its
    embedding."""
    import coda.env

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    torch.manual_seed(5)
    kw = dict(vocab=128, d=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn=40, dtype=F64)
    kw["backend"] = backend
    tied = cnn.CausalLM(**kw, tie_embeddings=True)
    assert tied.head.weight is tied.embed.weight
    assert len(list(tied.parameters())) == len(list(cnn.CausalLM(**kw).parameters())) - 1
    untied = cnn.CausalLM(**kw)
    sd = tied.hf_state_dict()
    untied.load_hf_state_dict(sd)
    tokens, targets = torch.randint(0, 128, (2, 9)), torch.randint(0, 128, (2, 9))
    losses = []
    for model in (tied, untied):
        losses.append(model(tokens, targets))
        losses[-1].backward()
    assert rel_err(losses[0], losses[1]) < 1e-12
    both = untied.embed.weight.grad + untied.head.weight.grad
    assert rel_err(tied.embed.weight.grad, both) < 1e-12
    for (name, p), q in zip(tied.layers.named_parameters(), untied.layers.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-12, name
    del sd["lm_head.weight"]  # HF's save of a tied model drops the head's key
    cnn.CausalLM(**kw, tie_embeddings=True).load_hf_state_dict(sd)
    sd["lm_head.weight"] = torch.zeros(128, 32, dtype=F64)
    with pytest.raises(coda.CodaInputError, match="lm_head.weight: a tied model"):
        cnn.CausalLM(**kw, tie_embeddings=True).load_hf_state_dict(sd)
