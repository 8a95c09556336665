"""coda's main job, as a user runs it: the GEMM-Residual-RMSNorm-GEMM block of a Llama layer
(O projection + residual + RMSNorm + gate/up projection), with RMSNorm's statistics taken in
the first GEMM's epilogue and its row scale deferred into the second's (KERNELS.md section 2).

    python demos/main.py            # CPU: the reference path; H100/H200: the SM90 kernel

On an SM90 GPU it runs the kernels, checks them with CODA's error protocol (error against an
fp32 reference no larger than the plain PyTorch bf16 path's) and times them against torch.
On a CPU there is no kernel to run: it runs the public op's reference path, and checks the
kernel's own epilogue programs through coda's tile interpreter (the CPU lowering of the same
program text) with the same protocol. CPU timings would time the reference, so none are shown.
"""

from __future__ import annotations

import argparse
import warnings

import torch

import coda
from coda.env import describe
from coda.kernels.gemm_rmsnorm_gemm import gemm_rmsnorm_gemm_interpreted
from coda.reference.rmsnorm import gemm_rmsnorm_gemm_ref, gemm_rmsnorm_gemm_torch


def fro(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def positive_multiple_of_8(text: str) -> int:
    n = int(text)
    if n < 8 or n % 8:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 8, got {n}")
    return n


def positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Run coda's GEMM-Residual-RMSNorm-GEMM block and check it (CODA's protocol)."
    )
    ap.add_argument(
        "--tokens", type=positive, default=None, help="M, tokens (default 16384 GPU, 512 CPU)"
    )
    ap.add_argument(
        "--d",
        type=positive_multiple_of_8,
        default=None,
        help="hidden size, a multiple of 8 (the TMA's 16-byte rows); default 2048 GPU, 256 CPU",
    )
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    M = args.tokens or (16384 if device.type == "cuda" else 512)
    d = args.d or (2048 if device.type == "cuda" else 256)
    f2 = 2 * (((8 * d // 3) + 255) // 256 * 256)  # GEMM2 = the interleaved gate/up projection

    info = describe()
    print(
        f"coda {coda.__version__} | torch {info['torch']} | quack {info['quack']} | "
        f"cutlass-dsl {info['cutlass_dsl']} | {info.get('gpu', 'no GPU')}"
    )
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16
    o = torch.randn(M, d, device=device, dtype=bf, generator=g)  # attention output
    w_o = torch.randn(d, d, device=device, dtype=bf, generator=g) / d**0.5
    x0 = torch.randn(M, d, device=device, dtype=bf, generator=g)  # residual stream
    gamma = 1 + 0.1 * torch.randn(d, device=device, dtype=bf, generator=g)
    w2 = torch.randn(d, f2, device=device, dtype=bf, generator=g) / d**0.5

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", coda.CodaReferencePathWarning)
        out = coda.gemm_rmsnorm_gemm(o, w_o, x0, gamma, w2)
    path, reason = coda.last_path("gemm_rmsnorm_gemm")
    print(f"\nran: coda.gemm_rmsnorm_gemm  M={M} d={d} N2={f2}  path={path} ({reason})")
    for w in caught:
        if issubclass(w.category, coda.CodaReferencePathWarning):
            print(f"  coda says: {w.message}")

    if path == "kernel":
        checked, what = out, "the SM90 kernels"
    else:
        checked = gemm_rmsnorm_gemm_interpreted(o, w_o, x0, gamma, w2)
        what = "the kernels' epilogue programs through coda's tile interpreter (no GPU here)"
    ref = gemm_rmsnorm_gemm_ref(o, w_o, x0, gamma, w2)
    peer = gemm_rmsnorm_gemm_torch(o, w_o, x0, gamma, w2)
    print(f"\nchecked: {what}")
    print("error vs the fp32 reference (relative Frobenius), coda vs plain torch bf16:")
    ok = True
    for name, got, want, torch_bf16 in zip(("h", "z", "rstd"), checked, ref, peer):
        e_c, e_t = fro(got, want), fro(torch_bf16, want)
        ok &= e_c <= e_t
        print(f"  {name:5s} coda {e_c:.3e}   torch {e_t:.3e}   ratio {e_c / e_t:.3f}")
    print(f"  {'PASS' if ok else 'FAIL'}: every ratio <= 1.0 (CODA's protocol)")

    if device.type != "cuda":
        print("\ntiming: skipped (on a CPU it would time the pure-torch reference, not coda)")
        return 0 if ok else 1
    import triton.testing

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")

    t_coda = bench(lambda: coda.gemm_rmsnorm_gemm(o, w_o, x0, gamma, w2))
    t_torch = bench(lambda: gemm_rmsnorm_gemm_torch(o, w_o, x0, gamma, w2))
    t_mm = bench(lambda: (o @ w_o, x0 @ w2))
    print(
        f"\ntiming (median ms):  coda {t_coda:.4f} | torch eager {t_torch:.4f} | "
        f"the two matmuls alone {t_mm:.4f}"
    )
    print(f"  coda / matmuls alone = {t_coda / t_mm:.3f};  torch / coda = {t_torch / t_coda:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
