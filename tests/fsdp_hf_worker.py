"""One rank of ``test_fsdp_gloo.py``'s patched-HF check (run under ``torch.distributed.run``
with gloo on the CPU): a tiny random Llama patched by ``apply_coda``, ``fully_shard`` per
decoder layer and on the root, one step on this rank's half of a batch. Rank 0 writes (to the
path after ``--out``) the global loss and the worst gradient difference against the unpatched
model on the whole batch, the worst difference between the sharded model's
``state_dict()`` (HF keys, gathered) and the unpatched model's, and the loss of another
sharded patched model after a ``torch.distributed.checkpoint`` save and load (coda's keys)."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_transformers import model_class, tiny_config  # noqa: E402

import coda.transformers as ct  # noqa: E402


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worst(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max(
        float((_full(got[k]) - w).norm() / w.norm().clamp(min=1e-30)) for k, w in want.items()
    )


def _checkpoint_round_trip(model, cfg, mine, path: str):
    """A sharded checkpoint of ``model`` (``torch.distributed.checkpoint``, in coda's keys:
    ``coda_keys``) loaded into another sharded patched model of other weights: the global
    loss that model then gives on the batch."""
    with ct.coda_keys(model):
        dcp.save(get_model_state_dict(model), checkpoint_id=path)
    torch.manual_seed(7)
    other = ct.apply_coda(model_class(cfg)(cfg))
    for layer in other.model.layers:
        fully_shard(layer)
    fully_shard(other)
    with ct.coda_keys(other):
        state = get_model_state_dict(other)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(other, state)
    with torch.no_grad():
        loss = other(input_ids=mine, labels=mine).loss.clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()


def main(out: str) -> None:  # (argv: --out PATH, as fsdp_step.py's)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = tiny_config()
    torch.manual_seed(0)
    ref = model_class(cfg)(cfg)  # fp32, the reference path
    model = ct.apply_coda(copy.deepcopy(ref))
    ids = torch.randint(
        0, cfg.vocab_size, (2 * world, 10), generator=torch.Generator().manual_seed(1)
    )
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    mine = ids.chunk(world)[rank]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # every rank's mean is over as many tokens: the global mean is theirs
    grads = ct.hf_gradients(model)  # (HF keys and layouts, still sharded)
    state = model.state_dict()
    grads, state = {k: _full(g) for k, g in grads.items()}, {k: _full(t) for k, t in state.items()}
    reloaded = _checkpoint_round_trip(model, cfg, mine, os.path.join(os.path.dirname(out), "ckpt"))
    if rank == 0:
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        result = {
            "world": world,
            "layer_class": type(model.model.layers[0]).__name__,
            "loss_rel_diff": abs(float(loss / world - ref_loss)) / float(ref_loss),
            "worst_grad_rel_diff": _worst(grads, {n: p.grad for n, p in ref.named_parameters()}),
            "worst_state_rel_diff": _worst(state, ref.state_dict()),
            "reloaded_loss_rel_diff": abs(float(reloaded - ref_loss)) / float(ref_loss),
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[sys.argv.index("--out") + 1])
