"""CODA's error protocol for a patched Qwen2 over several seeds and bias sizes: for each seed,
``tests/test_transformers_gpu.protocol_run`` (a 2-layer bf16 Qwen2, 4 x 256 tokens, a
padding mask), each gradient's error against the float64 model divided by the unpatched bf16
model's, summarized over the q and k projections' weights and biases (the gradients that pass
through attention's score gradient), and each weight gradient's tie band from its operands
(the layer fuzz's ``weight_grad_samples``, recorded on the float64 model). ``--k-bias`` sets
the k biases' standard deviation (the q and v biases' is 1; trained Qwen2 checkpoints carry k
biases of several units).

    python benchmarks/probe_qwen2_bias.py --k-bias 1 4 --seeds 6 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def ratios(seed: int, k_bias: float, device: str = "cuda") -> tuple[dict, dict, dict]:
    """({gradient: coda's error / PyTorch bf16's}, {gradient: the weight gradient's tie band
    from its operands, ``conftest.weight_grad_samples`` as the layer fuzz uses it, recorded on
    the float64 model}, {gradient: (coda's error, PyTorch's)}) of one protocol run."""
    import test_transformers_gpu as t
    from conftest import LinearOperands, band_of, fro_err

    t.K_BIAS_STD = k_bias
    operands = LinearOperands()
    t.OPERANDS = operands  # (``protocol_run`` records the float64 model's steps in it)
    try:
        _, (g64, g16, gc), _ = t.protocol_run("qwen2", device, seed)
    finally:
        t.OPERANDS = None
    errs = {n: (fro_err(gc[n], g), fro_err(g16[n], g)) for n, g in g64.items()}
    r = {n: c / t for n, (c, t) in errs.items()}
    bands = {}
    for n, g in g64.items():
        n_eff = operands.samples(g) if n.endswith("_proj.weight") else None
        if n_eff is not None:
            bands[n] = band_of(n_eff)
    return r, bands, errs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k-bias", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")  # (cpu: the reference path, a smoke run)
    args = ap.parse_args()
    rows, pooled = [], []
    for k_bias in args.k_bias:
        sq: dict = {}  # gradient -> [sum of coda's squared errors, of PyTorch's]
        for seed in range(args.seeds):
            r, bands, errs = ratios(seed, k_bias, args.device)
            for n, (c, t) in errs.items():
                acc = sq.setdefault(n, [0.0, 0.0])
                acc[0] += c * c
                acc[1] += t * t
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
        ratio = {n: (c / t) ** 0.5 for n, (c, t) in sq.items()}
        qk = {n: v for n, v in ratio.items() if "q_proj" in n or "k_proj" in n}
        pooled.append(
            dict(
                k_bias=k_bias,
                seeds=args.seeds,
                qk=dict(sorted((n, round(v, 4)) for n, v in qk.items())),
                rest_max=max(v for n, v in ratio.items() if n not in qk),
            )
        )
        print(json.dumps(pooled[-1]), flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    Path(args.out).write_text(
        json.dumps({"gpu": gpu, "command": sys.argv, "rows": rows, "pooled": pooled}, indent=1)
    )


if __name__ == "__main__":
    main()
