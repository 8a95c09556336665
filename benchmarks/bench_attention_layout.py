"""Does the layout of q, k, v change SDPA's speed? (a diagnostic for issue 10's HF steps)

In the patched HF models the same cuDNN flash kernels run longer than under Liger's patch
(run 93: Llama-3.2-1B backward 33.6 vs 31.2 ms per step, forward 12.2 vs 11.7; Qwen3-0.6B
backward 44.9 vs 36.7, forward 15.0 vs 13.4). coda hands attention q, k, v as strided views
of the QKV GEMM's one (B, S, H + 2 Hkv, hd) output; HF's projections give each its own
(B, S, heads, hd) buffer. This times SDPA (causal, GQA as HF calls it, bf16) forward alone
and forward+backward on both layouts and on contiguous (B, heads, S, hd) tensors, at both
models' attention shapes, with the copy that would give each layout from the packed one,
and records the strides of the gradients SDPA returns for each and its three largest kernels.

Timed alone, the packed views cost 0.09-0.11 ms per layer (run 102), under half of what the
patched steps' attention loses to Liger's. ``IN_STEP`` (a ``gpu_suite.py`` suite run only
when named, ``--only attention_in_step``) asks the question inside the step: the patched HF
model's training step with SDPA handed each layout (a copy in the step where the layout is
not the packed one), the attention kernels' microseconds per call from the step's profile,
the step's kernel time and its GPU clock and power.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._common import (
    Diagnostic,
    bench,
    bench_long,
    clocked,
    kernel_table,
    out_of_time,
    progress,
)

SHAPES = {  # batch, seq, heads, kv heads, head_dim
    "llama-3.2-1B": (4, 4096, 32, 8, 64),
    "qwen3-0.6B": (4, 4096, 16, 8, 128),
}


IN_STEP = "attention_in_step"
# layout -> what SDPA is handed in its place, from the step's (B, heads, S, hd) views
RELAYOUT = {
    "packed_views (coda)": lambda t: t,
    "own_buffers (HF)": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
    "contiguous_bhsd": lambda t: t.contiguous(),
}


def layouts(B, S, H, Hkv, hd):
    """name -> a function giving (q, k, v) (B, heads, S, hd) in that layout: views of one
    packed random buffer (coda's), or copies of them (timing a function is timing its copy)."""
    bf = torch.bfloat16
    packed = torch.randn(B, S, H + 2 * Hkv, hd, device="cuda", dtype=bf)

    def views():  # coda: views of one packed buffer
        t = packed.transpose(1, 2)
        return t[:, :H], t[:, H : H + Hkv], t[:, H + Hkv :]

    def own_buffers():  # HF: each projection its own (B, S, heads, hd) buffer
        return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in views())

    def contiguous():
        return tuple(t.contiguous() for t in views())

    return {
        "packed_views (coda)": views,
        "own_buffers (HF)": own_buffers,
        "contiguous_bhsd": contiguous,
    }


def run() -> list[dict]:
    rows = []
    for shape_name, (B, S, H, Hkv, hd) in SHAPES.items():
        do = torch.randn(B, S, H, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        dims = {"shape": shape_name, "B": B, "S": S, "heads": H, "kv_heads": Hkv, "head_dim": hd}
        for name, make in layouts(B, S, H, Hkv, hd).items():
            q, k, v = (t.detach().requires_grad_(True) for t in make())

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def step(q=q, k=k, v=v):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                out.backward(do)

            step()
            grads = {f"d{n}_stride": list(t.grad.stride()) for n, t in zip("qkv", (q, k, v))}
            rows.append({"name": f"attention_layout/{name}/forward", **dims, **bench(fwd)})
            kernels = [k["kernel"][:60] for k in kernel_table(step, steps=2, top=3)]
            rows.append(
                {
                    "name": f"attention_layout/{name}/fwd_bwd",
                    **dims,
                    **grads,
                    "top_kernels": kernels,
                    **bench(step),
                }
            )
            rows.append(
                {
                    "name": f"attention_layout/{name}/copy_from_packed",
                    **dims,
                    **bench(lambda make=make: make()),
                }
            )
    return rows


def _in_step(shape_name: str) -> list[dict]:
    """One row per layout of ``RELAYOUT``: the patched HF model's step at ``shape_name`` with
    attention's inputs in that layout."""
    import coda.transformers as ct
    from benchmarks import bench_hf

    step = bench_hf.training_step(shape_name, ct.apply_coda)
    sdpa = F.scaled_dot_product_attention
    rows = []
    try:
        for name, relayout in RELAYOUT.items():
            if out_of_time():
                break

            def handed(q, k, v, *a, relayout=relayout, **kw):
                return sdpa(relayout(q), relayout(k), relayout(v), *a, **kw)

            F.scaled_dot_product_attention = handed  # HF's sdpa attention calls it by name
            kernels = kernel_table(step, steps=2, top=100_000)
            timed = clocked(bench_long)(step)

            def per_call(part, kernels=kernels):
                ks = [k for k in kernels if part in k["kernel"]]
                return sum(k["us"] for k in ks) / max(sum(k["calls"] for k in ks), 1)

            rows.append(
                progress(
                    {
                        "name": f"{IN_STEP}/{shape_name}/{name}",
                        "attention_bprop_us_per_call": per_call("flash_bprop"),
                        "attention_fprop_us_per_call": per_call("flash_fprop"),
                        "attention_ms": sum(k["us"] for k in kernels if "cudnn" in k["kernel"])
                        / 1e3,
                        "copy_ms": sum(k["us"] for k in kernels if "copy" in k["kernel"]) / 1e3,
                        "kernel_ms": sum(k["us"] for k in kernels) / 1e3,
                        "step_ms": timed["ms"],
                        **{k: timed[k] for k in ("sm_mhz", "power_w") if k in timed},
                    }
                )
            )
    finally:
        F.scaled_dot_product_attention = sdpa
    return rows


class InStep(Diagnostic):
    """``IN_STEP`` as a ``gpu_suite.py`` entry: both HF shapes."""

    def run(self) -> list[dict]:
        return [row for shape_name in SHAPES for row in _in_step(shape_name)]
