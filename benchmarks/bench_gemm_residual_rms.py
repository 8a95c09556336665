"""Benchmark: coda.gemm_residual_rms (GEMM + residual + sum-of-squares partials [+ h*gamma])
against quack's raw GEMM (same mainloop and tile config, empty epilogue: the ceiling), cuBLAS
``mm`` alone, and torch eager / torch.compile doing mm + add + sum of squares.

    python -m benchmarks.bench_gemm_residual_rms        # prints rows (needs an SM90 GPU)
"""

from __future__ import annotations

import torch

import coda
from benchmarks._common import bench, row
from coda import _quack
from coda.kernels.config import DEFAULT
from coda.reference.rmsnorm import rstd_ref

SHAPES = [(16384, d, d) for d in (2048, 4096, 8192)]  # (M, K, N): Wo / Wd -> d


def torch_peer(x, w, res):
    h = res + x @ w
    return h, h.float().pow(2).sum(-1)


def torch_peer_gamma(x, w, res, gamma, eps: float = 1e-5):
    h = res + x @ w
    return h, h * gamma, rstd_ref(h.float(), eps)


def run(shapes=SHAPES) -> list[dict]:
    rows = []
    compiled_peer = torch.compile(torch_peer)
    compiled_peer_gamma = torch.compile(torch_peer_gamma)
    raw = _quack.identity_mod()
    for M, K, N in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5
        res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
        gamma = 1 + 0.1 * torch.randn(N, device="cuda", dtype=torch.bfloat16, generator=g)
        d_raw = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        shape = {"M": M, "K": K, "N": N}
        flops = 2.0 * M * N * K
        cfg = {
            "tile": [DEFAULT.tile_m, DEFAULT.tile_n],
            "cluster": [DEFAULT.cluster_m, 1],
            "pingpong": DEFAULT.pingpong,
        }

        def quack_raw():
            _quack.run_epi_gemm(raw, x, w, d_raw, None, {}, DEFAULT)

        def coda_no_gamma():
            return coda.gemm_residual_rms(x, w, res, backend="kernel")

        def coda_gamma():
            return coda.gemm_residual_rms(x, w, res, gamma, backend="kernel")

        from coda.kernels.gemm_residual_rms import epilogue_gemm

        def kernel_only():  # the epilogue GEMM alone: no AUX, no host checks
            return epilogue_gemm(x, w, res, None, DEFAULT)

        timings = {
            "quack_raw_gemm": bench(quack_raw),
            "cublas_mm": bench(lambda: x @ w),
            "coda_kernel": bench(kernel_only),
            "coda_op": bench(coda_no_gamma),
            "coda_op_gamma": bench(coda_gamma),
            "torch_eager": bench(lambda: torch_peer(x, w, res)),
            "torch_compile": bench(lambda: compiled_peer(x, w, res)),
            "torch_eager_gamma": bench(lambda: torch_peer_gamma(x, w, res, gamma)),
            "torch_compile_gamma": bench(lambda: compiled_peer_gamma(x, w, res, gamma)),
        }
        raw_ms = timings["quack_raw_gemm"]["ms"]
        for name, t in timings.items():
            rows.append(
                row(
                    f"gemm_residual_rms/{name}",
                    shape,
                    t,
                    flops,
                    config=cfg,
                    ratio_vs_quack_raw_tflops=raw_ms / t["ms"],
                    ratio_vs_cublas_time=t["ms"] / timings["cublas_mm"]["ms"],
                )
            )
    return rows


if __name__ == "__main__":
    for r in run():
        print(
            f"{r['name']:45s} M={r['M']} N={r['N']} K={r['K']} {r['ms']:.4f} ms "
            f"{r['tflops']:.0f} TF/s  x{r['ratio_vs_quack_raw_tflops']:.3f} of raw"
        )
