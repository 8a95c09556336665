"""FSDP2 wiring on the CPU: two gloo processes, ``fully_shard`` per coda decoder layer and on
the whole model, one global batch split across them; the loss and every (gathered) gradient
must equal one unsharded process on the whole batch (fp32, reference path). The benchmark's
PyTorch peers (eager and per-layer torch.compile) are sharded and checked the same way, and so
is a sharded model made on the meta device and loaded from the full state dict, and an HF
Llama patched by ``apply_coda`` (``fsdp_hf_worker.py``; its ``gpu`` test runs it on NCCL
with bf16 compute, one rank per GPU)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.provenance import source_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(tmp_path, *flags, script=("benchmarks/fsdp_step.py", "--check"), nproc=2) -> tuple:
    """``script`` (``fsdp_step.py --check``) on ``nproc`` ranks (gloo on CPUs, NCCL on GPUs)
    with ``flags``: (its result, its stdout and stderr)."""
    out = tmp_path / "fsdp.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        *script,
        *flags,
        "--out",
        str(out),
    ]
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # faulthandler: a rank that dies on a signal prints every thread's Python stack
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    written = f"(rank 0's result {'was' if out.exists() else 'was not'} written)\n"
    assert proc.returncode == 0, written + proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout + proc.stderr


# FSDP2's warning for a sharded module whose output is a view (coda's layers return their own)
VIEW_WARNING = "returned a view tensor"


@pytest.mark.parametrize("form", ["llama", "qk_norm", "post_norms"])
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_a_layer_returns_a_tensor_of_its_own(path, form):
    """A decoder layer's output on either path is a (batch, seq, d) tensor of its own, not a
    view of its (tokens, d) rows: an in-place op on a sharded module's output that is a view
    would skip FSDP2's pre-backward hook (its all-gather), and FSDP2 warns of every such
    output."""
    from coda.nn import DecoderLayer

    flags = {form: True} if form != "llama" else {}  # (post_norms: Gemma 2's and 3's layer)
    layer = DecoderLayer(24, 4, 2, 20, head_dim=6, dtype=torch.float64, **flags)
    x = torch.randn(2, 5, 24, dtype=torch.float64, requires_grad=True)
    out = layer._kernel_forward(x) if path == "kernel" else layer(x)
    assert out.shape == (2, 5, 24) and out._base is None and not out._is_view()
    out.sum().backward()  # the (batch, seq, d) gradient reaches the layer's backward
    assert x.grad.shape == x.shape


def test_fsdp2_two_gloo_ranks_match_one_process(tmp_path):
    if not torch.distributed.is_available():
        raise AssertionError("torch.distributed is not available in this build")
    result, stdout = _run(tmp_path, "--steps", "1", "--peers")
    assert VIEW_WARNING not in stdout
    assert result["world"] == 2
    assert result["source_sha256"] == source_digest()  # the record names the tree that ran
    assert result["loss_rel_diff"] < 1e-5 and result["worst_grad_rel_diff"] < 1e-5, result
    assert "FSDP check: PASS" in stdout
    # the benchmark's peers (the same model in PyTorch, eager and compiled) shard the same way
    # and compute the same loss from the same weights (fp32 round-off)
    for peer in ("torch_eager", "torch_compile"):
        assert abs(result[peer]["loss"] - result["loss"]) < 1e-5 * result["loss"], result


def test_fsdp2_a_model_made_on_meta_and_loaded_matches_one_process(tmp_path):
    """TorchTitan's way: the sharded model made on the meta device, sharded, ``to_empty`` and
    the full state dict loaded into the shards; the loss and every gradient still equal one
    unsharded process's (the layers' RoPE tables rebuilt on the real device)."""
    result, stdout = _run(tmp_path, "--meta-init")
    assert result["init"].startswith("meta") and result["world"] == 2
    assert result["loss_rel_diff"] < 1e-5 and result["worst_grad_rel_diff"] < 1e-5, result
    assert "FSDP check: PASS" in stdout


def test_fsdp2_over_compiled_coda_layers_matches_one_process(tmp_path):
    """TorchTitan's recipe over coda: each coda layer under ``torch.compile`` (``aot_eager``
    on the CPU), then sharded; the loss and every gradient still equal one unsharded,
    uncompiled process's."""
    result, stdout = _run(tmp_path, "--compile")
    assert result["coda_layers_compiled"] and result["world"] == 2
    assert result["dynamo_graphs"] >= 1  # traced (both layers share one compiled graph)
    assert result["loss_rel_diff"] < 1e-5 and result["worst_grad_rel_diff"] < 1e-5, result
    assert "FSDP check: PASS" in stdout


def test_fsdp2_shards_a_patched_hf_model(tmp_path):
    """``fully_shard`` per patched layer (FSDP2 subclasses the patched class again) and on the
    root of an HF Llama patched by ``apply_coda``: the loss and every gradient (HF layout,
    gathered) equal the unpatched model's on the whole batch, and the sharded model's
    ``state_dict()`` is the unpatched model's in HF keys and layouts, gathered exactly; a
    sharded ``torch.distributed.checkpoint`` round trip (``coda_keys``) keeps the weights."""
    pytest.importorskip("transformers")
    result, output = _run(tmp_path, script=("tests/fsdp_hf_worker.py",))
    assert VIEW_WARNING not in output
    assert result["world"] == 2 and result["layer_class"] == "FSDPLlamaDecoderLayer"
    assert result["device"] == "cpu" and result["path"] == "reference"
    assert result["loss_rel_diff"] < 1e-5 and result["worst_grad_rel_diff"] < 1e-5, result
    assert result["worst_state_rel_diff"] == 0.0, result
    # a sharded checkpoint (torch.distributed.checkpoint, in coda's keys) loaded into another
    # sharded patched model gives it the first one's weights
    assert result["reloaded_loss_rel_diff"] < 1e-5, result


@pytest.mark.gpu
def test_gpu_fsdp2_shards_a_patched_hf_model(tmp_path):
    """The same on GPUs (NCCL, one rank per GPU: a single rank on one H200), fp32 weights
    gathered in bf16 for compute on the kernel path: the loss and every gradient equal one
    unsharded patched bf16 model's on the whole batch within ``fsdp_step.py``'s bf16 bound,
    the gathered state dict the unpatched model's exactly, and a sharded checkpoint round
    trip keeps the weights (its loss, HF's bf16 head under no_grad, within the same bound)."""
    pytest.importorskip("transformers")
    n = torch.cuda.device_count()
    result, output = _run(tmp_path, script=("tests/fsdp_hf_worker.py",), nproc=n)
    assert VIEW_WARNING not in output
    assert result["world"] == n and result["device"] == "cuda" and result["path"] == "kernel"
    assert result["loss_rel_diff"] < 2e-2 and result["worst_grad_rel_diff"] < 2e-2, result
    assert result["worst_state_rel_diff"] == 0.0, result
    assert result["reloaded_loss_rel_diff"] < 2e-2, result
