"""coda's main job, as a user runs it: the GEMM-Residual-RMSNorm-GEMM boundary of a Llama
layer, with RMSNorm's row scale deferred into the next GEMM (KERNELS.md section 2).

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
from coda.reference.rmsnorm import gemm_residual_rms_ref, gemm_residual_rms_torch, rmsnorm_ref


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
        out = coda.gemm_residual_rms(o, w_o, x0, gamma)
    path, reason = coda.last_path("gemm_residual_rms")
    print(f"\nran: coda.gemm_residual_rms  M={M} K={d} N={d}  path={path} ({reason})")
    for w in caught:
        print(f"  reported: {w.category.__name__}: {w.message}")

    # equivalence: deferred scale after GEMM2 == canonical RMSNorm before GEMM2
    h32, _, _ = gemm_residual_rms_ref(o, w_o, x0)
    z_ref = rmsnorm_ref(h32, gamma.float(), 1e-5) @ w2.float()
    z_coda = out.rstd[:, None] * (out.normed @ w2).float()
    h_t, a_t, r_t = gemm_residual_rms_torch(o, w_o, x0, gamma)
    z_torch = (rmsnorm_ref(h_t.float(), gamma.float(), 1e-5).to(bf) @ w2).float()
    e_c, e_t = fro(z_coda, z_ref), fro(z_torch, z_ref)
    print("\nequivalence vs fp32 reference (relative Frobenius error of GEMM2's output z):")
    print(f"  coda  r * ((h*gamma) @ W2) : {e_c:.3e}")
    print(f"  torch RMSNorm(h) @ W2, bf16: {e_t:.3e}")
    print(
        f"  ratio coda / torch         : {e_c / e_t:.3f}  ({'PASS' if e_c <= e_t else 'FAIL'}:"
        f" goal <= 1.0)"
    )
    for name, got, ref in (
        ("h", out.h, h32),
        ("rstd", out.rstd, gemm_residual_rms_ref(o, w_o, x0)[2]),
    ):
        print(f"  {name:5s} error {fro(got, ref):.3e}")

    t_coda = timeit(lambda: coda.gemm_residual_rms(o, w_o, x0, gamma), device)
    t_torch = timeit(lambda: gemm_residual_rms_torch(o, w_o, x0, gamma), device)
    t_mm = timeit(lambda: o @ w_o, device)
    print(
        f"\ntiming ({device.type}, median ms):  coda {t_coda:.4f} | torch eager {t_torch:.4f} | "
        f"matmul alone {t_mm:.4f}"
    )
    print(f"  coda / matmul alone = {t_coda / t_mm:.3f};  torch / coda = {t_torch / t_coda:.2f}x")
    if device.type == "cpu":
        print("  (CPU timings are of the reference path; the kernels run on SM90 GPUs)")


if __name__ == "__main__":
    main()
