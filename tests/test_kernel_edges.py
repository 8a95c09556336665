"""The kernel path at the edges of what a training or evaluation loop hands it, on the CPU
with the kernel path forced (``kernel_support`` stood in; GEMMs through the tile
interpreter): an empty batch (no tokens: nothing to launch, the reference's empty result and
zero gradients), ``torch.inference_mode`` (inference tensors carry no version), and a second
derivative (refused: the kernels' backward carries no graph)."""

from __future__ import annotations

import pytest
import torch

import coda
import coda.nn as cnn
from coda.env import NO_TOKENS

F64 = torch.float64


@pytest.fixture
def kernel_forced(monkeypatch):
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))


@pytest.mark.parametrize("batch,seq", [(0, 5), (2, 0)])
def test_an_empty_batch_launches_nothing_and_gives_zero_gradients(kernel_forced, batch, seq):
    """No tokens: the layer, the LM head, the embedding and a fused op return the reference's
    empty results and zero gradients (the layer's backward crashed in its dRoPE pass before),
    and say why (``last_path``), without a reference-path warning."""
    import warnings

    torch.manual_seed(0)
    layer, head = cnn.DecoderLayer(32, 2, 1, 48, dtype=F64), cnn.LMHeadLoss(32, 64, dtype=F64)
    emb = cnn.Embedding(64, 32, dtype=F64)
    x = torch.randn(batch, seq, 32, dtype=F64, requires_grad=True)
    t = torch.randint(0, 64, (batch, seq))
    with warnings.catch_warnings():
        warnings.simplefilter("error", coda.CodaReferencePathWarning)
        (layer(x).sum() + head(x, t, reduction="sum") + emb(t).sum()).backward()
        assert torch.isnan(head(x.detach(), t))  # a mean over no tokens, as PyTorch's
        no_rows = torch.zeros(0, 32, dtype=torch.bfloat16)
        s = coda.gemm_swiglu(no_rows, torch.ones(32, 64, dtype=torch.bfloat16))
    assert x.grad.shape == x.shape and s.s.shape == (0, 32)
    for module in (layer, head, emb):
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in module.parameters())
    for op in ("DecoderLayer", "LMHeadLoss", "Embedding", "gemm_swiglu"):
        assert coda.last_path(op) == ("reference", NO_TOKENS), op


