"""FSDP2 over coda's modules: ``fully_shard`` per decoder layer and on the whole model, one
global batch split across the ranks, checked against one process running the same batch.

    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_step.py --check       # gloo, CPU
    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_step.py --check --steps 20
    torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_step.py --steps 10 --peers \
        --layers 4 --dim 2048 --heads 32 --kv-heads 8 --ffn 8192 --vocab 128256 --batch 4 --seq 4096

On CPUs (gloo) the model is fp32 and runs coda's reference path: CI uses this to test the
sharding wiring. On GPUs (NCCL) the parameters are fp32, sharded, and gathered in bf16 for
compute (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), so coda's modules run
their kernel path; ``--steps`` then times the step (tokens/s per GPU, peak memory per GPU).
``--check``: rank 0 also runs the unsharded model on the whole global batch; the loss and every
gradient must match (fp32: to round-off; bf16: within the spread of two bf16 runs).
``--meta-init``: the sharded model is made on the meta device, sharded, then ``to_empty`` and
the full state dict loaded into the shards (TorchTitan's way for models too large to make
whole); the check then also covers that path.
``--peers``: the same model (same weights) in plain PyTorch (``TorchLlama``), eager and with
each layer under ``torch.compile`` (TorchTitan's recipe), sharded the same way and timed the
same way in the same run.
``--compile``: coda's own layers each under ``torch.compile`` before sharding, as TorchTitan
compiles its blocks (Inductor on GPUs; on CPUs ``backend="aot_eager"``: the trace and the
sharding wiring are what the check tests there, not Inductor's CPU code).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import coda.nn as cnn
from coda.env import describe
from coda.reference.model import TorchLlama

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.provenance import source_digest  # noqa: E402 (a record's ``source_sha256``)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="FSDP2 over coda's modules, checked or timed.")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--dim", dest="d", type=int, default=64, help="hidden size (default 64)")
    ap.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    ap.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    ap.add_argument("--ffn", type=int, default=128, help="MLP width (default 128)")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary (default 256)")
    ap.add_argument("--batch", type=int, default=4, help="global batch, split over ranks")
    ap.add_argument("--seq", type=int, default=32, help="sequence length (default 32)")
    ap.add_argument("--steps", type=int, default=0, help="timed steps after the check")
    ap.add_argument("--check", action="store_true", help="compare with one unsharded process")
    ap.add_argument("--peers", action="store_true", help="also time PyTorch eager / compile")
    ap.add_argument(
        "--meta-init",
        action="store_true",
        help="make the sharded model on the meta device, then to_empty and load the full "
        "state dict (TorchTitan's way)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="each coda layer under torch.compile before sharding (TorchTitan's recipe)",
    )
    ap.add_argument("--out", default=None, help="write the result JSON here (rank 0)")
    ap.add_argument("--commit", default="unknown", help="the git commit, for the record")
    return ap.parse_args(argv)


def sharded(reference, args, device, gpu: bool):
    """``reference``'s model sharded: a deep copy, or with ``--meta-init`` made on the meta
    device (no memory spent), sharded, given real storage on its device (``to_empty``; the
    layers rebuild their RoPE tables there) and loaded from the full state dict, each rank
    keeping its shard (``set_model_state_dict``), as a large model is made and restored."""
    if not args.meta_init:
        return shard(compiled_layers(copy.deepcopy(reference), args.compile, gpu), gpu)
    model = shard(compiled_layers(build(args, torch.device("meta")), args.compile, gpu), gpu)
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, reference.state_dict(), options=options)
    return model


def compiled_layers(model, compile_: bool, gpu: bool):
    """``model`` with each layer under ``torch.compile`` where ``compile_`` (``--compile``)."""
    if compile_:
        for layer in model.layers:
            layer.compile(**({} if gpu else {"backend": "aot_eager"}))
    return model


def build(args, device):
    torch.manual_seed(0)
    return cnn.CausalLM(
        args.vocab,
        args.d,
        args.layers,
        args.heads,
        args.kv_heads,
        args.ffn,
        device=device,
        dtype=torch.float32,
    )


def peer(reference, compiled: bool, gpu: bool):
    """The same weights as a plain PyTorch Llama; ``compiled``: each layer under
    torch.compile, before sharding (on CPUs with ``backend="aot_eager"``, as ``--compile``
    compiles coda's: the CPU run checks the wiring; with Inductor's C++ compile of the peer
    the gloo test took 26.5 s on a cold cache, 12.7 s without it, session 78)."""
    return compiled_layers(TorchLlama.of(reference), compiled, gpu)


def timed(model, tokens, targets, steps: int, gpu: bool) -> dict:
    """Mean wall time of ``steps`` training steps (forward, backward, AdamW) after
    three warm-up steps: ms per step, tokens/s per rank, peak memory per rank."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(tokens, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if gpu:
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return {
        "step_ms": dt * 1e3,
        "tokens_per_s_per_rank": tokens.numel() / dt,
        "peak_gib_per_rank": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
    }


