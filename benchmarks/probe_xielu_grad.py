"""Probe: xIELU's learned scalars' gradients in CODA's protocol model (a 2-layer bf16 Apertus,
``tests/test_transformers_gpu.protocol_run``), seed by seed: the float64 model's d(alpha),
the unpatched bf16 model's and coda's, and coda's fp32 sum before its rounding to the
parameter's bf16 (``coda.autograd.mlp_grads``' d_act, recorded), to tell a rounding tie from
a bias. Run 314 (an H100) failed the pooled protocol on layer 0's alpha_n (1.781 against a
band of 1.141) where the CPU model read 0.822 at worst; run 315's probe (after the GPU's expm1
fix, 16 seeds) read coda's fp32 sum equal to its inputs' float64 one to 1e-6, and both paths
~11 % off float64's, alike (benchmarks/NOTES.md, session 77). ``--sdpa math`` runs both bf16
models' attention on SDPA's math backend instead of flash (the float64 model's is math on
any device): whether the error both paths share comes from flash attention's backward
(run 318: most of it). ``--sdpa f64`` computes both bf16 models' attention in float64,
forward and backward (q, k, v and a float mask cast up, the output cast back to bf16): what
is left without attention's roundings. The summary prints the per-seed relative RMS (runs
315-318's figure, which a seed whose reference nears 0 dominates) and the stacked form
(``conftest.seed_errors``: session 79).

    python benchmarks/probe_xielu_grad.py [--seeds N] [--device cuda] [--sdpa default|math|f64]
"""

from __future__ import annotations

import argparse
import os
import sys

_ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]  # (coda, benchmarks, the tests' helpers)


def main():
    import torch
    from test_transformers_gpu import protocol_run

    import coda.autograd as ca

    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=24)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sdpa", choices=("default", "math", "f64"), default="default")
    args = p.parse_args()
    if args.device == "cpu":  # (the CPU model of the same run: the kernel path, interpreted)
        from benchmarks.cpu_numerics import _kernel_path_on_cpu

        _kernel_path_on_cpu()
    recorded = []
    real = ca.mlp_grads

    def recording(*a, **k):
        out = real(*a, **k)
        if out[-1] is not None:  # (and B4's d(a_n) formed by torch in float64 from its inputs)
            _, r1, u, _, _, w_d, d_down = a[:7]
            act = a[10] if len(a) > 10 else k["act"]
            z = r1.double()[:, None] * u.double()
            ds = d_down.double() @ w_d.double().t()
            eps = act[3].double()
            neg = torch.expm1(torch.minimum(z, eps)) - z
            d_an = (ds * torch.where(z > 0, torch.zeros_like(z), neg)).sum()
            recorded.append((out[-1].detach().double().cpu(), float(d_an)))
        return out

    ca.mlp_grads = recording
    sq = {"coda": 0.0, "torch": 0.0, "coda_abs": 0.0, "torch_abs": 0.0}
    for seed in range(args.seeds):
        recorded.clear()
        with sdpa_backend(args.sdpa):
            _, (g64, g16, gc), _ = protocol_run("apertus", args.device, seed, 0.0)
        # the backward runs the last layer first: recorded[-1] is layer 0's (a_p, a_n, 0, 0)
        d_an32, d_an_torch = float(recorded[-1][0][1]), recorded[-1][1]
        for layer in (0, 1):
            n = f"model.layers.{layer}.mlp.act_fn.alpha_n"
            t, h, c = (float(g[n].double().sum()) for g in (g64, g16, gc))
            line = f"seed {seed} layer {layer} alpha_n: f64 {t:+.6e} bf16 {h:+.6e} coda {c:+.6e}"
            if layer == 0:
                line += (
                    f"  coda d(a_n) fp32 {d_an32:+.6e} (its inputs in float64: {d_an_torch:+.6e})"
                )
                sq["coda"] += ((c - t) / t) ** 2
                sq["torch"] += ((h - t) / t) ** 2
                sq["coda_abs"] += (c - t) ** 2
                sq["torch_abs"] += (h - t) ** 2
            print(line, flush=True)
    s = args.seeds
    print(
        f"layer 0 alpha_n rms rel err (sdpa {args.sdpa}): coda {(sq['coda'] / s) ** 0.5:.3e} "
        f"torch {(sq['torch'] / s) ** 0.5:.3e}; stacked over the seeds (conftest.seed_errors): "
        f"coda / torch {(sq['coda_abs'] / sq['torch_abs']) ** 0.5:.3f}"
    )


def sdpa_backend(name: str):
    """SDPA restricted to its math backend (``"math"``), computed in float64 (``"f64"``: every
    caller reaches it as ``torch.nn.functional.scaled_dot_product_attention``, HF's attention
    and coda's alike), or left to choose (``"default"``)."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "math":
        return sdpa_kernel(SDPBackend.MATH)
    if name != "f64":
        return contextlib.nullcontext()
    real = torch.nn.functional.scaled_dot_product_attention

    def in_float64(q, k, v, attn_mask=None, *args, **kwargs):
        up = [t.double() for t in (q, k, v)]
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.double()
        return real(*up, attn_mask, *args, **kwargs).to(q.dtype)

    @contextlib.contextmanager
    def swapped():
        torch.nn.functional.scaled_dot_product_attention = in_float64
        try:
            yield
        finally:
            torch.nn.functional.scaled_dot_product_attention = real

    return swapped()


if __name__ == "__main__":
    main()
