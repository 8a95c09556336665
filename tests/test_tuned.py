"""The tuned tile table (``coda.kernels.tuned``): every (kernel, tile) pair it can hand out
compiles for sm_90a (level 2, derived from the table itself, so a new entry is compiled by CI
the day it is added), and lookups are keyed by kernel (a shape tuned for one kernel never
gives its tile to another)."""

from __future__ import annotations

import pytest

from coda.kernels import ce_scaled_exp as cse
from coda.kernels import dswiglu, rmsnorm_bwd, tuned, wgrad
from coda.kernels import gemm_residual_rms as grr
from coda.kernels import gemm_rmsnorm_gemm as rg
from coda.kernels import gemm_rope as rp
from coda.kernels import gemm_swiglu as sw
from coda.kernels import linear_cross_entropy as ce
from coda.kernels import linear_cross_entropy_bwd as ceb
from coda.kernels import linear_cross_entropy_chunked as cec
from coda.kernels.config import DEFAULT, GemmConfig

# kernel -> compile every program the kernel's lookups serve, at small shapes, on ``config``
# (sum of compiles done: 0 when quack's jit cache already held them)
COMPILE = {
    "rope": lambda c: (  # with Qwen2's QKV bias too, z kept whole and clipped to a row
        rp.compile_gemm_rope(256, 640, config=c)
        + rp.compile_gemm_rope_bias(256, 640, config=c)
        + rp.compile_gemm_rope_bias(256, 640, z_cols=16, config=c)
        + rp.compile_gemm_rope_bias(256, 640, mrope=True, config=c)
    ),
    "scale_rows": lambda c: rg.compile_gemm_scale_rows(256, 520, config=c),
    "residual": lambda c: (  # with the O projection's bias too (Llama's attention_bias)
        grr.compile_gemm_residual_rms(256, 520, gamma=True, config=c)
        + grr.compile_gemm_residual_rms(256, 520, gamma=True, bias=True, config=c)
        + grr.compile_gemm_residual_rms(256, 520, gamma=False, config=c)
        + grr.compile_gemm_residual_rms(256, 520, gamma=False, stats=False, config=c)
    ),
    "swiglu": lambda c: (
        sw.compile_gemm_swiglu(256, 512, save_preact=True, config=c)
        + sw.compile_gemm_swiglu(256, 512, save_preact=False, config=c)
    ),
    "dswiglu": lambda c: dswiglu.compile_dswiglu(512, 768, config=c),
    "norm_bwd": lambda c: rmsnorm_bwd.compile_norm_bwd(768, 512, residual=True, config=c),
    "wgrad": lambda c: wgrad.compile_wgrad_gamma_rows(512, 768, config=c),
    # CE-S's logits GEMM (the default method) and the recompute / chunked methods' stats GEMM;
    # the recompute program's soft-capped pair (its stats and its gradient GEMM, whose tile is
    # the same); CE-S's capped logits GEMM
    "lm_head": lambda c: (
        cse.compile_scaled_exp_logits(512, 768, config=cse.scaled_exp_config(768, c))
        + cse.compile_scaled_exp_logits(512, 768, config=cse.scaled_exp_config(768, c), capped=True)
        + ce.compile_lm_head_stats(256, 1000, config=c)
        + ce.compile_lm_head_stats(256, 1000, config=c, capped=True)
        + ceb.compile_grad_logits(256, 1000, config=c, capped=True)
    ),
    "passthrough": lambda c: cec.compile_logits_chunk(256, 1000, config=c),
}

PAIRS = sorted(
    {(kernel, cfg) for (kernel, _, _), cfg in tuned.TUNED.items()} | set(tuned.DEFAULTS.items()),
    key=lambda p: (p[0], tuple(vars(p[1]).values())),
)


def _id(pair) -> str:
    k, c = pair
    sched = "pp" if c.pingpong else "coop"
    return f"{k}-{c.tile_m}x{c.tile_n}-c{c.cluster_m}x{c.cluster_n}-{sched}"


