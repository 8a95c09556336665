"""Making coda's modules under an ambient default device: ``with torch.device("cuda")`` (fast
initialization on the GPU) and ``with torch.device("meta")`` (FSDP2 recipes shard a model
before spending memory on it, then ``to_empty`` and ``reset_parameters``). The RoPE tables a
layer derives on the host are built on the CPU whatever the ambient device, then moved; a
model made on meta and initialized after ``to_empty`` equals one made directly, under the same
seed, tied embeddings included. The meta device stands in for CUDA here: a CPU tensor mixed
with one made on the ambient device fails the same way on either."""

from __future__ import annotations

import pytest
import torch

import coda.nn as cnn
from coda.kernels.gemm_rope import rope_freq_table

SHAPE = dict(vocab=96, d=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=128, dtype=torch.float64)


def test_rope_tables_are_built_on_the_cpu_under_an_ambient_device():
    plain = rope_freq_table(16, 3, 1, device="cpu")
    with torch.device("meta"):
        table = rope_freq_table(16, 3, 1, device="cpu")
    assert table.device.type == "cpu"
    assert torch.equal(table, plain)


def test_a_layer_made_under_an_ambient_device_lives_there():
    with torch.device("meta"):
        layer = cnn.DecoderLayer(64, 4, 2, 128, dtype=torch.float64)
    assert layer.w_qkv.device.type == "meta"
    assert {t.device.type for t in layer._rope_tables.values()} == {"meta"}
    layer.to_empty(device="cpu")
    direct = cnn.DecoderLayer(64, 4, 2, 128, dtype=torch.float64)
    assert layer._rope_tables.keys() == direct._rope_tables.keys()
    for key, table in direct._rope_tables.items():
        assert torch.equal(layer._rope_tables[key], table), key


@pytest.mark.parametrize("tie", [False, True])
def test_a_model_made_on_meta_initializes_as_the_constructor_does(tie):
    torch.manual_seed(3)
    direct = cnn.CausalLM(**SHAPE, tie_embeddings=tie)
    with torch.device("meta"):
        model = cnn.CausalLM(**SHAPE, tie_embeddings=tie)
    model.to_empty(device="cpu")
    assert model.tie_embeddings == tie  # to_empty made new tensors: the tie is made again
    torch.manual_seed(3)
    model.reset_parameters()
    want = direct.state_dict()
    got = model.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    tokens = torch.randint(0, SHAPE["vocab"], (2, 9))
    assert torch.equal(model(tokens, tokens), direct(tokens, tokens))
    model(tokens, tokens).backward()
    if tie:  # one parameter, its gradient the sum of both uses
        assert model.head.weight.grad is model.embed.weight.grad
    assert len(list(model.parameters())) == len(list(direct.parameters()))


@pytest.mark.gpu
def test_gpu_a_model_made_under_torch_device_cuda_trains():
    """H200: ``with torch.device("cuda")`` (the build that crashed in run 78) makes a model
    whose RoPE tables and first loss are those of the same weights made with
    ``device="cuda"``, on the kernel path."""
    shape = {**SHAPE, "d": 256, "n_heads": 4, "n_kv_heads": 2, "ffn": 512, "vocab": 1024}
    shape["dtype"] = torch.bfloat16
    with torch.device("cuda"):
        model = cnn.CausalLM(**shape)
    direct = cnn.CausalLM(**shape, device="cuda")
    direct.load_state_dict(model.state_dict())
    for a, b in zip(model.layers, direct.layers):
        for key, table in b._rope_tables.items():
            assert torch.equal(a._rope_tables[key], table), key
    tokens = torch.randint(0, 1024, (2, 128), device="cuda")
    loss = model(tokens, tokens)
    assert torch.equal(loss, direct(tokens, tokens))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_module_arguments_are_named_by_their_rules():
    """A plain argument of a module that is not a number or a dtype it can hold raises by name
    and rule when the module is made, not from torch or the RoPE table's arithmetic."""
    import coda

    with pytest.raises(coda.CodaInputError, match="rope_base: must be a finite positive"):
        cnn.DecoderLayer(32, 4, 2, 64, rope_base="1e4")
    for make in (
        lambda: cnn.DecoderLayer(32, 4, 2, 64, dtype=torch.int32),
        lambda: cnn.LMHeadLoss(32, 64, dtype=torch.int64),
        lambda: cnn.CausalLM(64, 32, 1, 4, 2, 64, dtype=torch.int32),
        lambda: cnn.Embedding(64, 32, dtype=torch.int32),
    ):
        with pytest.raises(coda.CodaInputError, match="dtype: parameters need a floating dtype"):
            make()
    assert cnn.Embedding(64, 32, dtype=None).weight.dtype == torch.get_default_dtype()
