"""Probe: Qwen3's QK-norm row pass (``row_passes._dqk_norm_kernel``) inside the training step.

Run 93's kernel table of the patched HF Qwen3-0.6B step (4 x 4096 tokens) put the pass at
306 us per call (28 calls, 8.6 ms of a 171.6 ms step), where run 23's sweep had timed it
alone at 214 us on synthetic inputs. This takes the step's own arguments (the first layer's
call, recorded as the backward makes it), times the pass alone on them at every launch shape
of ``LAUNCH_SHAPES``, and times the whole step with each shape installed: the kernel's
microseconds per call from the step's profile, and the step's milliseconds. A suite of
``gpu_suite.py`` run only when named (``--only qk_norm_pass``); ``CODA_QK_PASS_SHAPES``
("8x1,16x2") times only those launch shapes.
"""

from __future__ import annotations

import torch

from benchmarks._common import bench, bench_long, kernel_table, out_of_time, progress, selected
from benchmarks.bench_hf import BATCH, SEQ, SHAPES, _step, build


def _recording(rpk, seen: list):
    """``dqk_norm_rope_heads_triton`` that keeps its first call's arguments in ``seen``."""
    inner = rpk.dqk_norm_rope_heads_triton

    def record(*args, **kw):
        if not seen:
            seen.append((args, kw))
        return inner(*args, **kw)

    return inner, record


def run() -> list[dict]:
    import coda.transformers as ct
    from coda.kernels import row_passes as rpk

    family, shape = SHAPES["qwen3-0.6B"]
    model = ct.apply_coda(build(family, shape, "cuda", torch.bfloat16))
    ids = torch.randint(0, shape["vocab_size"], (BATCH, SEQ), device="cuda")
    step = _step(model, ids)
    seen: list = []
    inner, rpk.dqk_norm_rope_heads_triton = _recording(rpk, seen)
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def sdpa_recording(q, k, v, *a, **kw):  # what attention is handed in the step
        if not calls:
            calls.append({f"{n}_in_stride": list(t.stride()) for n, t in zip("qkv", (q, k, v))})
            calls[0]["sdpa_kwargs"] = sorted(kw)
        return sdpa(q, k, v, *a, **kw)

    torch.nn.functional.scaled_dot_product_attention = sdpa_recording
    try:
        step()
    finally:
        rpk.dqk_norm_rope_heads_triton = inner
        torch.nn.functional.scaled_dot_product_attention = sdpa
    args, kw = seen[0]
    strides = {f"{n}_stride": list(t.stride()) for n, t in zip(("dq", "dk", "dv"), args[:3])}
    key = ("dqk_norm", args[14])  # (kernel, head_dim)
    tuned = rpk.TUNED.get(key)
    chosen = selected("CODA_QK_PASS_SHAPES", [f"{r}x{w}" for r, w in rpk.LAUNCH_SHAPES])
    rows = []
    try:
        for launch in rpk.LAUNCH_SHAPES:
            if chosen and f"{launch[0]}x{launch[1]}" not in chosen:
                continue
            if out_of_time():
                break
            rpk.TUNED[key] = launch
            alone = bench(lambda launch=launch: inner(*args, **kw, shape=launch))
            per_kernel = {k["kernel"]: k for k in kernel_table(step, steps=2, top=100_000)}
            k = per_kernel.get("_dqk_norm_kernel", {"us": float("nan"), "calls": 1})
            rows.append(
                progress(
                    {
                        "name": "qk_norm_pass/qwen3-0.6B",
                        "rows_per_program": launch[0],
                        "warps": launch[1],
                        "tuned": launch == tuned,
                        "alone_ms": alone["ms"],
                        "in_step_kernel_us": k["us"] / k["calls"],
                        "step_ms": bench_long(step)["ms"],
                        **strides,
                        **(calls[0] if calls else {"sdpa": "not called"}),
                    }
                )
            )
    finally:
        if tuned is None:
            rpk.TUNED.pop(key, None)
        else:
            rpk.TUNED[key] = tuned
    return rows
