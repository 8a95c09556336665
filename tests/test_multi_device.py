"""One process, two GPUs, no ``torch.cuda.set_device``: a model on ``cuda:1`` while ``cuda:0``
is current. coda's kernels launch on their tensors' device (``coda._device``): the model's
training step and an op give the bits they give with ``cuda:1`` current, and ``cuda:0`` is
current after; a ``GraphedStep`` warms up, captures and replays on its model's device; a
patched HF model placed over both GPUs by accelerate (``device_map``) steps bit for bit as
on one. Needs two SM90 GPUs and is skipped on one; the CPU tests of the launch sites' choice
are in tests/test_triton_launch.py and tests/test_launch_cache.py, of ``GraphedStep``'s in
tests/test_graphs.py, of the patch's hooks in tests/test_transformers_accelerate.py."""

from __future__ import annotations

import copy

import pytest
import torch

import coda
import coda.nn as cnn


def _step(model, tokens, targets):
    for p in model.parameters():
        p.grad = None
    loss = model(tokens, targets)
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_kernels_launch_on_their_tensors_device():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    one = torch.device("cuda", 1)
    model = cnn.CausalLM(4096, 512, 2, 8, 4, 1408, device=one)
    tokens = torch.randint(0, 4096, (2, 256), device=one)
    targets = torch.randint(0, 4096, (2, 256), device=one)
    x = torch.randn(512, 512, device=one, dtype=torch.bfloat16)
    w = torch.randn(512, 2816, device=one, dtype=torch.bfloat16) / 512**0.5
    results = {}
    for current in (1, 0):  # the tensors' device current, then another one
        torch.cuda.set_device(current)
        with sdpa_kernel(SDPBackend.MATH), torch.no_grad():  # (a deterministic backward)
            s = coda.gemm_swiglu(x, w).s
        with sdpa_kernel(SDPBackend.MATH):
            results[current] = [s, *_step(model, tokens, targets)]
        torch.cuda.synchronize(one)
        assert torch.cuda.current_device() == current
    for op in ("gemm_swiglu", "DecoderLayer", "LMHeadLoss", "Embedding"):
        assert coda.last_path(op)[0] == "kernel", op
    for a, b in zip(results[1], results[0]):
        assert a.device == one and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_a_graphed_step_on_another_device_trains_as_its_eager_step():
    """``GraphedStep`` of a model on ``cuda:1`` with ``cuda:0`` current: two eager calls, a
    capture, two replays, the same losses and weights as the eager steps run with ``cuda:1``
    current, bitwise."""
    from test_graphs import _batches, _eager_steps
    from torch.nn.attention import SDPBackend, sdpa_kernel

    one = torch.device("cuda", 1)

    def lm_and_adamw():
        torch.manual_seed(0)
        model = cnn.CausalLM(4096, 512, 2, 8, 4, 1408, device=one)
        lr = torch.tensor(1e-3, device=one)
        return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)

    batches = _batches(5, 4096, (2, 256), one)
    (a, opt_a), (b, opt_b) = lm_and_adamw(), lm_and_adamw()
    with sdpa_kernel(SDPBackend.MATH):  # (a deterministic backward)
        torch.cuda.set_device(1)
        want = _eager_steps(a, opt_a, batches)
        torch.cuda.set_device(0)
        step = cnn.GraphedStep(b, opt_b, warmup=2)
        got = [step(tok, tgt) for tok, tgt in batches]
    torch.cuda.synchronize(one)
    assert step.graphed and torch.cuda.current_device() == 0
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.device == one and torch.equal(x, y), f"step {i}"
    for (name, p), q in zip(b.named_parameters(), a.parameters()):
        assert torch.equal(p, q), name


# where each part sits: the layers split, the head with the last; the head alone on another
PLACES = {"layers split": (0, 0, 1, 1, 1), "head apart": (0, 0, 0, 1, 1)}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("where", PLACES)
def test_gpu_a_patched_hf_model_over_two_gpus_steps_as_on_one(where):
    from accelerate import dispatch_model
    from test_transformers import _step, model_class, tiny_config
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import coda.transformers as ct

    shape = dict(hidden_size=256, intermediate_size=512, vocab_size=1024)
    cfg = tiny_config(**shape, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    torch.manual_seed(0)
    base = model_class(cfg)(cfg).to(torch.bfloat16)
    on_one = ct.apply_coda(copy.deepcopy(base).to("cuda:0"))
    parts = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head")
    places = {"model.rotary_emb": 0, **dict(zip(parts, PLACES[where]))}
    on_two = ct.apply_coda(dispatch_model(copy.deepcopy(base), device_map=places))
    assert on_two.lm_head.weight.device == torch.device("cuda", 1)
    ids = torch.randint(0, 1024, (2, 128), device="cuda:0")
    torch.cuda.set_device(0)
    with sdpa_kernel(SDPBackend.MATH):
        losses = [_step(m, input_ids=ids, labels=ids) for m in (on_one, on_two)]
    assert coda.last_path("DecoderLayer")[0] == "kernel"
    assert torch.equal(losses[0], losses[1].to(losses[0].device))
    grads = ct.hf_gradients(on_one), ct.hf_gradients(on_two)
    assert grads[0].keys() == grads[1].keys()
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name].to(g.device)), name
