"""Benchmark the forward kernels and blocks at M=16384, d in {2048, 4096, 8192}.

Kernel rows: each coda epilogue GEMM against quack's raw GEMM of the same shape and tile
config (empty epilogue: the ceiling) and cuBLAS ``mm``. Block rows: each coda op against
torch eager, torch.compile and Liger composing the same math (cuBLAS GEMM + their kernels),
each op called as a user calls it (its tile chosen by shape, ``coda.kernels.tuned``).
"""

from __future__ import annotations

import torch

from benchmarks._common import bench, row
from coda import _quack
from coda.kernels import gemm_rmsnorm_gemm as rg
from coda.kernels import gemm_rope as rp
from coda.kernels import gemm_swiglu as sw
from coda.kernels import linear_cross_entropy as lce
from coda.kernels.tuned import config_for
from coda.reference.rope import apply_rope_hf, hf_cos_sin

M = 16384
HIDDEN = (2048, 4096, 8192)
VOCABS = (32768, 128256)


def ffn(d: int) -> int:
    return ((8 * d // 3) + 255) // 256 * 256


def heads(d: int) -> tuple[int, int]:
    """(query heads, kv heads) at head_dim 128: 16/8 at d=2048, 32/8 above."""
    return (16, 8) if d == 2048 else (d // 128, 8)


def _rand(*shape, scale=1.0, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype) * scale


def kernel_rows() -> list[dict]:
    """Each epilogue GEMM vs the raw mainloop of the same shape and config."""
    rows = []
    raw = _quack.identity_mod()
    for d in HIDDEN:
        f = ffn(d)
        H, Hkv = heads(d)
        a = _rand(M, d)
        r = torch.rand(M, device="cuda") + 0.5
        pos = (torch.arange(M, device="cuda") % 4096).float()
        cases = {  # name: (N, its tuned-table kernel, the kernel call)
            "scale_rows": (d, "scale_rows", lambda w, c: rg.gemm_scale_rows_kernel(a, w, r, c)),
            "swiglu_keep_preact": (
                2 * f,
                "swiglu",
                lambda w, c: sw.gemm_swiglu_kernel(a, w, r, True, c),
            ),
            "swiglu_only": (2 * f, "swiglu", lambda w, c: sw.gemm_swiglu_kernel(a, w, r, False, c)),
            "rope": (
                (H + 2 * Hkv) * 128,
                "rope",
                lambda w, c: rp.gemm_rope_kernel(
                    a, w, r, pos, rp.rope_freq_table(128, H + Hkv, Hkv, device="cuda"), c
                ),
            ),
        }
        for V in VOCABS:
            tgt = torch.randint(0, V, (M,), device="cuda")
            cases[f"lm_head_ce_V{V}"] = (
                V,
                "lm_head",
                lambda w, c, tgt=tgt: lce.lm_head_stats_kernel(a, w, r, tgt, c),
            )
        for name, (N, kernel, fn) in cases.items():
            w = _rand(d, N, scale=d**-0.5)
            cfg = config_for(kernel, M, d, N)
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            t_raw = bench(lambda: _quack.run_epi_gemm(raw, a, w, out, None, {}, cfg))
            t_mm = bench(lambda: a @ w)
            t_k = bench(lambda: fn(w, cfg))
            flops = 2.0 * M * N * d
            shape = {"M": M, "K": d, "N": N}
            extra = {"config": cfg.__dict__, "quack_raw_ms": t_raw["ms"], "cublas_ms": t_mm["ms"]}
            rows.append(
                row(
                    f"kernel/{name}",
                    shape,
                    t_k,
                    flops,
                    **extra,
                    ratio_vs_quack_raw_tflops=t_raw["ms"] / t_k["ms"],
                    ratio_vs_cublas_tflops=t_mm["ms"] / t_k["ms"],
                )
            )
    return rows


# -- blocks: coda op vs torch eager / torch.compile / Liger -------------------------------------
def _torch_swiglu(a, r, w_gate, w_up):
    y = (a.float() * r[:, None]).to(a.dtype)
    return torch.nn.functional.silu(y @ w_gate) * (y @ w_up)


def _torch_rmsnorm_gemm(x, w1, res, gamma, w2, eps=1e-5):
    h = res + x @ w1
    return h, torch.nn.functional.rms_norm(h, (h.shape[-1],), gamma, eps) @ w2


def _torch_qkv_rope(a, r, w_qkv, cos, sin, H, Hkv, hd=128):
    """HF: normalize, project, rotate_half RoPE on (B, heads, S, hd) views."""
    y = (a.float() * r[:, None]).to(a.dtype)
    qkv = (y @ w_qkv).view(-1, 4096, H + 2 * Hkv, hd).transpose(1, 2)
    q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
    return apply_rope_hf(q, cos, sin), apply_rope_hf(k, cos, sin), v


def _torch_lm_ce(a, r, w_lm, target):
    y = (a.float() * r[:, None]).to(a.dtype)
    return torch.nn.functional.cross_entropy((y @ w_lm).float(), target)


def block_rows() -> list[dict]:
    import coda

    try:
        import liger_kernel.transformers.functional as liger
    except Exception as e:  # recorded: Liger is a peer, not a dependency of the suite
        liger = None
        liger_error = repr(e)
    rows = []
    c_swiglu = torch.compile(_torch_swiglu)
    c_norm = torch.compile(_torch_rmsnorm_gemm)
    c_rope = torch.compile(_torch_qkv_rope)
    c_ce = torch.compile(_torch_lm_ce)
    for d in HIDDEN:
        f = ffn(d)
        H, Hkv = heads(d)
        a, res, x = _rand(M, d), _rand(M, d), _rand(M, d)
        r = torch.rand(M, device="cuda") + 0.5
        gamma = 1 + 0.1 * _rand(d)
        wg, wu = _rand(d, f, scale=d**-0.5), _rand(d, f, scale=d**-0.5)
        w_il = torch.stack([wg, wu], -1).flatten(-2)
        w1, w2 = _rand(d, d, scale=d**-0.5), _rand(d, 2 * f, scale=d**-0.5)
        shape = {"M": M, "d": d}
        peers = {}

        def liger_swiglu():
            y = (a.float() * r[:, None]).to(a.dtype)
            return liger.liger_swiglu(y @ wg, y @ wu)

        def liger_norm_gemm():
            h = x @ w1
            resid = res.clone()  # liger's fused add-norm works in place on its inputs
            y = liger.liger_fused_add_rms_norm(h, resid, gamma, 1e-5)
            return y[0] if isinstance(y, tuple) else y

        peers["swiglu"] = {
            "coda": lambda: coda.gemm_swiglu(a, w_il, r, backend="kernel"),
            "torch_eager": lambda: _torch_swiglu(a, r, wg, wu),
            "torch_compile": lambda: c_swiglu(a, r, wg, wu),
            **({"liger": liger_swiglu} if liger else {}),
        }
        peers["rmsnorm_gemm"] = {
            "coda": lambda: coda.gemm_rmsnorm_gemm(x, w1, res, gamma, w2, backend="kernel"),
            "torch_eager": lambda: _torch_rmsnorm_gemm(x, w1, res, gamma, w2),
            "torch_compile": lambda: c_norm(x, w1, res, gamma, w2),
            **({"liger": lambda: liger_norm_gemm() @ w2} if liger else {}),
        }
        nqkv = (H + 2 * Hkv) * 128
        w_qkv = _rand(d, nqkv, scale=d**-0.5)
        pos = torch.arange(M, device="cuda") % 4096
        cos, sin = hf_cos_sin(torch.arange(4096, device="cuda"), 128, dtype=torch.bfloat16)
        cos, sin = cos[None, None], sin[None, None]

        def liger_rope():
            y = (a.float() * r[:, None]).to(a.dtype)
            qkv = (y @ w_qkv).view(-1, 4096, H + 2 * Hkv, 128).transpose(1, 2)
            q, k = qkv[:, :H], qkv[:, H : H + Hkv]
            return liger.liger_rope(q, k, cos[0], sin[0])

        peers["qkv_rope"] = {
            "coda": lambda: coda.gemm_rope(
                a,
                w_qkv,
                pos,
                head_dim=128,
                n_heads=H,
                n_kv_heads=Hkv,
                rstd=r,
                backend="kernel",
            ),
            "torch_eager": lambda: _torch_qkv_rope(a, r, w_qkv, cos, sin, H, Hkv),
            "torch_compile": lambda: c_rope(a, r, w_qkv, cos, sin, H, Hkv),
            **({"liger": liger_rope} if liger else {}),
        }
        for V in VOCABS:
            w_lm = _rand(d, V, scale=d**-0.5)
            w_lm_t = w_lm.t()  # (V, d) as nn.Linear stores it, for Liger
            tgt = torch.randint(0, V, (M,), device="cuda")

            def liger_ce(w_lm_t=w_lm_t, tgt=tgt):
                y = (a.float() * r[:, None]).to(a.dtype)
                return liger.liger_fused_linear_cross_entropy(y, w_lm_t, tgt)

            peers[f"lm_head_ce_V{V}"] = {
                "coda": lambda w_lm=w_lm, tgt=tgt: coda.linear_cross_entropy(
                    a, w_lm, tgt, rstd=r, backend="kernel"
                ),
                "torch_eager": lambda w_lm=w_lm, tgt=tgt: _torch_lm_ce(a, r, w_lm, tgt),
                "torch_compile": lambda w_lm=w_lm, tgt=tgt: c_ce(a, r, w_lm, tgt),
                **({"liger": liger_ce} if liger else {}),
            }
        for block, fns in peers.items():
            times = {}
            for name, fn in fns.items():
                try:
                    with torch.no_grad():
                        times[name] = bench(fn)
                except Exception as e:  # a peer that fails is recorded, not hidden
                    rows.append({"name": f"block/{block}/{name}", **shape, "error": repr(e)[:300]})
            for name, t in times.items():
                rows.append(
                    row(
                        f"block/{block}/{name}",
                        shape,
                        t,
                        0.0,
                        speedup_of_coda=t["ms"] / times["coda"]["ms"] if "coda" in times else None,
                    )
                )
    if liger is None:
        rows.append({"name": "block/liger", "error": liger_error})
    return rows


def run() -> list[dict]:
    return kernel_rows() + block_rows()
