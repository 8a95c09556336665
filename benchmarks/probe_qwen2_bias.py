"""CODA's error protocol for a patched Qwen2 over several seeds and bias sizes: for each seed,
``tests/test_transformers_gpu.protocol_run`` (a 2-layer bf16 Qwen2, 4 x 256 tokens, a
padding mask), each gradient's error against the float64 model divided by the unpatched bf16
model's, summarized over the q and k projections' weights and biases (the gradients that pass
through attention's score gradient). ``--k-bias`` sets the k biases' standard deviation (the
q and v biases' is 1; trained Qwen2 checkpoints carry k biases of several units).

    python benchmarks/probe_qwen2_bias.py --k-bias 1 4 --seeds 6 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def ratios(seed: int, k_bias: float) -> dict:
    import test_transformers_gpu as t
    from conftest import fro_err

    t.K_BIAS_STD = k_bias
    _, (g64, g16, gc), _ = t.protocol_run("qwen2", "cuda", seed)
    return {n: fro_err(gc[n], g) / fro_err(g16[n], g) for n, g in g64.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k-bias", type=float, nargs="+", default=[1.0, 4.0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    for k_bias in args.k_bias:
        for seed in range(args.seeds):
            r = ratios(seed, k_bias)
            qk = {n: v for n, v in r.items() if "q_proj" in n or "k_proj" in n}
            rest = {n: v for n, v in r.items() if n not in qk}
            rows.append(
                dict(
                    k_bias=k_bias,
                    seed=seed,
                    qk_mean=sum(qk.values()) / len(qk),
                    qk_max=max(qk.values()),
                    rest_max=max(rest.values()),
                    worst=max(r, key=r.get),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name()
    Path(args.out).write_text(json.dumps({"gpu": gpu, "command": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