def shard(model, gpu: bool):
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if gpu
        else None
    )
    kw = {"mp_policy": mp} if mp else {}
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def command(world: int, out) -> str:
    """This run's command line as a record names it: the output folder as ``$OUT``."""
    argv = [a if a != out else "$OUT/" + os.path.basename(a) for a in sys.argv[1:]]
    return f"torchrun --standalone --nproc_per_node {world} benchmarks/fsdp_step.py " + " ".join(
        shlex.quote(a) if not a.startswith("$OUT/") else a for a in argv
    )


def main(argv=None):
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch ({args.batch}) must be a multiple of the world size ({world})")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    )
    if gpu:
        torch.cuda.set_device(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    targets = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    per = args.batch // world
    mine = slice(rank * per, (rank + 1) * per)

    reference = build(args, device)
    model = sharded(reference, args, device, gpu)
    loss = model(tokens[mine], targets[mine])
    loss.backward()
    # every rank's loss is a mean over the same number of tokens: the global mean is their mean
    global_loss = loss.detach().float().clone()
    dist.all_reduce(global_loss)
    global_loss /= world
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit,
        "source_sha256": source_digest(),  # the tree that ran (``benchmarks/provenance.py``)
        "command": command(world, args.out),
        "env": {**describe(), "gpus": world},
        "world": world,
        "device": str(device),
        "init": "meta, then the full state dict" if args.meta_init else "a copy, sharded",
        "coda_layers_compiled": args.compile,
        "dynamo_graphs": counters["stats"]["unique_graphs"],  # compiled so far (this rank)
        "loss": float(global_loss),
    }

    if args.check and rank == 0:
        ref_model = reference
        if gpu:  # the same bf16 compute the sharded model does
            ref_model = copy.deepcopy(reference).to(torch.bfloat16)
        ref_loss = ref_model(tokens, targets)
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        worst = 0.0
        for n, p in ref_model.named_parameters():
            a, b = grads[n].double(), p.grad.double()
            worst = max(worst, float((a - b).norm() / b.norm().clamp(min=1e-30)))
        result.update(
            reference_loss=float(ref_loss),
            loss_rel_diff=abs(float(global_loss) - float(ref_loss)) / abs(float(ref_loss)),
            worst_grad_rel_diff=worst,
        )
    if args.steps:
        result["coda"] = timed(model, tokens[mine], targets[mine], args.steps, gpu)
    if args.steps and args.peers:
        del model, grads
        for name, compiled in (("torch_eager", False), ("torch_compile", True)):
            if gpu:
                torch.cuda.empty_cache()
            m = shard(peer(reference, compiled, gpu), gpu)
            first = m(tokens[mine], targets[mine]).detach().float().clone()  # same weights:
            dist.all_reduce(first)  # the peer's first loss must be coda's (checked below)
            result[name] = {
                "loss": float(first / world),
                **timed(m, tokens[mine], targets[mine], args.steps, gpu),
            }
            del m
        base = result["torch_compile"]["tokens_per_s_per_rank"]
        for name in ("coda", "torch_eager", "torch_compile"):
            result[name]["speedup_vs_torch_compile"] = result[name]["tokens_per_s_per_rank"] / base
    if rank == 0:
        print(json.dumps(result))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()  # every rank done (rank 0 ran the reference) before the group goes
    dist.destroy_process_group()
    if args.check and rank == 0:
        tol = 1e-5 if not gpu else 2e-2
        ok = result["loss_rel_diff"] < tol and result["worst_grad_rel_diff"] < tol
        for name in ("torch_eager", "torch_compile"):  # the peers compute the same model
            if name in result:
                ok = ok and abs(result[name]["loss"] - result["loss"]) < tol * result["loss"]
        print("FSDP check:", "PASS" if ok else "FAIL", f"(tolerance {tol})")
        if not ok:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
