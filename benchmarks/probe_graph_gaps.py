"""Probe: where a graphed d=1024 model step spends the time its kernels do not.

Run 71: coda's step through ``coda.nn.GraphedStep`` took 6.83 ms for 5.87 ms of kernels, and
torch.compile's with its own CUDA graphs 7.14 ms for 6.53. This probe profiles back-to-back
calls of each (the demo's d=1024 model, 8 x 1024 tokens, step + AdamW) and splits every
call's span (first kernel's start to last kernel's end) into kernel time and idle stretches
between kernels: how many kernels, how many gaps of which size, and which kernel pairs the
largest gaps sit between.

    python benchmarks/probe_graph_gaps.py [--out DIR]   (CUDA; writes DIR/probe_graph_gaps.json)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch

import coda.nn as cnn
from benchmarks._common import _gaps, _profiled_kernels
from benchmarks.bench_step import graphed_train_step
from coda.reference.model import TorchLlama

CFG = dict(vocab=8192, d=1024, layers=4, heads=8, kv_heads=4, hd=128, ffn=2816, batch=8, seq=1024)
CALLS = 5
BUCKETS = (1.0, 2.0, 3.0, 5.0, 10.0, 50.0, float("inf"))  # us, upper bounds


def split(fn, calls: int = CALLS) -> dict:
    ev = _profiled_kernels(fn, calls)
    kernel_us = sum(e.device_time for e in ev) / calls
    span_us = (ev[-1].time_range.end - ev[0].time_range.start) / calls
    counts, sums, pairs = collections.Counter(), collections.Counter(), collections.Counter()
    for gap, before, after in _gaps(ev):
        bucket = next(ub for ub in BUCKETS if gap <= ub)
        counts[bucket] += 1
        sums[bucket] += gap
        pairs[(before, after)] += gap
    return {
        "kernels_per_call": len(ev) / calls,
        "kernel_us_per_call": kernel_us,
        "span_us_per_call": span_us,
        "idle_us_per_call": span_us - kernel_us,
        "gaps_by_size_us": {
            f"<={ub}": {"count": counts[ub] / calls, "us": sums[ub] / calls} for ub in BUCKETS
        },
        "largest_pairs_us_per_call": [
            {"before": a, "after": b, "us": us / calls} for (a, b), us in pairs.most_common(15)
        ],
    }


def back_to_back(fn, calls: int = 50) -> dict:
    """ms per call of ``calls`` back-to-back calls (CUDA events around all of them), and the
    host's ms per call to enqueue them (if it is below the GPU's, the host is not the bound)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.record()
    torch.cuda.synchronize()
    return {"gpu_ms_per_call": start.elapsed_time(end) / calls, "host_ms_per_call": host}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    c = CFG
    torch.manual_seed(0)
    model = cnn.CausalLM(
        *(c[k] for k in ("vocab", "d", "layers", "heads", "kv_heads", "ffn")),
        head_dim=c["hd"],
        device="cuda",
    )
    tok = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    tgt = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    rows = {"config": c}
    step = graphed_train_step(model, tok, tgt)  # warmed up and captured
    rows["coda_graphed"] = split(step)
    rows["coda_graphed"]["timed"] = {
        "GraphedStep call": back_to_back(step),
        "its graph's replay alone": back_to_back(step.func._graph.replay),
        "GraphedStep call again": back_to_back(step),
    }
    print("coda_graphed", json.dumps(rows["coda_graphed"]["timed"]))
    model.zero_grad(set_to_none=True)
    peer = torch.compile(TorchLlama.of(model), mode="reduce-overhead")
    opt = torch.optim.AdamW(peer.parameters(), lr=1e-4, fused=True)

    def compiled_step():
        peer(tok, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        compiled_step()
    rows["torch_compile_graphed"] = split(compiled_step)
    rows["torch_compile_graphed"]["timed"] = {"step": back_to_back(compiled_step)}
    print("torch_compile_graphed", json.dumps(rows["torch_compile_graphed"]["timed"]))
    with open(os.path.join(args.out, "probe_graph_gaps.json"), "w") as f:
        json.dump({"torch": torch.__version__, **rows}, f, indent=1)


if __name__ == "__main__":
    main()
