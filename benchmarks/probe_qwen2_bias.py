"""CODA's error protocol for a patched Qwen2 over several seeds and bias sizes: for each seed,
``tests/test_transformers_gpu.protocol_run`` (a 2-layer bf16 Qwen2, 4 x 256 tokens, a
padding mask), each gradient's error against the float64 model divided by the unpatched bf16
model's, summarized over the q and k projections' weights and biases (the gradients that pass
through attention's score gradient), and each weight gradient's tie band from its operands
(the layer fuzz's ``weight_grad_samples``, recorded on the float64 model). ``--k-bias`` sets
the k biases' standard deviation (the q and v biases' is 1; trained Qwen2 checkpoints carry k
biases of several units).

    python benchmarks/probe_qwen2_bias.py --k-bias 1 4 --seeds 16 --null --out probe.json

``--null`` also pools the same ratio for the unpatched model with its q, k, v projections in
fp32 (``null_errors``): how far a path no less accurate than PyTorch's reads from 1.
``--family llama`` reads the same for Llama (no biases); ``--method`` picks the patched
model's LM-head program (its upstream gradient reaches every q and k gradient); ``--sdpa``
runs every path's attention on PyTorch's math backend, or with contiguous q, k, v;
``--device cpu --kernel-path-on-cpu`` reads the same on the CPU model of the kernel path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def ratios(
    seed: int, k_bias: float, device: str = "cuda", family: str = "qwen2"
) -> tuple[dict, dict, dict]:
    """({gradient: coda's error / PyTorch bf16's}, {gradient: the weight gradient's tie band
    from its operands, ``conftest.weight_grad_samples`` as the layer fuzz uses it, recorded on
    the float64 model}, {gradient: (coda's error, PyTorch's)}) of one protocol run."""
    import test_transformers_gpu as t
    from conftest import LinearOperands, band_of, fro_err

    operands = LinearOperands()
    _, (g64, g16, gc), _ = t.protocol_run(family, device, seed, k_bias, operands)
    errs = {n: (fro_err(gc[n], g), fro_err(g16[n], g)) for n, g in g64.items()}
    r = {n: c / t for n, (c, t) in errs.items()}
    bands = {}
    for n, g in g64.items():
        n_eff = operands.samples(g) if n.endswith("_proj.weight") else None
        if n_eff is not None:
            bands[n] = band_of(n_eff)
    return r, bands, errs


def null_errors(seed: int, k_bias: float, device: str = "cuda") -> dict:
    """{gradient: (error of the unpatched bf16 model with its q, k, v projections computed in
    fp32 and rounded once, error of the unpatched bf16 model)}, both against float64, on the
    protocol's model and batch: a path no less accurate than PyTorch's by construction, whose
    ratio to it shows how far such ratios spread by chance on these gradients (the null)."""
    import copy

    import test_transformers_gpu as t
    from conftest import fro_err

    cfg, ref64, ref, _ = t._protocol_models("qwen2", device, seed, k_bias)
    alt = copy.deepcopy(ref)

    def fp32_projection(module, args, out):
        x = args[0]
        return torch.nn.functional.linear(x.float(), module.weight.float(), module.bias.float())

    for layer in alt.model.layers:
        for name in ("q_proj", "k_proj", "v_proj"):  # (rounded by the next op's bf16 input)
            proj = getattr(layer.self_attn, name)
            proj.register_forward_hook(lambda m, a, o: fp32_projection(m, a, o).to(o.dtype))
    batch = t.protocol_batch(cfg, device)
    for m in (ref64, ref, alt):
        t._step(m, **batch)
    g = {n: p.grad for n, p in ref64.named_parameters()}
    g16, ga = dict(ref.named_parameters()), dict(alt.named_parameters())
    return {n: (fro_err(ga[n].grad, x), fro_err(g16[n].grad, x)) for n, x in g.items()}


def pooled_ratios(errors: dict, k_bias: float, seeds: int, label: str) -> dict:
    """Each gradient's error pooled over the seeds (``conftest.pooled_ratio``: the ratio of
    the two RMS errors and its 2-sigma band from the seeds' own spread), the q and k
    projections' by name, the others' worst excess over its band."""
    from conftest import pooled_ratio

    pooled = {n: pooled_ratio(e) for n, e in errors.items()}
    qk = {n: v for n, v in pooled.items() if "q_proj" in n or "k_proj" in n}
    rest = {n: r - b for n, (r, b) in pooled.items() if n not in qk}
    return dict(
        path=label,
        k_bias=k_bias,
        seeds=seeds,
        qk=dict(sorted((n, round(r, 4)) for n, (r, _) in qk.items())),
        qk_band=dict(sorted((n, round(1 + b, 4)) for n, (_, b) in qk.items())),
        rest_max=max(pooled[n][0] for n in rest),
        rest_max_over_band=max(rest.values()) - 1.0,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k-bias", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")  # (cpu: the reference path, a smoke run)
    ap.add_argument(
        "--kernel-path-on-cpu",
        action="store_true",
        help="with --device cpu: the patched model on its kernel path (GEMMs through the "
        "tile interpreter, bf16 roundings as the GPU's; attention on PyTorch's math backend)",
    )
    ap.add_argument("--null", action="store_true", help="also the null path, pooled")
    ap.add_argument("--family", default="qwen2")  # (llama: the same reading without biases)
    ap.add_argument("--method", default="auto")  # the patched model's LM-head method
    ap.add_argument("--sdpa", default="auto", choices=["auto", "math", "contiguous"])
    args = ap.parse_args()
    import functools

    import coda.transformers as ct

    ct.apply_coda = functools.partial(ct.apply_coda, method=args.method)
    if args.kernel_path_on_cpu:
        import coda.env

        coda.env.kernel_support = lambda device, dtype=None: (True, "")
    # every path's attention (coda's layers call the model's own SDPA function): on PyTorch's
    # math backend, or with q, k, v made contiguous first (the layouts differ by path)
    if args.sdpa == "math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel(SDPBackend.MATH).__enter__()
    elif args.sdpa == "contiguous":
        sdpa = torch.nn.functional.scaled_dot_product_attention

        def contiguous_sdpa(q, k, v, *a, **kw):
            return sdpa(q.contiguous(), k.contiguous(), v.contiguous(), *a, **kw)

        torch.nn.functional.scaled_dot_product_attention = contiguous_sdpa
    rows, pooled = [], []
    for k_bias in args.k_bias:
        errors: dict = {}  # gradient -> [(coda's error, PyTorch's) of each seed]
        for seed in range(args.seeds):
            r, bands, errs = ratios(seed, k_bias, args.device, args.family)
            for n, e in errs.items():
                errors.setdefault(n, []).append(e)
            qk = {n: v for n, v in r.items() if "q_proj" in n or "k_proj" in n}
            rest = {n: v for n, v in r.items() if n not in qk}
            over = {n: (round(v, 3), round(1 + bands[n], 3)) for n, v in r.items()
                    if n in bands and v > 1 + bands[n]}  # fmt: skip
            rows.append(
                dict(
                    k_bias=k_bias,
                    seed=seed,
                    qk_mean=sum(qk.values()) / len(qk),
                    qk_max=max(qk.values()),
                    rest_max=max(rest.values()),
                    worst=max(r, key=r.get),
                    qk_weight_bands={
                        n: (round(r[n], 3), round(1 + b, 3)) for n, b in bands.items() if n in qk
                    },  # fmt: skip
                    weights_over_operand_band=over,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
        # each gradient's error pooled over the seeds (an RMS, as the loss's protocol pools
        # batches): the ratio of two RMS errors, whose spread shrinks with the seeds
        pooled.append(
            pooled_ratios(
                errors, k_bias, args.seeds, f"coda {args.family} {args.method} sdpa {args.sdpa}"
            )
        )
        print(json.dumps(pooled[-1]), flush=True)
        if args.null:
            errors = {}
            for seed in range(args.seeds):
                for n, e in null_errors(seed, k_bias, args.device).items():
                    errors.setdefault(n, []).append(e)
            pooled.append(pooled_ratios(errors, k_bias, args.seeds, "null: fp32 projections"))
            print(json.dumps(pooled[-1]), flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    Path(args.out).write_text(
        json.dumps({"gpu": gpu, "command": sys.argv, "rows": rows, "pooled": pooled}, indent=1)
    )


if __name__ == "__main__":
    main()
