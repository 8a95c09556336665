"""Probe: a patched HF Llama-3.2-1B-shaped model's training step through ``coda.nn.GraphedStep``
beside the same step run eagerly, at 4 x 4096 tokens.

Run 74 found that under a CUDA-graph capture transformers 5.17 gives SDPA an explicit causal
mask where the eager step passes ``is_causal`` (benchmarks/NOTES.md, session 19); run 77 put
the captured step at 0.75x the eager one, and the patched layers now drop that mask where it is
the plain causal one. This times the captured step against the eager one at the 1B shape:
zero_grad, forward, backward and a fused AdamW step, eager and graphed, timed in interleaved
rounds (``_common.interleaved``), with each one's SDPA kernel names from a profiled call.

    python benchmarks/probe_hf_graphed_1b.py [--out DIR]   (CUDA; DIR/probe_hf_graphed_1b.json)
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch

import coda.nn as cnn
import coda.transformers as ct
from benchmarks._common import _profiled_kernels, bench_long, interleaved
from benchmarks.hf_models import BATCH, SEQ, SHAPES, build


def _adamw(model):
    lr = torch.tensor(1e-5, device="cuda")
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)


def _attention_kernels(fn) -> list[str]:
    names = {e.name[:90] for e in _profiled_kernels(fn, 1)}
    marks = ("sdpa", "fmha", "flash", "attn", "attention")
    return sorted(n for n in names if any(m in n.lower() for m in marks))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    family, shape = SHAPES["llama-3.2-1B"]
    with torch.device("cuda"):  # random init on the GPU: seconds, not a CPU minute
        eager = ct.apply_coda(build(family, shape, "cuda", torch.bfloat16))
    graphed = copy.deepcopy(eager)
    ids = torch.randint(0, shape["vocab_size"], (BATCH, SEQ), device="cuda")
    opt = _adamw(eager)

    def eager_step():
        opt.zero_grad(set_to_none=True)
        eager(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step = cnn.GraphedStep(graphed, _adamw(graphed))
    for _ in range(step.warmup + 1):  # the eager calls, then the capture's
        step(input_ids=ids, labels=ids)

    def graphed_step():
        step(input_ids=ids, labels=ids)

    timed = interleaved({"eager": eager_step, "GraphedStep": graphed_step}, timer=bench_long)
    rows = {
        name: {
            "ms": t["ms"],
            "rounds_ms": t["rounds_ms"],
            "tokens_per_s": BATCH * SEQ / (t["ms"] * 1e-3),
            "attention_kernels": _attention_kernels(fn),
        }
        for (name, t), fn in zip(timed.items(), (eager_step, graphed_step))
    }
    rows["graphed_over_eager_speed"] = rows["eager"]["ms"] / rows["GraphedStep"]["ms"]
    print(json.dumps(rows, indent=1))
    with open(os.path.join(args.out, "probe_hf_graphed_1b.json"), "w") as f:
        json.dump({"torch": torch.__version__, "tokens": BATCH * SEQ, **rows}, f, indent=1)


if __name__ == "__main__":
    main()