def test_kernel_path_refuses_a_second_derivative_the_reference_path_takes_it(monkeypatch):
    """``create_graph=True`` through the kernel path's Functions (whose backward on the GPU is
    kernels autograd cannot see through) raises, naming the rule and the way out, for the
    layer, the LM head and the embedding; the reference path gives a second derivative; a
    plain backward through the kernel path runs as before."""
    from coda._validate import CodaInputError

    torch.manual_seed(0)
    layer = cnn.DecoderLayer(32, 2, 1, 48, dtype=F64)
    head = cnn.LMHeadLoss(32, 64, dtype=F64)
    x = torch.randn(1, 5, 32, dtype=F64, requires_grad=True)
    t = torch.randint(0, 64, (1, 5))
    for name, loss in (
        ("MLP", lambda: layer._kernel_forward(x).square().sum()),
        ("LinearCrossEntropyFunction", lambda: head._kernel_loss(x.view(5, 32), t.view(5), "sum")),
    ):
        with pytest.raises(CodaInputError, match=f"{name}: .*create_graph=True.*reference"):
            torch.autograd.grad(loss(), x, create_graph=True)
        loss().backward()  # once: as before
    emb = cnn.Embedding(64, 32, dtype=F64)
    with monkeypatch.context() as m:  # the kernel path forced: the interpreter's scatter
        m.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
        with pytest.raises(CodaInputError, match="Embedding: .*create_graph"):
            torch.autograd.grad(emb(t).square().sum(), emb.weight, create_graph=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # (flash attention's backward is differentiable once)
        for loss in (lambda: layer(x).square().sum(), lambda: head(x, t)):  # reference path
            (g,) = torch.autograd.grad(loss(), x, create_graph=True)
            (gg,) = torch.autograd.grad(g.square().sum(), x)
            assert torch.isfinite(gg).all() and gg.abs().sum() > 0


def test_kernel_path_runs_under_inference_mode(kernel_forced):
    """Under ``torch.inference_mode`` (evaluation, generation) the kernel path runs on
    inference tensors, positions made there included (they carry no version, which the
    position-table cache keys on: it builds their rows uncached), and gives its no_grad
    results exactly."""
    torch.manual_seed(0)
    layer = cnn.DecoderLayer(32, 2, 1, 48, dtype=F64)
    model = cnn.CausalLM(64, 32, 2, 2, 1, 48, dtype=F64)
    x, tok = torch.randn(2, 5, 32, dtype=F64), torch.randint(0, 64, (2, 5))
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    with torch.no_grad():
        want = layer(x, pos), model(tok, tok)
    with torch.inference_mode():
        got = layer(x.clone(), pos.clone()), model(tok.clone(), tok.clone())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert coda.last_path("DecoderLayer")[0] == "kernel"


def _programs_chosen(monkeypatch) -> list:
    """The list each F4 / QK-norm or bias F1 launch appends to from now on: True where it
    stores what its backward reads (``gemm_swiglu``, ``gemm_qk_norm_rope_keep_z``,
    ``gemm_rope_bias`` with z whole), False where not (with the bias: z clipped)."""
    from coda.kernels import library as lib

    kept = {"gemm_swiglu": lambda a: True, "gemm_swiglu_only": lambda a: False}
    kept |= {"gemm_qk_norm_rope_keep_z": lambda a: True, "gemm_qk_norm_rope": lambda a: False}
    kept["gemm_rope_bias"] = lambda a: a[-1] == a[1].shape[1]  # z_cols == Nqkv
    calls = []
    for name, keeps in kept.items():
        real = getattr(lib, name)
        monkeypatch.setattr(
            lib, name, lambda *a, _f=real, _k=keeps, **k: calls.append(_k(a)) or _f(*a, **k)
        )
    return calls


@pytest.mark.parametrize("kind", ["llama", "qk_norm", "qkv_bias"])
def test_a_forward_no_backward_can_follow_keeps_nothing_for_one(kernel_forced, monkeypatch, kind):
    """Where no backward can run (``torch.no_grad``, inference mode, nothing requiring a
    gradient) the layer's F4 stores no SwiGLU pre-activation and, with QK-norm, its F1 no z
    or head statistic (with Qwen2's bias, z's store clipped to one row): the output is a
    training forward's, bitwise; a training forward, and a forward on frozen weights whose
    input still wants its gradient, keep them."""
    calls = _programs_chosen(monkeypatch)
    torch.manual_seed(0)
    # head_dim 64: QK-norm's F1 takes the epilogue path (a tile holds whole heads)
    flags = {"qk_norm": kind == "qk_norm", "qkv_bias": kind == "qkv_bias"}
    layer = cnn.DecoderLayer(128, 2, 1, 96, dtype=F64, **flags)
    if kind == "qkv_bias":
        with torch.no_grad():
            layer.bias_qkv.normal_()
    x = torch.randn(2, 5, 128, dtype=F64)
    want = layer(x.requires_grad_(True))
    runs = 1 if kind == "llama" else 2  # the GEMMs that choose per call
    assert calls == [True] * runs
    for mode in (torch.no_grad, torch.inference_mode):
        calls.clear()
        with mode():
            assert torch.equal(layer(x.detach()), want)
        assert calls == [False] * runs
    layer.requires_grad_(False)
    calls.clear()
    assert torch.equal(layer(x.detach()), want) and calls == [False] * runs
    calls.clear()
    layer(x).sum().backward()  # frozen weights, an input that wants its gradient
    assert calls == [True] * runs and x.grad is not None
    calls.clear()
    monkeypatch.setattr(coda._autograd_support, "LEAN_FORWARD", False)  # the benchmarks' "before"
    with torch.no_grad():
        assert torch.equal(layer(x.detach()), want)
    assert calls == [True] * runs


@pytest.mark.parametrize("kind", ["llama", "qk_norm", "qkv_bias"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoints_first_forward_keeps_nothing_its_rerun_makes(
    kernel_forced, monkeypatch, kind, reentrant
):
    """Under activation checkpointing the backward reruns the layer's forward and reads the
    rerun's tensors, so the first forward stores nothing only the backward reads (F4 no
    pre-activation; with QK-norm, F1 no z or head statistic; with Qwen2's bias, z clipped),
    with either kind of checkpoint (non-reentrant: HF's default since transformers 5 and
    ``CausalLM(checkpoint=True)``; its first pass saves stand-ins of the same shapes, which
    torch checks), and the rerun stores them; output and every gradient equal the
    uncheckpointed step's, bitwise. Outside a checkpoint the pass is not told as one."""
    from torch.utils.checkpoint import checkpoint

    calls = _programs_chosen(monkeypatch)
    torch.manual_seed(1)
    flags = {"qk_norm": kind == "qk_norm", "qkv_bias": kind == "qkv_bias"}
    layer = cnn.DecoderLayer(128, 2, 1, 96, dtype=F64, **flags)
    if kind == "qkv_bias":
        with torch.no_grad():
            layer.bias_qkv.normal_()
    x = torch.randn(2, 5, 128, dtype=F64, requires_grad=True)
    dy = torch.randn(2, 5, 128, dtype=F64)
    runs = 1 if kind == "llama" else 2  # the GEMMs that choose per call
    steps = []
    for ckpt in (False, True):
        for p in (x, *layer.parameters()):
            p.grad = None
        calls.clear()
        out = checkpoint(layer, x, use_reentrant=reentrant) if ckpt else layer(x)
        first = list(calls)
        out.backward(dy)
        steps.append([out.detach(), x.grad] + [p.grad for p in layer.parameters()])
        assert first == [not ckpt] * runs
        assert calls == [not ckpt] * runs + [True] * runs * ckpt  # (the rerun keeps them)
    for a, b in zip(*steps):
        assert torch.equal(a, b)
    assert not coda.autograd.checkpoint_first_pass()


@pytest.mark.parametrize("qk_norm", [False, True])
def test_an_attention_with_weights_of_its_own_keeps_what_its_backward_reaches(
    kernel_forced, monkeypatch, qk_norm
):
    """Each Function decides on its own inputs: with the layer frozen and its input needing
    no gradient, an attention callable with a trainable weight still sends a gradient through
    the MLP's backward, so F4 keeps the pre-activation there (while QK-norm's F1, which no
    gradient reaches, stores nothing); the weight's gradient is the one a forward storing
    everything gives, bitwise."""
    from coda.autograd import sdpa_causal

    calls = _programs_chosen(monkeypatch)
    torch.manual_seed(0)
    temperature = torch.nn.Parameter(torch.tensor(1.5, dtype=F64))
    layer = cnn.DecoderLayer(
        128, 2, 1, 96, dtype=F64, qk_norm=qk_norm,
        attention=lambda q, k, v: sdpa_causal(q * temperature, k, v),
    ).requires_grad_(False)  # fmt: skip
    x = torch.randn(2, 5, 128, dtype=F64)
    grads = []
    for lean in (True, False):
        monkeypatch.setattr(coda._autograd_support, "LEAN_FORWARD", lean)
        temperature.grad = None
        layer(x).square().sum().backward()
        grads.append(temperature.grad)
    # (F1, then F4) in each forward: lean, then storing everything
    assert calls == ([False, True, True, True] if qk_norm else [True, True])
    assert torch.equal(*grads)


def _grads_after(module, inputs, backward) -> list:
    for p in (*module.parameters(), *inputs):
        p.grad = None
    backward()
    return [p.grad.clone() for p in (*module.parameters(), *inputs)]


@pytest.mark.parametrize("case", ["layer", "layer_qk_norm", "recompute", "chunked", "scaled_exp"])
def test_a_retained_graph_backs_up_twice_to_twice_the_gradients(kernel_forced, case):
    """``backward(retain_graph=True)`` then ``backward()`` gives exactly twice one backward's
    gradients: no backward writes into what its Function saved (a later in-place saving of
    memory there would be caught here)."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32, dtype=F64, requires_grad=True)
    t = torch.randint(0, 128, (2, 5))
    if case.startswith("layer"):
        module = cnn.DecoderLayer(32, 2, 1, 48, dtype=F64, qk_norm=case.endswith("norm"))
    else:
        module = cnn.LMHeadLoss(32, 128, dtype=F64, method=case)

    def loss():
        return module(x).square().sum() if case.startswith("layer") else module(x, t)

    once = _grads_after(module, [x], lambda: loss().backward())

    def twice():
        out = loss()
        out.backward(retain_graph=True)
        out.backward()

    for a, b in zip(_grads_after(module, [x], twice), once):
        assert torch.equal(a, 2 * b)


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_a_bad_attention_result_or_rope_table_is_named(monkeypatch, path):
    """A custom attention callable that returns something other than a tensor shaped as its q,
    or HF's RoPE tables of another shape, fail by name and rule on either path (they failed in
    a reshape or a broadcast inside the layer)."""
    if path == "kernel":
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    layer = cnn.DecoderLayer(32, 4, 2, 64, dtype=F64, backend=path)
    x = torch.randn(2, 5, 32, dtype=F64)
    for wrong in (lambda q, k, v: q[..., :1], lambda q, k, v: None):
        with pytest.raises(
            coda.CodaInputError, match=r"attention: must return a tensor shaped as q"
        ):
            layer(x, attention=wrong)
    layer(x, attention=lambda q, k, v: torch.zeros_like(q))  # the rule, not the callable
    if path == "reference":  # (the kernel path forms its own angles: the tables go unread)
        cos = torch.ones(2, 5, 8, dtype=F64)
        with pytest.raises(coda.CodaInputError, match=r"rope_cos_sin: must be \(cos, sin\)"):
            layer(x, rope_cos_sin=(cos[..., :4], cos[..., :4]))
        with pytest.raises(coda.CodaInputError, match="rope_cos_sin"):
            layer(x, rope_cos_sin=cos)
        layer(x, rope_cos_sin=(cos[:1], cos[:1] * 0))  # one table for the whole batch


def _misaligned(x):
    """x's values as a leaf whose view ``rows`` starts 2 bytes past a 16-byte boundary (a
    contiguous view at an odd offset of a flat buffer); the view's gradient lands in the leaf."""
    leaf = torch.cat([x.new_zeros(1), x.flatten()]).requires_grad_(True)
    rows = leaf[1:].view_as(x)
    assert rows.is_contiguous() and rows.data_ptr() % 16 == 2
    return leaf, rows


def _layer_and_head_step(rows, t):
    """A layer's and an LM head's outputs on ``rows`` (the same weights every call) after one
    backward, and their parameters' gradients."""
    torch.manual_seed(0)
    layer = cnn.DecoderLayer(128, 2, 1, 256, device=rows.device, attention=_math_attention)
    head = cnn.LMHeadLoss(128, 512, device=rows.device)
    y, loss = layer(rows), head(rows, t, reduction="sum")
    (y.float().square().sum() + loss).backward()
    return [y, loss, *(p.grad for p in (*layer.parameters(), *head.parameters()))]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_misaligned_activation_runs_as_its_aligned_copy(kernel_forced, device):
    """bf16 rows whose base address is 2 bytes off 16 (the TMA reads from 16-byte aligned
    addresses) run through the layer and the LM head as an aligned copy of them does: outputs,
    loss and every gradient bitwise. The layer copies such rows (``tma_aligned``: they are
    the O projection's residual operand), where the fused ops refuse them by name; the LM
    head's kernels never read its rows through the TMA (its final norm's row pass writes the
    GEMMs' operand), on every method (checked). On the CPU the tile interpreter checks the
    TMA's rules, so without the layer's copy this raises (checked); on the H200 the kernels'
    TMA descriptors would be given an address they cannot take."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(1)
    x = torch.randn(2, 16, 128, dtype=torch.bfloat16, device=device)
    t = torch.randint(0, 512, (2, 16), device=device)
    leaf, rows = _misaligned(x)
    got = _layer_and_head_step(rows, t)
    assert coda.last_path("DecoderLayer")[0] == "kernel"
    assert coda.last_path("LMHeadLoss")[0] == "kernel"
    xa = x.clone().requires_grad_(True)
    want = _layer_and_head_step(xa, t)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(leaf.grad[1:].view_as(x), xa.grad)


@pytest.mark.gpu
def test_gpu_edges_of_the_kernel_path():
    """H200, bf16: an empty batch launches nothing and gives zero gradients, caller positions
    made under ``torch.inference_mode`` run the kernel path as under no_grad, and a second
    derivative through it is refused."""
    from coda._validate import CodaInputError

    torch.manual_seed(0)
    layer = cnn.DecoderLayer(256, 4, 2, 512, device="cuda")
    head = cnn.LMHeadLoss(256, 1024, device="cuda")
    empty = torch.randn(0, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    (
        layer(empty).float().sum()
        + head(empty, torch.zeros(0, 128, dtype=torch.long).cuda(), "sum")
    ).backward()
    assert coda.last_path("DecoderLayer") == ("reference", NO_TOKENS)
    assert all(torch.count_nonzero(p.grad) == 0 for p in (*layer.parameters(), *head.parameters()))
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(128, device="cuda").repeat(2, 1)
    with torch.no_grad():
        want = layer(x, pos)
    with torch.inference_mode():
        got = layer(x.clone(), pos.clone())
    assert coda.last_path("DecoderLayer")[0] == "kernel" and torch.equal(got, want)
    xg = x.clone().requires_grad_(True)
    with pytest.raises(CodaInputError, match="create_graph=True"):
        torch.autograd.grad(layer(xg).float().square().sum(), xg, create_graph=True)


def _math_attention(q, k, v):
    """Causal GQA SDPA on its math backend: the same kernels whether autograd records or not
    (cuDNN's may differ between a training and an inference forward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        dict(d=2048, n_heads=16, n_kv_heads=8, ffn=5632),
        dict(d=1024, n_heads=16, n_kv_heads=8, ffn=3072, head_dim=128, qk_norm=True),
        dict(d=896, n_heads=14, n_kv_heads=2, ffn=4864, qkv_bias=True),
    ],
    ids=["llama-d2048", "qwen3-d1024", "qwen2-d896"],
)
def test_gpu_a_forward_without_backward_is_the_training_forward(shape):
    """H200, bf16: the layer's forward under ``torch.no_grad`` (F4 without SwiGLU's
    pre-activation store; with QK-norm, F1 without z and its statistic; with Qwen2's bias,
    F1's z store clipped to one row) gives the training forward's output bitwise, at the
    tuned tiles of the d=2048, Qwen3-0.6B and Qwen2.5-0.5B layers."""
    torch.manual_seed(0)
    layer = cnn.DecoderLayer(**shape, device="cuda", attention=_math_attention)
    if layer.qkv_bias:
        with torch.no_grad():
            layer.bias_qkv.normal_(0.0, 4.0)
    x = torch.randn(2, 256, shape["d"], device="cuda", dtype=torch.bfloat16)
    want = layer(x.clone().requires_grad_(True))
    with torch.no_grad():
        got = layer(x)
    assert coda.last_path("DecoderLayer")[0] == "kernel" and torch.equal(got, want)
