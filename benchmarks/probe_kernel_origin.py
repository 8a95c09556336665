"""Probe: which code launches a kernel of the patched HF step.

A kernel table names kernels, not their callers: run 112's table of coda's Llama-1B step held
21 bf16 fill kernels (0.50 ms) whose origin no table could say (benchmarks/NOTES.md, session
25). This profiles one training step with the CPU side and Python frames recorded (the patched
Llama-3.2-1B HF model, and coda's own d=1024 demo model with its AdamW step, where small
kernels weigh most), and for every kernel whose name matches ``CODA_ORIGIN_KERNELS`` (a regular
expression; default: fills and zeroing) reports the chain of operators and Python frames
that launched it (innermost first, torch's own Python frames left out), with its launches,
microseconds per step and input shapes, largest first.

A ``gpu_suite.py`` suite run only when named (``--only kernel_origin``); ``CODA_ORIGIN_STEPS``
picks among ``STEPS``.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

from benchmarks._common import Diagnostic, progress, selected

SUITE = "kernel_origin"
DEFAULT_PATTERN = r"fill|zero"  # CODA_ORIGIN_KERNELS
DEPTH = 10  # callers kept per chain


def caller_chain(event, depth: int = DEPTH) -> tuple:
    """Names of ``event``'s enclosing operators and Python frames, innermost first, without
    torch's own Python frames (whose file paths name the machine's install)."""
    chain, up = [], event.cpu_parent
    while up is not None and len(chain) < depth:
        name = up.name
        if "torch/" not in name or "(" not in name:  # keep ops and non-torch frames
            chain.append(re.sub(r"^.*?site-packages/", "", name))
        up = up.cpu_parent
    return tuple(chain)


def origins(events, pattern: str, steps: int = 1) -> list[dict]:
    """Per (kernel, launching op, input shapes, callers): launches and device microseconds per
    step of the kernels matching ``pattern`` (any case), from profiler ``events``
    (``FunctionEvent`` with their ``kernels``), largest first. Keyed by kernel too: a node that
    launches Triton kernels directly (an autograd Function's backward) launches several."""
    match = re.compile(pattern, re.IGNORECASE)
    table: dict = defaultdict(lambda: {"launches": 0, "us": 0.0})
    for e in events:
        for k in getattr(e, "kernels", ()):
            if match.search(k.name):
                row = table[(k.name[:80], e.name, str(e.input_shapes)[:120], caller_chain(e))]
                row["launches"] += 1
                row["us"] += k.duration
    rows = [
        {
            "kernel": kernel_name,
            "op": op,
            "shapes": shapes,
            "callers": list(chain),
            "launches": r["launches"] / steps,
            "us": r["us"] / steps,
        }
        for (kernel_name, op, shapes, chain), r in table.items()
    ]
    rows.sort(key=lambda r: -r["us"])
    return rows


def hf_step():
    import coda.transformers as ct
    from benchmarks.bench_hf import training_step

    return training_step("llama-3.2-1B", ct.apply_coda)


def model_step():
    """coda's d=1024 demo model (``bench_step``'s "demo-d1024"), forward, backward and a
    fused AdamW step, as the model suite times it."""
    import torch

    from benchmarks.bench_step import MODEL_SHAPES, build_model

    c = MODEL_SHAPES["demo-d1024"]
    model = build_model(c)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tok, tgt = (
        torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device="cuda") for _ in range(2)
    )

    def step():
        model(tok, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


STEPS = {"hf-llama-3.2-1B": hf_step, "model-demo-d1024": model_step}  # CODA_ORIGIN_STEPS


def run() -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    pattern = os.environ.get("CODA_ORIGIN_KERNELS", DEFAULT_PATTERN)
    rows = []
    for name in selected("CODA_ORIGIN_STEPS", STEPS) or STEPS:
        step = STEPS[name]()
        for _ in range(3):  # compile, warm the allocator
            step()
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, record_shapes=True, with_stack=True) as prof:
            step()
            torch.cuda.synchronize()
        found = origins(prof.events(), pattern)
        kernel_us = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA")
        rows.append(
            progress(
                {
                    "name": f"{SUITE}/{name}",
                    "pattern": pattern,
                    "step_kernel_us": kernel_us,
                    "launches": sum(r["launches"] for r in found),
                    "us": sum(r["us"] for r in found),
                    "origins": found[:40],
                }
            )
        )
        step = prof = None
        torch.cuda.empty_cache()
    return rows


class Suite(Diagnostic):
    """``SUITE`` as a ``gpu_suite.py`` entry."""

    def run(self) -> list[dict]:
        return run()
