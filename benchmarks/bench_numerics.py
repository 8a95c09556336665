"""CODA's numerics protocol on Llama-3-8B-like shapes (d=4096, 32/8 heads of 128, f=14336,
V=128256, M=4096 tokens): for each op's output, err(coda bf16) / err(plain PyTorch bf16), both
against an fp32 reference (TF32 off) from the same bf16 inputs; relative Frobenius error,
three seeds. Goal: ratio <= 1.0."""

from __future__ import annotations

import torch

import coda
from coda.reference import cross_entropy as ce_ref
from coda.reference import rmsnorm as rn_ref
from coda.reference import rope as rope_ref
from coda.reference import swiglu as sw_ref

M, D, H, HKV, HD, F, V = 4096, 4096, 32, 8, 128, 14336, 128256


def fro(got, ref):
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm())


def run(seeds=(0, 1, 2)) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for seed in seeds:
        g = torch.Generator(device="cuda").manual_seed(seed)

        def rnd(*shape, scale=1.0):
            return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale

        x, res = rnd(M, D), rnd(M, D)
        w1, w2 = rnd(D, D, scale=D**-0.5), rnd(D, 2 * F, scale=D**-0.5)
        gamma = 1 + 0.1 * rnd(D)
        r = 0.5 + torch.rand(M, device="cuda", generator=g)
        out = coda.gemm_rmsnorm_gemm(x, w1, res, gamma, w2, backend="kernel")
        ref = rn_ref.gemm_rmsnorm_gemm_ref(x, w1, res, gamma, w2)
        peer = rn_ref.gemm_rmsnorm_gemm_torch(x, w1, res, gamma, w2)
        cases = [
            (f"gemm_rmsnorm_gemm.{n}", a, b, c)
            for n, a, b, c in zip(("h", "z", "rstd"), out, ref, peer)
        ]
        s = coda.gemm_swiglu(x, w2, r, backend="kernel").s
        cases.append(
            (
                "gemm_swiglu.s",
                s,
                sw_ref.gemm_swiglu_ref(x, w2, r)[0],
                sw_ref.gemm_swiglu_torch(x, w2, r),
            )
        )
        w_qkv = rnd(D, (H + 2 * HKV) * HD, scale=D**-0.5)
        pos = torch.arange(M, device="cuda") % 4096
        qkv = coda.gemm_rope(
            x, w_qkv, pos, head_dim=HD, n_heads=H, n_kv_heads=HKV, rstd=r, backend="kernel"
        )
        cs = rope_ref.rope_table(pos.cpu(), HD).cuda()
        cases.append(
            (
                "gemm_rope.qkv",
                qkv,
                rope_ref.gemm_rope_ref(x, w_qkv, r, cs, H, HKV, HD),
                rope_ref.gemm_rope_torch(x, w_qkv, r, pos.cpu(), H, HKV, HD),
            )
        )
        w_lm = rnd(D, V, scale=4 * D**-0.5)
        t = torch.randint(0, V, (M,), device="cuda", generator=g)
        args = (x, w_lm, t)
        loss = coda.linear_cross_entropy(*args, rstd=r, reduction="none", backend="kernel")
        cases.append(
            (
                "linear_cross_entropy.loss_per_row",
                loss,
                ce_ref.linear_cross_entropy_ref(x, w_lm, r, t, reduction="none"),
                ce_ref.linear_cross_entropy_torch(x, w_lm, r, t, reduction="none"),
            )
        )
        for name, got, want, torch_bf16 in cases:
            e_c, e_t = fro(got, want), fro(torch_bf16, want)
            rows.append(
                {
                    "name": f"numerics/{name}",
                    "seed": seed,
                    "M": M,
                    "d": D,
                    "err_coda": e_c,
                    "err_torch_bf16": e_t,
                    "ratio": e_c / e_t,
                }
            )
        del w_lm, out, ref, peer
        torch.cuda.empty_cache()
    return rows