def test_every_kernel_has_a_compile_and_every_key_names_one():
    assert set(COMPILE) == set(tuned.KERNELS)
    assert {k for k, _, _ in tuned.TUNED} <= set(tuned.KERNELS)
    assert set(tuned.DEFAULTS) <= set(tuned.KERNELS)


def test_lookups_are_keyed_by_kernel_and_not_by_the_token_count():
    # the d = 1024 demo's QKV wgrad (d x 2048, K = its 8192 tokens) and the 1B layer's down
    # projection (K = 8192, N = 2048) each keep their own tile, at any token count
    demo_qkv, down_1b = GemmConfig(128, 128, 2, 1, True), GemmConfig(128, 256, 1, 2, False)
    for tokens in (8192, 16384, 3000):
        assert tuned.config_for("wgrad", 1024, tokens, 2048) == demo_qkv
        assert tuned.config_for("residual", tokens, 8192, 2048) == down_1b
    assert tuned.config_for("wgrad", 8192, 8192, 2048) == DEFAULT  # d = 8192: no entry
    assert tuned.config_for("norm_bwd", 16384, 8192, 2048) == DEFAULT
    # two weight gradients of one width N and K, different d: one entry each
    assert tuned.key("wgrad", 1024, 16384, 4096) != tuned.key("wgrad", 2048, 16384, 4096)
    assert {("wgrad", 1024, 4096), ("wgrad", 2048, 4096)} <= set(tuned.TUNED)
    # a kernel with its own default takes it where no entry exists, others quack's
    assert tuned.config_for("dswiglu", 16384, 4096, 11008) == tuned.DSWIGLU != DEFAULT
    assert tuned.config_for("swiglu", 16384, 24, 40) == DEFAULT
    with pytest.raises(ValueError, match="kernel: must be one of"):
        tuned.config_for("gemm", 16384, 2048, 2048)


@pytest.mark.compile
@pytest.mark.parametrize("pair", PAIRS, ids=[_id(p) for p in PAIRS])
def test_every_tuned_tile_compiles_for_sm90(pair):
    kernel, config = pair
    # compiles done: none when the cache held them, at most one per program the kernel's
    # lookups serve (four for the residual GEMM, five for the LM head's); a compile error raises
    assert 0 <= COMPILE[kernel](config) <= 5


@pytest.mark.compile
def test_a_raster_swizzle_other_than_quacks_default_compiles():
    """``benchmarks/probe_gemm_in_step.py`` varies ``max_swizzle_size`` (a runtime argument of
    quack's tile scheduler): a config with another one goes through coda's launch path."""
    import dataclasses

    config = dataclasses.replace(DEFAULT, max_swizzle_size=1)
    assert COMPILE["dswiglu"](config) in (0, 1)


# -- level 3: each tuned tile of the residual, wgrad, dSwiGLU, norm-backward, row-scale kernels
ON_GPU = sorted(
    k for k in tuned.TUNED if k[0] in ("residual", "wgrad", "dswiglu", "norm_bwd", "scale_rows")
)


