"""coda's token-embedding backward (``coda.kernels.embedding``, ``coda.autograd.Embedding``,
``coda.nn.Embedding``): the gradient of the embedding table as one sorted scatter.

CPU: the autograd Function's kernel-path code against autograd through ``F.embedding`` in
float64 (repeated tokens, a padding row, odd widths); the Triton kernel in Triton's
interpreter against its torch form, within the summation error bound of fp32 sums taken in
another order (plus one rounding step of a bf16 table), with runs of equal tokens that cross
many programs' chunks (Zipf-distributed ids, one run over every row); sm_90a compile. GPU: the
same comparison at a Llama-1B step's shape, two runs bitwise, and the module's gradient against
fp32 with CODA's protocol."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton_child
from conftest import rel_err

import coda
import coda.nn as cnn
from coda.autograd import Embedding as EmbeddingFunction
from coda.kernels.embedding import embedding_backward, embedding_backward_torch

F64, BF16 = torch.float64, torch.bfloat16


def _tokens(M, V, how, g, device="cpu"):
    if how == "skewed":  # a few tokens repeated far past a program's 16 sorted rows
        t = (torch.rand(M, generator=g) ** 4 * V).long()
    elif how == "zipf":  # as text's tokens: the most frequent a sizeable share of all
        p = torch.arange(1, V + 1, dtype=F64).pow(-1.1)
        t = torch.multinomial(p / p.sum(), M, replacement=True, generator=g)
    elif how == "runs":  # runs of 17 equal tokens: every one crosses a chunk's edge
        t = torch.arange(M) // 17 % V
    elif how == "one":
        t = torch.full((M,), V // 2)
    else:
        t = torch.randint(0, V, (M,), generator=g)
    return t.to(device)


@pytest.mark.parametrize(
    "shape, M, d, V, pad, how",
    [
        ((3, 7), 21, 24, 40, None, "uniform"),
        ((2, 100), 200, 40, 7, 3, "skewed"),
        ((64,), 64, 520, 300, 10, "one"),  # one run (d past a program's 512 columns)
        ((5, 1), 5, 9, 11, 0, "uniform"),
        ((3, 150), 450, 8, 60, 1, "zipf"),
    ],
)
def test_backward_equals_autograd_through_f_embedding(shape, M, d, V, pad, how):
    g = torch.Generator().manual_seed(M + d)
    tokens = _tokens(M, V, how, g).reshape(shape)
    if pad is not None:
        tokens.view(-1)[::4] = pad
    w = torch.randn(V, d, generator=g, dtype=F64)
    dy = torch.randn(*shape, d, generator=g, dtype=F64)
    w1, w2 = w.clone().requires_grad_(True), w.clone().requires_grad_(True)
    out = EmbeddingFunction.apply(tokens, w1, -1 if pad is None else pad)
    ref = F.embedding(tokens, w2, padding_idx=pad)
    assert torch.equal(out, ref)
    out.backward(dy)
    ref.backward(dy)
    assert rel_err(w1.grad, w2.grad) < 1e-14
    if pad is not None:
        assert not w1.grad[pad].any()


def test_torch_form_sums_in_fp32_and_rounds_once():
    """In bf16 the table's rows are the float64 sums rounded once (to within one rounding of
    the fp32 sum): never the bf16 running sum torch's own ``index_put_`` would make."""
    g = torch.Generator().manual_seed(0)
    tokens = _tokens(600, 5, "uniform", g)  # ~120 rows per table row
    grad = torch.randn(600, 16, generator=g).to(BF16)
    exact = embedding_backward_torch(tokens, grad.double(), 5)
    got = embedding_backward_torch(tokens, grad, 5)
    assert got.dtype == BF16
    step = exact.abs() * 2.0**-8  # half a bf16 step, plus fp32's own rounding
    assert ((got.double() - exact).abs() <= step * 1.01).all()


