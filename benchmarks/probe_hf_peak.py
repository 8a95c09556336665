"""Probe: an HF model's peak memory step by step, in bf16 and in fp32 under bf16 autocast.

Run 268 read torch.compile's HF Qwen3-0.6B-shaped step at 20.67 GiB in fp32 under autocast,
where run 261 read 50.19 GiB for the same variant in bf16 (and coda's patch 21.05 against
18.83): ``bench_hf.step_peak`` takes one peak over four steps, the first of them compiling,
so it cannot say which step, or which mode, holds the difference. This runs the unpatched
model eagerly and with ``model.model`` under ``torch.compile`` (``bench_hf.variants``'
recipe), each in both modes, one variant resident at a time, and records each of the
four steps' own peak (the allocator's peak reset before each step) beside what stays
allocated after it, and the last step's loss. ``gpu_suite.py`` runs it only when named
(``--only hf_peak``); ``CODA_HF_SHAPES`` picks the shapes (default: Qwen3's).
"""

from __future__ import annotations

import torch

from benchmarks._common import Diagnostic, bf16_autocast, own_bytes, progress, selected
from benchmarks.bench_hf import _step
from benchmarks.hf_models import SHAPES, batch_of, build

SUITE = "hf_peak"
STEPS = 4
GIB = 2**30


def peaks(shape_name: str, compiled: bool, amp: bool) -> dict:
    """One variant's per-step peaks (GiB, from the step's own start) and what stays after."""
    family, shape = SHAPES[shape_name]
    model = build(family, shape, "cuda", torch.float32 if amp else torch.bfloat16)
    if compiled:  # ``bench_hf.variants``' recipe: the base model compiled, the head eager
        model.model = torch.compile(model.model)
    ids = torch.randint(0, shape["vocab_size"], batch_of(shape_name), device="cuda")
    step = _step(model, ids, amp)
    resident, per_step, after = [], [], []
    for _ in range(STEPS):
        torch.cuda.synchronize()
        resident.append(torch.cuda.memory_allocated() / GIB)
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        per_step.append(torch.cuda.max_memory_allocated() / GIB)
        after.append(torch.cuda.memory_allocated() / GIB)
    with torch.no_grad(), bf16_autocast("cuda", enabled=amp):
        loss = model(input_ids=ids, labels=ids).loss.item()
    row = {
        "name": f"{SUITE}/{shape_name}{'+amp' if amp else ''}/"
        + ("hf_torch_compile" if compiled else "hf"),
        "weights_gib": own_bytes(model) / GIB,
        "allocated_before_step_gib": resident,
        "peak_gib_per_step": per_step,
        "allocated_after_step_gib": after,
        "loss": loss,
    }
    del model, step
    torch.cuda.empty_cache()
    return row


def run() -> list[dict]:
    shapes = selected("CODA_HF_SHAPES", SHAPES) or ["qwen3-0.6B"]
    rows = []
    for shape_name in shapes:
        for amp in (False, True):
            for compiled in (False, True):
                try:
                    rows.append(progress(peaks(shape_name, compiled, amp)))
                except Exception as e:  # recorded, never hidden
                    rows.append({"name": f"{SUITE}/{shape_name}", "error": repr(e)[:300]})
                torch._dynamo.reset()
    return rows


class Suite(Diagnostic):
    def run(self) -> list[dict]:
        return run()
