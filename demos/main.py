"""coda's main job, as a user runs it: the GEMM-Residual-RMSNorm-GEMM block of a Llama layer
(O projection + residual + RMSNorm + gate/up projection), with RMSNorm's statistics taken in
the first GEMM's epilogue and its row scale deferred into the second's (KERNELS.md section 2).

    python demos/main.py            # CPU: the reference path; H200: the SM90 kernel

Prints which path ran and why, the equivalence check (coda's reparameterized boundary against
canonical RMSNorm + GEMM, and against the plain PyTorch bf16 path's error), and the timing.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import coda
from coda.env import describe
from coda.reference.rmsnorm import gemm_rmsnorm_gemm_ref, gemm_rmsnorm_gemm_torch


def fro(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def timeit(fn, device):
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="M (default 16384 GPU, 512 CPU)")
    ap.add_argument("--d", type=int, default=None, help="hidden size (default 2048 GPU, 256 CPU)")
    args = ap.parse_args()
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
        warnings.simplefilter("always")
        out = coda.gemm_rmsnorm_gemm(o, w_o, x0, gamma, w2)
    path, reason = coda.last_path("gemm_rmsnorm_gemm")
    print(f"\nran: coda.gemm_rmsnorm_gemm  M={M} d={d} N2={f2}  path={path} ({reason})")
    for w in caught:
        print(f"  reported: {w.category.__name__}: {w.message}")

    # equivalence: the row scale deferred past GEMM2 == canonical RMSNorm before GEMM2
    ref = gemm_rmsnorm_gemm_ref(o, w_o, x0, gamma, w2)
    peer = gemm_rmsnorm_gemm_torch(o, w_o, x0, gamma, w2)
    print(
        "\nequivalence vs the fp32 reference (relative Frobenius error), coda vs plain torch bf16:"
    )
    ok = True
    for name, got, want, torch_bf16 in zip(("h", "z", "rstd"), out, ref, peer):
        e_c, e_t = fro(got, want), fro(torch_bf16, want)
        ok &= e_c <= e_t
        print(f"  {name:5s} coda {e_c:.3e}   torch {e_t:.3e}   ratio {e_c / e_t:.3f}")
    print(f"  {'PASS' if ok else 'FAIL'}: every ratio <= 1.0 (CODA's protocol)")

    t_coda = timeit(lambda: coda.gemm_rmsnorm_gemm(o, w_o, x0, gamma, w2), device)
    t_torch = timeit(lambda: gemm_rmsnorm_gemm_torch(o, w_o, x0, gamma, w2), device)
    t_mm = timeit(lambda: (o @ w_o, x0 @ w2), device)
    print(
        f"\ntiming ({device.type}, median ms):  coda {t_coda:.4f} | torch eager {t_torch:.4f} | "
        f"the two matmuls alone {t_mm:.4f}"
    )
    print(f"  coda / matmuls alone = {t_coda / t_mm:.3f};  torch / coda = {t_torch / t_coda:.2f}x")
    if device.type == "cpu":
        print("  (CPU timings are of the reference path; the kernels run on SM90 GPUs)")


if __name__ == "__main__":
    main()
