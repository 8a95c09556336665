"""CPU models of the GPU's numerics, the evidence behind benchmarks/NOTES.md's CPU-only claims.

The kernel path runs on the CPU through the tile interpreter (``coda.kernels._launch``); in
bf16 it rounds every stored tile once, as the kernels do, so CODA's error protocol (error
against float64, divided by the plain PyTorch bf16 path's) can be estimated before device time
is spent. Not a substitute for the H200 runs: attention is math SDPA here, GEMMs accumulate in
fp32 on the CPU's own order.

    python benchmarks/cpu_numerics.py lm-head [--g G] [--confident]  # LMHeadLoss vs PyTorch
    python benchmarks/cpu_numerics.py qk-short     # DecoderLayer q/k/v weight gradients,
                                                   #   the GPU fuzz's short-sequence cases
    python benchmarks/cpu_numerics.py hf [--families F ...] [--seeds N]  # patched HF models,
                                                   #   loss + grads (default Llama, Qwen3)
    python benchmarks/cpu_numerics.py hf-pooled [--families F ...] [--seeds N]  # the same,
                                                   #   each gradient pooled over the seeds
    python benchmarks/cpu_numerics.py vlm [--kinds K ...] [--seeds N]  # patched VLMs with an
                                                   #   image (default Qwen2.5-VL, Qwen3-VL)
    python benchmarks/cpu_numerics.py xielu-layer-head [--seeds N]  # xIELU's two scalar
                                                   #   gradients in a layer + head step, pooled
    python benchmarks/cpu_numerics.py dw-neff      # effective samples of an LM head's dW
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

BF = torch.bfloat16


def _kernel_path_on_cpu():
    """Route the modules' 'auto' backend to the kernel path (the interpreter on CPU): every
    module asks ``coda.env.kernel_support`` (rebinding a module's imported ``resolve_backend``
    name, as this did until session 65, stopped reaching them when they imported it directly,
    and ``hf`` then read the reference path; ``hf`` now checks which path ran)."""
    import coda.env

    coda.env.kernel_support = lambda device, dtype=None: (True, "")


def lm_head(seeds=3, g=1.0, confident=False):
    """``confident``: logits 8x larger and 3 in 4 targets at the row's argmax (p_y near 1, a
    trained model's regime) instead of random logits (p near uniform, early training)."""
    from conftest import fro_err
    from test_fuzz import canonical_head

    import coda.nn as cnn

    M, d, V = 1024, 256, 2048
    for method in ("recompute", "chunked", "scaled_exp"):
        for seed in range(seeds):
            torch.manual_seed(seed)
            head = cnn.LMHeadLoss(d, V, method=method, dtype=BF)
            with torch.no_grad():
                head.final_norm.add_(0.1 * torch.randn_like(head.final_norm))
                head.weight.normal_(std=(16 if confident else 2) * d**-0.5)
            x = torch.randn(M, d, dtype=BF, requires_grad=True)
            t = torch.randint(0, V, (M,))
            if confident:
                top = (x.detach().float() @ head.w_lm.float()).argmax(1)
                t = torch.where(torch.rand(M) < 0.75, top, t)
            t[::7] = -100
            loss = head._kernel_loss(x, t, "mean")
            loss.backward(torch.tensor(g))
            got = (loss.detach(), x.grad, head.final_norm.grad, head.weight.grad)
            g64 = torch.tensor(g, dtype=torch.float64)
            ref = canonical_head(copy.deepcopy(head).double(), x.detach().double(), t, "mean", g64)
            peer = canonical_head(head, x.detach(), t, "mean", torch.tensor(g))
            ratios = [fro_err(a, b) / max(fro_err(c, b), 1e-30) for a, b, c in zip(got, ref, peer)]
            print(
                f"lm-head {method:10s} seed {seed}: "
                + " ".join(f"{n} {r:.3f}" for n, r in zip(("loss", "dx", "dgamma", "dW"), ratios))
            )