@pytest.mark.gpu
@pytest.mark.parametrize("key", ON_GPU, ids=[f"{k}-{K}x{N}" for k, K, N in ON_GPU])
def test_gpu_each_tuned_epilogue_tile(key):
    """H200: the tile ``TUNED`` holds at ``key`` is right at that key's shape (640 tokens; a
    weight gradient's key is (d, N), here at 2048 tokens), and the lookup serves it: each
    output's error vs fp32 no worse than the PyTorch bf16 path's (CODA's protocol)."""
    import torch
    from conftest import assert_no_worse as no_worse

    import coda
    from coda.reference import rmsnorm as rn_ref
    from coda.reference import swiglu as sw_ref

    kernel, K, N = key
    g = torch.Generator(device="cuda").manual_seed(K + N)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale

    def rstd(rows):  # a row scale around 1 (fp32, as the kernels take it)
        return torch.rand(rows, device="cuda", generator=g) + 0.5

    if kernel == "residual":
        x, w, res, gamma = rand(640, K), rand(K, N, scale=K**-0.5), rand(640, N), rand(N)
        assert tuned.config_for(kernel, 640, K, N) == tuned.TUNED[key]  # the lookup serves it
        out = coda.gemm_residual_rms(x, w, res, gamma, backend="kernel")
        h, a, r = rn_ref.gemm_residual_rms_ref(x, w, res, gamma)
        h_t, a_t, r_t = rn_ref.gemm_residual_rms_torch(x, w, res, gamma)
        no_worse(f"{key} h", out.h, h, h_t)
        no_worse(f"{key} normed", out.normed, a, a_t)
        no_worse(f"{key} rstd", out.rstd, r, r_t)
    elif kernel == "dswiglu":  # K = d, N = f: dx (M, d) @ w_d^T, w_d (f, d)
        dx, w_d, u, r = rand(640, K), rand(N, K, scale=K**-0.5), rand(640, 2 * N), rstd(640)
        assert tuned.config_for(kernel, 640, K, N) == tuned.TUNED[key]
        dz, s, stat = dswiglu.dswiglu_kernel(dx, w_d, u, r, tuned.TUNED[key])
        dx64, w64, u64 = dx.double(), w_d.double(), u.double()
        s_ref, dz_ref, S_ref = sw_ref.dswiglu_ref(dx64 @ w64.t(), u64, r.double())
        s_t, dz_t, S_t = sw_ref.dswiglu_ref(dx @ w_d.t(), u, r.to(u.dtype))  # all bf16
        no_worse(f"{key} dz", dz, dz_ref, dz_t)
        no_worse(f"{key} s", s, s_ref, s_t)
        no_worse(f"{key} stat", stat.sum(1), S_ref, S_t)
    elif kernel == "norm_bwd":  # K = N2, N = d: dz (M, N2) @ w2^T, w2 (d, N2)
        dz, w2, h, gamma = rand(640, K), rand(N, K, scale=K**-0.5), rand(640, N), rand(N)
        corr, dres = rstd(640) - 1.0, rand(640, N)
        assert tuned.config_for(kernel, 640, K, N) == tuned.TUNED[key]
        dh, dgamma = rmsnorm_bwd.norm_bwd_kernel(dz, w2, h, gamma, corr, dres, tuned.TUNED[key])
        dz64, w64, h64, g64 = (t.double() for t in (dz, w2, h, gamma))
        dh_ref, dg_ref = rn_ref.norm_bwd_apply_ref(
            dz64 @ w64.t(), h64, g64, corr.double(), dres.double()
        )
        dh_t, dg_t = rn_ref.norm_bwd_apply_ref(dz @ w2.t(), h, gamma, corr.to(h.dtype), dres)
        no_worse(f"{key} dh", dh, dh_ref, dh_t)
        no_worse(f"{key} dgamma", dgamma, dg_ref, dg_t)
    elif kernel == "scale_rows":  # z = r * (a @ w): the gamma-row product of (a^T, w) and r
        a, w, r = rand(640, K), rand(K, N, scale=K**-0.5), rstd(640)
        assert tuned.config_for(kernel, 640, K, N) == tuned.TUNED[key]
        z = rg.gemm_scale_rows_kernel(a, w, r, tuned.TUNED[key])
        z_ref = rn_ref.wgrad_gamma_rows_ref(a.double().t(), w.double(), r.double())
        no_worse(f"{key} z", z, z_ref, rn_ref.wgrad_gamma_rows_ref(a.t(), w, r.to(a.dtype)))
    else:
        tokens, d = 2048, K  # the key's (d, N)
        assert tuned.config_for(kernel, d, tokens, N) == tuned.TUNED[key]
        h, dz, gamma = rand(tokens, d), rand(tokens, N, scale=tokens**-0.5), rand(d)
        got = wgrad.wgrad_gamma_rows(h, dz, gamma, tuned.TUNED[key])
        ref = rn_ref.wgrad_gamma_rows_ref(h.double(), dz.double(), gamma.double())
        no_worse(f"{key} dW", got, ref, rn_ref.wgrad_gamma_rows_ref(h, dz, gamma))
