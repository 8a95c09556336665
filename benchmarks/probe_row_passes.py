"""Probe: B11's row passes (``coda.kernels.row_passes``) inside an HF model's training step.

Run 93's kernel table of the patched HF Qwen3-0.6B step (4 x 4096 tokens) put the QK-norm
pass at 306 us per call (28 calls, 8.6 ms of a 171.6 ms step), where run 23's sweep had timed
it alone at 214 us on synthetic inputs. For one pass this takes the step's own arguments (the
first layer's call, recorded as the backward makes it) and what attention is handed, times
the pass alone on those arguments at every launch shape of ``LAUNCH_SHAPES``, and times the
whole step with each shape installed: the kernel's microseconds per call from the step's
profile, and the step's milliseconds. Suites of ``gpu_suite.py`` run only when named:
``qk_norm_pass`` (Qwen3-0.6B's QK-norm pass), ``drope_pass`` (Llama-3.2-1B's dRoPE pass, head_dim
64) and ``drope_pass_layer`` (the d=2048 layer benchmark's, head_dim 128);
``CODA_ROW_PASS_SHAPES`` ("8x1,16x2") times only those launch shapes.
"""

from __future__ import annotations

import inspect

import torch

from benchmarks._common import (
    Diagnostic,
    bench,
    bench_long,
    kernel_table,
    out_of_time,
    progress,
    restored,
    selected,
)
from benchmarks.bench_hf import training_step

# suite -> (the step: an HF shape of ``hf_models.SHAPES`` patched by ``apply_coda``, or
# "layer-d<d>", the layer benchmark's ``DecoderLayer`` fwd+bwd at width d; the pass's function
# in row_passes, its TUNED name, its kernel's name in a profile)
PASSES = {
    "qk_norm_pass": ("qwen3-0.6B", "dqk_norm_rope_heads_triton", "dqk_norm", "_dqk_norm_kernel"),
    "drope_pass": ("llama-3.2-1B", "drope_heads_triton", "drope", "_drope_kernel"),
    "drope_pass_layer": ("layer-d2048", "drope_heads_triton", "drope", "_drope_kernel"),
}
LAYER = "layer-d"


def layer_step(d: int):
    """The layer benchmark's step at width d (``bench_train.layer_rows``' "coda" variant):
    ``DecoderLayer(x).backward(dy)`` at head_dim 128, 4 x 4096 tokens, grads set to None."""
    import coda.nn as cnn
    from benchmarks.bench_forward import ffn, heads
    from benchmarks.bench_layer import S
    from benchmarks.bench_train import B, _step

    H, Hkv = heads(d)
    layer = cnn.DecoderLayer(d, H, Hkv, ffn(d), device="cuda", backend="kernel")
    x = torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return _step(lambda: layer(x), list(layer.parameters()), x, torch.randn_like(x))


def probe_step(shape_name: str):
    """The step a pass of ``PASSES`` is probed in."""
    if shape_name.startswith(LAYER):
        return layer_step(int(shape_name[len(LAYER) :]))
    import coda.transformers as ct

    return training_step(shape_name, ct.apply_coda)


class _Recorded:
    """Within ``with``: ``row_passes.<name>`` and SDPA keep their first call's arguments (the
    pass's as given; attention's input strides and keyword names)."""

    def __init__(self, rpk, name):
        self.rpk, self.name = rpk, name
        self.inner = getattr(rpk, name)
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.args, self.attention = None, {"sdpa": "not called"}

    def _pass(self, *args, **kw):
        if self.args is None:
            self.args = (args, kw)
        return self.inner(*args, **kw)

    def _sdpa(self, q, k, v, *a, **kw):
        if "sdpa" in self.attention:
            self.attention = {f"{n}_in_stride": list(t.stride()) for n, t in zip("qkv", (q, k, v))}
            self.attention["sdpa_kwargs"] = sorted(kw)
        return self.sdpa(q, k, v, *a, **kw)

    def __enter__(self):
        setattr(self.rpk, self.name, self._pass)
        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(self, *exc):
        setattr(self.rpk, self.name, self.inner)
        torch.nn.functional.scaled_dot_product_attention = self.sdpa


def run_pass(suite: str) -> list[dict]:
    """One row per launch shape: the pass alone on the step's arguments, its kernel inside the
    step, and the step, with that shape installed in ``TUNED`` (restored after)."""
    from coda.kernels import row_passes as rpk

    shape_name, fn_name, tuned_name, kernel_name = PASSES[suite]
    step = probe_step(shape_name)
    with _Recorded(rpk, fn_name) as rec:
        step()
    args, kw = rec.args
    inner = rec.inner
    strides = {f"{n}_stride": list(t.stride()) for n, t in zip(("dq", "dk", "dv"), args[:3])}
    head_dim = inspect.signature(inner).bind(*args, **kw).arguments["head_dim"]
    key = (tuned_name, head_dim)
    tuned = rpk.TUNED.get(key)
    named = {f"{r}x{w}": (r, w) for r, w in rpk.LAUNCH_SHAPES}  # CODA_ROW_PASS_SHAPES' names
    chosen = selected("CODA_ROW_PASS_SHAPES", named)
    rows = []
    with restored(rpk.TUNED, key):
        for launch in [named[n] for n in chosen] if chosen else rpk.LAUNCH_SHAPES:
            if out_of_time():
                break
            rpk.TUNED[key] = launch
            alone = bench(lambda launch=launch: inner(*args, **kw, shape=launch))
            per_kernel = {k["kernel"]: k for k in kernel_table(step, steps=2, top=100_000)}
            k = per_kernel.get(kernel_name, {"us": float("nan"), "calls": 1})
            rows.append(
                progress(
                    {
                        "name": f"{suite}/{shape_name}",
                        "rows_per_program": launch[0],
                        "warps": launch[1],
                        "tuned": launch == tuned,
                        "alone_ms": alone["ms"],
                        "in_step_kernel_us": k["us"] / k["calls"],
                        "step_ms": bench_long(step)["ms"],
                        **strides,
                        **rec.attention,
                    }
                )
            )
    return rows


class Suite(Diagnostic):
    """One pass of ``PASSES`` as a ``gpu_suite.py`` entry."""

    def __init__(self, suite: str):
        self.suite = suite

    def run(self) -> list[dict]:
        return run_pass(self.suite)