def qk_short(limit=25):
    from conftest import fro_err
    from test_fuzz import canonical_layer, hf_layer_grads, layer_case, randn

    shown = 0
    for case in range(200):
        rng, g = random.Random(10_000 + case), torch.Generator().manual_seed(case)
        layer, x = layer_case(rng, g, BF, "cpu", big=True)
        B, S, d = x.shape
        if S > 17 or S < 2:
            continue
        dy = randn(g, *x.shape, dtype=BF, device="cpu")
        x.requires_grad_(True)
        layer._kernel_forward(x).backward(dy)
        got = hf_layer_grads(layer)
        _, _, g64 = canonical_layer(copy.deepcopy(layer).double(), x.detach().double(), dy.double())
        _, _, g16 = canonical_layer(layer, x.detach(), dy)
        keys = [f"self_attn.{p}_proj.weight" for p in "qkv"]
        ratios = {k[10]: fro_err(got[k], g64[k]) / fro_err(g16[k], g64[k]) for k in keys}
        print(
            f"qk-short case {case} x {tuple(x.shape)} heads {layer.n_heads}/{layer.n_kv_heads}: "
            + " ".join(f"{k} {r:.3f}" for k, r in ratios.items())
        )
        shown += 1
        if shown >= limit:
            break


def hf(seeds=4, families=("llama", "qwen3")):
    """``test_gpu_patched_model_protocol``'s step on the CPU: each seed's worst gradient ratio
    (coda's error over the bf16 model's, against float64) and its tie band, and how many
    gradients are over their bands (what the GPU test fails on)."""
    from conftest import fro_err, tie_band
    from test_transformers_gpu import protocol_run

    import coda

    _kernel_path_on_cpu()
    for family in families:
        for seed in range(seeds):
            (l64, l16, lc), (g64, g16, gc), floor = protocol_run(family, "cpu", seed)
            assert coda.last_path("LMHeadLoss")[0] == "kernel", coda.last_path("LMHeadLoss")
            ratios = {
                n: (fro_err(gc[n], g) / fro_err(g16[n], g), tie_band(g)) for n, g in g64.items()
            }
            name, (worst, band) = max(ratios.items(), key=lambda kv: kv[1][0])
            over = sum(r > 1 + b for r, b in ratios.values())
            print(
                f"hf {family} seed {seed}: loss err coda {fro_err(lc, l64):.3g} "
                f"torch {fro_err(l16, l64):.3g} (scalar floor {floor:.3g}); "
                f"worst gradient ratio {worst:.3f} (band 1 + {band:.3f}: {name}), over its "
                f"band {over}"
            )


def hf_pooled(seeds=16, families=("glm4",)):
    """``test_gpu_patched_biased_protocol_pooled``'s and ``test_gpu_patched_moe_protocol_pooled``'s
    check on the CPU (k biases of standard deviation 1): each gradient's error and the loss's
    pooled over ``seeds`` seeds (``conftest.pooled_ratio``, Bonferroni over them); the largest
    pooled ratios, how many are over their bands, and the loss's."""
    from conftest import family_z, pooled_ratio
    from test_transformers_gpu import seed_pooled_errors

    _kernel_path_on_cpu()
    for family in families:
        errors = seed_pooled_errors(family, "cpu", seeds)
        z = family_z(len(errors))
        pooled = sorted(((*pooled_ratio(e, z), n) for n, e in errors.items()), reverse=True)
        over = [n for r, b, n in pooled if r > 1 + b]
        top = "; ".join(f"{n} {r:.3f} (band 1 + {b:.3f})" for r, b, n in pooled[:4])
        loss = next(f"{r:.3f} (band 1 + {b:.3f})" for r, b, n in pooled if n == "loss")
        print(
            f"hf {family} pooled over {seeds} seeds: largest {top}; over its band {len(over)};"
            f" the loss {loss}"
        )


def vlm(seeds=2, kinds=("qwen2_5_vl", "qwen3_vl")):
    """``test_gpu_vlm_protocol``'s step on the CPU: the kernel path's bf16 roundings through
    the interpreter (the multimodal-RoPE epilogues included)."""
    from test_transformers_vlm import text_side, vlm_protocol

    import coda

    _kernel_path_on_cpu()
    for kind in kinds:
        for seed in range(seeds):
            (e_c, e_t), floor, ratios = vlm_protocol(kind, "cpu", seed)
            assert coda.last_path("LMHeadLoss")[0] == "kernel", coda.last_path("LMHeadLoss")
            text = text_side(ratios)
            name, (worst, band) = max(text.items(), key=lambda kv: kv[1][0] - kv[1][1])
            over_text = sum(r > 1 + b for r, b in text.values())
            over_all = sum(r > 1 + b for r, b in ratios.values())
            print(
                f"vlm {kind} seed {seed}: loss err coda {e_c:.3g} torch {e_t:.3g} (scalar "
                f"floor {floor:.3g}); text side: worst gradient ratio {worst:.3f} (band 1 + "
                f"{band:.3f}: {name}), over its band {over_text}; vision side over its band "
                f"{over_all - over_text}"
            )