_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_embedding import _tokens, within_bound
from coda.kernels.embedding import embedding_backward, embedding_backward_torch
out = []
for i, (M, d, V, pad, how, dtype) in enumerate([
    (37, 24, 40, -1, "uniform", torch.bfloat16),
    (200, 40, 7, 3, "skewed", torch.bfloat16),
    (64, 520, 300, -1, "one", torch.float32),
    (300, 16, 257, 0, "uniform", torch.float64),
    (0, 8, 10, -1, "uniform", torch.bfloat16),
    (700, 24, 50, -1, "zipf", torch.float32),
    (1500, 8, 9, -1, "one", torch.float64),  # one run over 94 chunks: six steps of QB pieces
    (400, 40, 1000, 2, "runs", torch.bfloat16),
    (16, 8, 3, -1, "skewed", torch.float32),  # one chunk: the run pass does not launch
]):
    g = torch.Generator().manual_seed(i)
    tokens = _tokens(M, V, how, g)
    if pad >= 0:
        tokens[::3] = pad
    grad = torch.randn(M, d, generator=g).to(dtype)
    a = embedding_backward(tokens, grad, V, pad)  # the Triton kernels, interpreted
    b = embedding_backward_torch(tokens, grad, V, pad)
    out.append([M, str(a.dtype), within_bound(a, b, tokens, grad, V, pad), bool(b.any())])
print(json.dumps(out))
"""


def within_bound(a, b, tokens, grad, V, pad):
    """Largest |a - b| over its bound: both are each row's tokens summed in fp32 (float64 for
    a float64 table), in different orders, each rounded once to the table's dtype. Two sums
    of the same n terms differ by at most 2 n u sum|x| (u the accumulator's unit roundoff);
    a bf16 table's roundings add one step of the value at most."""
    acc_u = 2.0**-53 if grad.dtype == F64 else 2.0**-24
    step = 2.0**-7 if grad.dtype == BF16 else 0.0
    n = max(tokens.numel(), 1)
    abs_sum = embedding_backward_torch(tokens, grad.double().abs(), V, pad)
    bound = b.double().abs() * step + 2 * n * acc_u * abs_sum
    return ((a.double() - b.double()).abs() / (bound + 1e-300)).max().item() if n else 0.0


def test_kernel_in_triton_interpreter_equals_torch_form():
    """Within ``within_bound``: the kernels sum a run's pieces chunk by chunk where the torch
    form sums token by token, and the interpreter's fp32-to-bf16 cast truncates where the
    GPU's rounds to nearest even."""
    results = triton_child.results(_CHILD)
    assert len(results) == 9
    for M, dtype, err, nonzero in results:
        assert err <= 1.0, (M, dtype, err)
        assert nonzero == (M > 0), (M, dtype)


def test_the_function_compiles_whole_and_equals_eager():
    """Under ``torch.compile(fullgraph=True)`` the backward is the custom op (its fake gives
    the table's shape and dtype): no graph break, the eager gradient bitwise."""
    g = torch.Generator().manual_seed(3)
    tokens = _tokens(30, 20, "skewed", g).reshape(5, 6)
    w = torch.randn(20, 8, generator=g, dtype=F64)
    grads = []
    for run in (
        EmbeddingFunction.apply,
        torch.compile(EmbeddingFunction.apply, fullgraph=True, backend="aot_eager"),
    ):
        wi = w.clone().requires_grad_(True)
        (run(tokens, wi, 4) ** 2).sum().backward()
        grads.append(wi.grad)
    assert torch.equal(*grads)


def test_a_wrong_sum_is_detected():
    """The comparison can fail: a table with one token's row dropped is far out of bound."""
    tokens = torch.tensor([0, 1, 1, 2])
    grad = torch.randn(4, 8, dtype=F64)
    a = embedding_backward(tokens, grad, 3)
    b = embedding_backward(tokens[:3], grad[:3], 3)
    assert within_bound(b, a, tokens, grad, 3, -1) > 1e6


@pytest.mark.compile
def test_the_model_names_tokens_out_of_the_table():
    """``CausalLM`` refuses a token id outside [0, vocab) on the CPU by name and rule (the
    embedding's gather would raise torch's bare 'index out of range in self')."""
    model = cnn.CausalLM(32, 16, 1, 2, 1, 32, dtype=F64)
    ok = torch.randint(0, 32, (2, 5))
    for bad in (32, -1):
        tokens = ok.clone()
        tokens[1, 3] = bad
        with pytest.raises(
            coda.CodaInputError, match=rf"tokens: ids must be in \[0, 32\), got {bad}"
        ):
            model(tokens, ok)
    with pytest.raises(coda.CodaInputError, match="tokens: must be an integer"):
        model(ok.double(), ok)
    assert torch.isfinite(model(ok, ok))


def test_embedding_backward_compiles_for_sm90():
    from coda.kernels.embedding import compile_embedding_backward

    assert compile_embedding_backward() > 0


def test_module_is_nn_embedding_and_refuses_what_it_lacks():
    torch.manual_seed(1)
    e = cnn.Embedding(30, 8, padding_idx=2, backend="reference")
    ref = torch.nn.Embedding(30, 8, padding_idx=2)
    ref.load_state_dict(e.state_dict())
    assert isinstance(e, torch.nn.Embedding) and set(e.state_dict()) == {"weight"}
    assert not e.weight[2].any()  # nn.Embedding's initialization
    t = torch.randint(0, 30, (4, 5))
    assert torch.equal(e(t), ref(t))
    for name in ("max_norm", "scale_grad_by_freq", "sparse"):
        with pytest.raises(coda.CodaInputError, match=name):
            cnn.Embedding(30, 8, **{name: 1.0 if name == "max_norm" else True})
    with pytest.raises(coda.CodaInputError, match="max_norm"):  # a norm of 0 renorms too
        cnn.Embedding(30, 8, max_norm=0.0)
    with pytest.raises(coda.UnsupportedDeviceError):
        cnn.Embedding(30, 8, backend="kernel")(t)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["uniform", "skewed", "zipf"])
