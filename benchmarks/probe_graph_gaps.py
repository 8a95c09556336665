"""Probe: where a graphed d=1024 model step spends the time its forward+backward kernels do not.

Run 71: coda's step through ``coda.nn.GraphedStep`` took 6.83 ms for 5.87 ms of kernels, and
torch.compile's with its own CUDA graphs 7.14 ms for 6.53; run 133: 6.66 against 7.34 ms, each
~1 ms over its forward+backward kernels. This probe profiles back-to-back calls of each (the
demo's d=1024 model, 8 x 1024 tokens, step + AdamW) and splits every call's span (first
kernel's start to last kernel's end) into kernel time and idle stretches between kernels: how
many kernels, how many gaps of which size, which kernel pairs the largest gaps sit between,
and the kernel time by kernel name (so the optimizer's and the gradients' zeroing kernels
show beside the step's own); then, over a chain of calls, the idle inside a call apart from
the idle between calls, and the host's cost of one call. Each step is also timed back to back
without the profiler, with the GPU's clock and power. Three steps: coda's through
``GraphedStep``, torch.compile's with its own graphs on the plain model, and on coda's.

A ``gpu_suite.py`` suite run only when named (``--only graph_gaps``).
"""

from __future__ import annotations

import collections
import copy
import time

import torch

from benchmarks._common import (
    Diagnostic,
    GpuClock,
    _gaps,
    _profiled_kernels,
    host_ms,
    progress,
)
from benchmarks.bench_step import MODEL_SHAPES, build_model, graphed_train_step

SUITE = "graph_gaps"
CFG = MODEL_SHAPES["demo-d1024"]  # the demo's model, 8 x 1024 tokens
CALLS = 5
BUCKETS = (1.0, 2.0, 3.0, 5.0, 10.0, 50.0, float("inf"))  # us, upper bounds
TOP = 30  # kernel names kept, largest first
OPTIMIZER = ("adam", "multi_tensor")  # name fragments of the optimizer's kernels


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
    by_name, launches = collections.Counter(), collections.Counter()
    for e in ev:
        by_name[e.name[:90]] += e.device_time
        launches[e.name[:90]] += 1
    optimizer_us = sum(us for n, us in by_name.items() if any(f in n.lower() for f in OPTIMIZER))
    return {
        "kernels_per_call": len(ev) / calls,
        "kernel_us_per_call": kernel_us,
        "optimizer_kernel_us_per_call": optimizer_us / calls,
        "span_us_per_call": span_us,
        "idle_us_per_call": span_us - kernel_us,
        "gaps_by_size_us": {
            f"<={ub}": {"count": counts[ub] / calls, "us": sums[ub] / calls} for ub in BUCKETS
        },
        "largest_pairs_us_per_call": [
            {"before": a, "after": b, "us": us / calls} for (a, b), us in pairs.most_common(15)
        ],
        "kernels_by_name_us_per_call": [
            {"kernel": n, "launches": launches[n] / calls, "us": us / calls}
            for n, us in by_name.most_common(TOP)
        ],
    }


def chain(fn, calls: int = 20) -> dict:
    """``calls`` back-to-back calls profiled (after a warm-up): per call, the GPU span, its
    kernel time, the idle inside a call and the idle between calls (a call's kernels are the
    events from one multiple of the kernels per call to the next), and the host's cost of one
    call started on an idle GPU (``_common.host_ms``: if it is above the GPU's time between
    calls, the host is what the GPU waits for)."""
    fn()
    ev = _profiled_kernels(fn, calls)
    per_call, rest = divmod(len(ev), calls)
    if rest:
        return {"kernels": len(ev), "error": f"{len(ev)} kernels in {calls} calls: no period"}
    inside = between = 0.0
    busy_end = ev[0].time_range.end
    for i in range(1, len(ev)):
        busy_end = max(busy_end, ev[i - 1].time_range.end)
        gap = max(0.0, ev[i].time_range.start - busy_end)
        if i % per_call == 0:
            between += gap
        else:
            inside += gap
    return {
        "kernels_per_call": per_call,
        "span_us_per_call": (ev[-1].time_range.end - ev[0].time_range.start) / calls,
        "kernel_us_per_call": sum(e.device_time for e in ev) / calls,
        "idle_inside_us_per_call": inside / calls,
        "idle_between_us_per_call": between / (calls - 1),
        "host_us_one_call_idle_gpu": host_ms(fn, reps=9) * 1e3,
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


def timed(fn) -> dict:
    """``back_to_back`` with the GPU's clock and power sampled while it runs."""
    back_to_back(fn, calls=10)  # settle before the sampled window
    with GpuClock() as clock:
        t = back_to_back(fn, calls=200)
    return {**t, **clock.medians()}


def run() -> list[dict]:
    from coda.reference.model import TorchLlama

    c = CFG
    model = build_model(c)
    tok = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    tgt = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device="cuda")
    step = graphed_train_step(model, tok, tgt)  # warmed up and captured
    coda_row = {"name": f"{SUITE}/coda_graphed", "config": c, **split(step)}
    replay = step.func._graph.replay
    coda_row["timed"] = {
        "GraphedStep call": timed(step),
        "its graph's replay alone": timed(replay),
        "GraphedStep call again": timed(step),
    }
    coda_row["chain"] = {"GraphedStep call": chain(step), "its graph's replay alone": chain(replay)}
    rows = [progress(coda_row)]
    model.zero_grad(set_to_none=True)
    # torch.compile's own CUDA graphs (cudagraph trees, AdamW eager) on the plain model, and on
    # coda's (its custom ops captured inside Inductor's graphs): run 144 timed the latter
    # 3 % under ``GraphedStep``'s step
    # (coda's last: its capture failed at 4096+ tokens in runs 145-147, and a failed capture
    # leaves the process unable to capture again; the rows before it are kept)
    for label, module in (
        ("torch_compile_graphed", TorchLlama.of(model)),
        ("coda_compile_graphed", copy.deepcopy(model)),
    ):
        try:
            compiled_step = _compiled_graphed_step(module, tok, tgt)
            row = {"name": f"{SUITE}/{label}", "config": c, **split(compiled_step)}
            row["timed"] = {"step": timed(compiled_step)}
            row["chain"] = {"step": chain(compiled_step)}
        except Exception as e:
            row = {"name": f"{SUITE}/{label}", "error": repr(e)[:300]}
        rows.append(progress(row))
    return rows


def _compiled_graphed_step(module, tok, tgt):
    """One training step of ``torch.compile(module, mode="reduce-overhead")`` with fused
    AdamW, warmed up (compiled and its graphs recorded)."""
    compiled = torch.compile(module, mode="reduce-overhead")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4, fused=True)

    def step():
        compiled(tok, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    return step


class Suite(Diagnostic):
    """``SUITE`` as a ``gpu_suite.py`` entry."""

    def run(self) -> list[dict]:
        return run()