def vlm_pooled(seeds=16, kinds=("gemma3",)):
    """``test_gpu_vlm_protocol_pooled``'s check on the CPU: each text-side gradient's error
    pooled over ``seeds`` seeds (``conftest.pooled_ratio``, Bonferroni over the gradients);
    the largest pooled ratios and how many are over their bands."""
    from conftest import family_z, pooled_ratio
    from test_transformers_vlm import text_side, vlm_errors

    _kernel_path_on_cpu()
    for kind in kinds:
        errors: dict = {}
        for seed in range(seeds):
            for n, e in text_side(vlm_errors(kind, "cpu", seed)[2]).items():
                errors.setdefault(n, []).append(e)
        z = family_z(len(errors))
        pooled = sorted(((*pooled_ratio(e, z), n) for n, e in errors.items()), reverse=True)
        over = [n for r, b, n in pooled if r > 1 + b]
        top = "; ".join(f"{n} {r:.3f} (band 1 + {b:.3f})" for r, b, n in pooled[:4])
        print(f"vlm {kind} pooled over {seeds} seeds: largest {top}; over its band {len(over)}")


def xielu_layer_head(seeds=64):
    """``test_gpu_xielu_layer_and_head_every_gradient``'s pooled check on the CPU, at a smaller
    shape (1 x 256 tokens, d=256, f=704, V=4096): xIELU's two scalar gradients pooled over
    ``seeds`` seeds as the stacked gradient's error (``conftest.seed_errors``, Bonferroni over
    the two), coda's kernel path against the fp32 reference, beside the bf16 reference path."""
    from conftest import family_z, pooled_ratio, seed_errors
    from test_backward_kernels import layer_and_head_step

    _kernel_path_on_cpu()
    scalars = ("mlp.act_fn.alpha_p", "mlp.act_fn.alpha_n")
    errors: dict = {}
    for seed in range(seeds):
        _, grads = layer_and_head_step(
            1, 256, 256, 4, 2, 704, 4096, "auto", seed, device="cpu", activation="xielu"
        )
        for n in scalars:
            got, ref, peer = grads[n]
            errors.setdefault(n, []).append(seed_errors(got, ref, peer))
    for n, e in errors.items():
        r, b = pooled_ratio(e, family_z(len(scalars)))
        print(f"xielu layer + head {n} pooled over {seeds} seeds: {r:.3f} (band 1 + {b:.3f})")


def dw_neff():
    torch.manual_seed(0)
    M, d, V = 3917, 1880, 8192
    x = torch.randn(M, d)
    w = torch.randn(V, d) / d**0.5
    p = torch.softmax(x @ w.t(), -1)
    t = torch.randint(0, V, (M,))
    p[torch.arange(M), t] -= 1
    r2 = (p.t() @ x).double().pow(2)
    n_eff = float(r2.sum() ** 2 / r2.pow(2).sum())
    print(f"dw-neff: LM head dW {V} x {d}: n_eff {n_eff:.4g} of {V * d} entries")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    choices = ("lm-head", "qk-short", "hf", "hf-pooled", "vlm", "vlm-pooled", "dw-neff")
    choices += ("xielu-layer-head",)
    ap.add_argument("what", choices=choices)
    ap.add_argument("--g", type=float, default=1.0, help="lm-head: the upstream gradient")
    ap.add_argument("--confident", action="store_true", help="lm-head: p_y near 1")
    ap.add_argument("--seeds", type=int, default=4, help="hf, vlm: seeds per family")
    ap.add_argument(
        "--kinds", nargs="+", default=["qwen2_5_vl", "qwen3_vl"], help="vlm: hf_vlm kinds"
    )
    ap.add_argument(
        "--families", nargs="+", default=["llama", "qwen3"], help="hf: tiny_config families"
    )
    args = ap.parse_args()
    if args.what == "lm-head":
        lm_head(g=args.g, confident=args.confident)
    elif args.what == "hf":
        hf(args.seeds, args.families)
    elif args.what == "hf-pooled":
        hf_pooled(args.seeds, args.families)
    elif args.what == "vlm":
        vlm(args.seeds, args.kinds)
    elif args.what == "vlm-pooled":
        vlm_pooled(args.seeds, args.kinds)
    elif args.what == "xielu-layer-head":
        xielu_layer_head(args.seeds)
    else:
        {"qk-short": qk_short, "hf": hf, "dw-neff": dw_neff}[args.what]()