def test_gpu_kernel_equals_torch_form_and_repeats_bitwise(how):
    g = torch.Generator().manual_seed(5)
    M, d, V = 16384, 2048, 128256
    tokens = _tokens(M, V, how, g, "cuda")
    grad = torch.randn(M, d, generator=g).to(BF16).cuda()
    a = embedding_backward(tokens, grad, V, 7)
    assert torch.equal(a, embedding_backward(tokens, grad, V, 7))
    b = embedding_backward_torch(tokens, grad, V, 7)
    assert within_bound(a, b, tokens, grad, V, 7) <= 1.0


@pytest.mark.gpu
def test_gpu_module_gradient_passes_the_protocol():
    """``coda.nn.Embedding``'s bf16 gradient against fp32's, no worse than ``nn.Embedding``'s
    own bf16 gradient (CODA's protocol), on the kernel path."""
    from coda.env import last_path

    torch.manual_seed(6)
    V, d = 32000, 1024
    coda_e = cnn.Embedding(V, d, device="cuda", dtype=BF16)
    torch_e = torch.nn.Embedding(V, d, device="cuda", dtype=BF16)
    fp32_e = torch.nn.Embedding(V, d, device="cuda")
    for m in (torch_e, fp32_e):
        m.weight.data.copy_(coda_e.weight.float())
    tokens = (torch.rand(4, 2048, device="cuda") ** 3 * V).long()
    dy = torch.randn(4, 2048, d, device="cuda")
    for m in (coda_e, torch_e, fp32_e):
        m(tokens).backward(dy.to(m.weight.dtype))
    assert last_path("Embedding")[0] == "kernel"
    e_coda = rel_err(coda_e.weight.grad.float(), fp32_e.weight.grad)
    e_torch = rel_err(torch_e.weight.grad.float(), fp32_e.weight.grad)
    assert e_coda <= e_torch * 1.0001, (e_coda, e_torch)
