"""F1 with QK-norm in its epilogue (``coda.kernels.qk_norm``): Qwen3's per-head norm before
RoPE, and Hunyuan's with its gains after the rotation (``post_rows``), at the three levels of
proof. Level 1 runs the epilogue programs through the tile interpreter in float64 against the
reference (and ``coda.gemm_rope`` against Qwen3's own conventions); level 2 compiles every
program form for sm_90a; level 3 (``gpu``) checks CODA's error protocol and the training
form's stores. (Split from ``test_forward_kernels.py``, whose helpers it shares.)"""

import pytest
import torch
from conftest import assert_no_worse, random_dims, rel_err
from test_forward_kernels import F64, _gpu_inputs, gen, randn

import coda
import coda.env
from coda import layouts
from coda.kernels import gemm_rope as rp
from coda.kernels import qk_norm as qkn
from coda.kernels.config import GemmConfig
from coda.reference import rmsnorm as rn_ref
from coda.reference import rope as rope_ref


# -- level 1 ----------------------------------------------------------------------------------
def qk_norm_case(seed: int, hd: int, spread: float):
    """A QK-norm F1 case: (dims, H, Hkv, a, w, r, q_norm, k_norm, positions, freq, eps), the
    gains 1 + ``spread`` N(0, 1)."""
    d = random_dims(seed, M=(1, 150), K=(1, 40), H=(1, 4), Hkv=(1, 2))
    g = gen(seed)
    H, Hkv = d["H"] * d["Hkv"], d["Hkv"]
    a, w = randn(g, d["M"], d["K"]), randn(g, d["K"], (H + 2 * Hkv) * hd)
    r = 0.5 + torch.rand(d["M"], dtype=F64, generator=g)
    qn, kn = 1 + spread * randn(g, hd), 1 + spread * randn(g, hd)
    pos = torch.randint(0, 4096, (d["M"],), generator=g)
    freq = rp.rope_freq_table(hd, H + Hkv, Hkv)
    return d, H, Hkv, a, w, r, qn, kn, pos, freq, [1e-6, 1e-2][seed % 2]


@pytest.mark.parametrize("seed", range(4))
def test_qk_norm_rope_program(seed):
    """F1 with Qwen3's QK-norm in the epilogue (a GroupRstd prepass statistic per head): the
    interpreted program equals the reference, for tile widths holding 1, 2 or 4 heads."""
    hd = [32, 64, 32, 64][seed]  # tile_n holds whole heads of whole subtiles
    d, H, Hkv, a, w, r, qn, kn, pos, freq, eps = qk_norm_case(seed, hd, 0.1)
    head_w, plain = qkn.column_rows(qn, kn, H, Hkv, Hkv, F64)
    config = GemmConfig(tile_m=64, tile_n=hd * [1, 2, 4][seed % 3])
    got = qkn.gemm_qk_norm_rope_kernel(a, w, r, pos.double(), freq, head_w, plain, hd, eps, config)
    cs = rope_ref.rope_table(pos, hd)
    want = rope_ref.gemm_qk_norm_rope_ref(a, w, r, cs, H, Hkv, hd, qn, kn, eps)
    assert rel_err(got, want) < 1e-10
    # the training variant also keeps z (even and odd columns) on the q and k columns (a
    # tile may hold k and v heads: its store is clipped) and the head statistic
    n_rot = (H + Hkv) * hd
    qkv, z_even, z_odd, s = qkn.gemm_qk_norm_rope_kernel(
        a, w, r, pos.double(), freq, head_w, plain, hd, eps, config, keep_z=True, z_cols=n_rot
    )
    z = r[:, None] * (a @ w)
    assert rel_err(qkv, want) < 1e-10
    assert z_even.shape == (d["M"], n_rot // 2)
    assert rel_err(torch.stack([z_even, z_odd], -1).flatten(1), z[:, :n_rot]) < 1e-12
    assert rel_err(qkv[:, n_rot:], z[:, n_rot:]) < 1e-12  # the v columns: z itself
    s_want = torch.rsqrt(z.view(d["M"], -1, hd).pow(2).mean(-1) + eps)
    assert rel_err(s, s_want) < 1e-12


@pytest.mark.parametrize("seed", range(4))
def test_qk_norm_rope_program_gains_after_rope(seed):
    """Hunyuan's QK-norm of the rotated heads in F1's epilogue (``post_rows``: unit gains
    before the rotation, the gains after it): the interpreted program equals the canonical
    math, RoPE(z s) times each head's gain per column, v untouched; the training variant
    keeps the same z and statistic."""
    hd = [32, 64, 64, 32][seed]
    d, H, Hkv, a, w, r, qn, kn, pos, freq, eps = qk_norm_case(seed + 10, hd, 0.5)
    head_w, plain, post_w = qkn.post_rows(qn, kn, H, Hkv, Hkv, F64)
    config = GemmConfig(tile_m=64, tile_n=hd * [1, 2, 4][seed % 3])
    args = (a, w, r, pos.double(), freq, head_w, plain, hd, eps, config)
    got = qkn.gemm_qk_norm_rope_kernel(*args, post_w=post_w)
    one = torch.ones(hd, dtype=F64)
    unit = rope_ref.gemm_qk_norm_rope_ref(
        a, w, r, rope_ref.rope_table(pos, hd), H, Hkv, hd, one, one, eps
    )
    gains = torch.cat([qn.repeat(H), kn.repeat(Hkv), one.repeat(Hkv)])
    want = unit * gains
    assert rel_err(got, want) < 1e-10
    assert rel_err(got, unit) > 1e-2  # (the gains are not near 1: a lost one shows)
    n_rot = (H + Hkv) * hd
    qkv, z_even, z_odd, s = qkn.gemm_qk_norm_rope_kernel(
        *args, keep_z=True, z_cols=n_rot, post_w=post_w
    )
    z = r[:, None] * (a @ w)
    assert rel_err(qkv, want) < 1e-10
    assert rel_err(torch.stack([z_even, z_odd], -1).flatten(1), z[:, :n_rot]) < 1e-12
    assert rel_err(s, torch.rsqrt(z.view(d["M"], -1, hd).pow(2).mean(-1) + eps)) < 1e-12
    with pytest.raises(ValueError, match="multimodal RoPE"):
        qkn.qk_norm_rope_program(eps, False, True, True)


@pytest.mark.parametrize("hd", [8, 16])
def test_heads_narrower_than_an_epilogue_subtile_are_refused(hd, monkeypatch):
    """The GPU lowering of a per-head statistic folds each thread's run of a 32-column
    epilogue subtile into one head's slot: heads of 8 or 16 columns there would share one
    statistic (run 289: a patched Qwen3 at head_dim 16 scored 0.42 off). Both lowerings refuse
    such a program, naming the rule (the interpreter alone would compute it right); the layer
    takes the row pass for them (``qk_norm_config`` None), and the public op on the kernel
    path says why it cannot."""
    g = gen(0)
    M, K, H, Hkv = 40, 24, 4, 2
    N = (H + 2 * Hkv) * hd
    a, w = randn(g, M, K), randn(g, K, N)
    r, pos = torch.ones(M, dtype=F64), torch.arange(M, dtype=F64)
    head_w, plain = qkn.column_rows(randn(g, hd), randn(g, hd), H, Hkv, Hkv, F64)
    freq = rp.rope_freq_table(hd, H + Hkv, Hkv).to(F64)
    rule = "must be a multiple of the epilogue subtile's 32 columns"
    for dry in (False, True):  # the interpreter, and the GPU lowering before quack's trace
        with pytest.raises(ValueError, match=rule):
            qkn.gemm_qk_norm_rope_kernel(
                a, w, r, pos, freq, head_w, plain, hd, 1e-6, GemmConfig(64, 128), dry=dry
            )
    assert qkn.qk_norm_config(hd) is None and qkn.qk_norm_config(2 * 16) is not None
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    x, wq = torch.randn(M, K).bfloat16(), torch.randn(K, N).bfloat16()
    norms = dict(q_norm=torch.ones(hd).bfloat16(), k_norm=torch.ones(hd).bfloat16())
    with pytest.raises(coda.CodaInputError, match=f"head_dim \\({hd}\\).*subtile"):
        coda.gemm_rope(x, wq, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, **norms)
    with pytest.raises(coda.CodaInputError, match=rule):  # a config given: the same rule
        coda.gemm_rope(
            x, wq, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, config=GemmConfig(64, 64), **norms
        )


@pytest.mark.parametrize("after_rope", [False, True], ids=["qwen3", "hunyuan"])
@pytest.mark.parametrize("seed", range(3))
def test_gemm_rope_with_qk_norm_is_qwen3_attention_input(seed, after_rope):
    """``coda.gemm_rope(..., q_norm=, k_norm=)`` on HF weights converted with coda.layouts
    equals Qwen3's q/k/v in HF's own conventions (q_norm on HF-ordered heads, rotate_half
    RoPE), float64: the op, its reference and the layouts agree; with
    ``qk_norm_after_rope=True``, Hunyuan's (RoPE, then the norm)."""
    d = random_dims(seed, M=(1, 40), K=(1, 30), H=(1, 3), Hkv=(1, 2), half=(1, 6))
    g, hd = gen(seed), 2 * d["half"]
    M, K, Hkv = d["M"], d["K"], d["Hkv"]
    H = d["H"] * Hkv
    x, r = randn(g, M, K), 0.5 + torch.rand(M, dtype=F64, generator=g)
    wq, wk, wv = randn(g, H * hd, K), randn(g, Hkv * hd, K), randn(g, Hkv * hd, K)
    qn_hf, kn_hf = 1 + 0.1 * randn(g, hd), 1 + 0.1 * randn(g, hd)
    pos, eps = torch.randint(0, 500, (M,), generator=g), 1e-6
    w_qkv = layouts.qkv_weight_from_hf(wq, wk, wv, n_heads=H, n_kv_heads=Hkv)
    qkv = coda.gemm_rope(
        x,
        w_qkv,
        pos,
        head_dim=hd,
        n_heads=H,
        n_kv_heads=Hkv,
        rstd=r,
        q_norm=layouts.head_weight_from_hf(qn_hf),
        k_norm=layouts.head_weight_from_hf(kn_hf),
        eps=eps,
        qk_norm_after_rope=after_rope,
    )
    y = r[:, None] * x
    theta = rope_ref.rope_angles(pos, hd)  # exact float64 angles (HF's own are fp32)
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)

    def head(w, n, norm):
        t = (y @ w.T).view(M, n, hd)
        if after_rope:  # Hunyuan's: the norm of the rotated head
            t = rope_ref.apply_rope_hf(t, cos[:, None], sin[:, None])
            return rn_ref.head_rmsnorm_ref(t, norm, eps).flatten(1)
        t = rn_ref.head_rmsnorm_ref(t, norm, eps)
        return rope_ref.apply_rope_hf(t, cos[:, None], sin[:, None]).flatten(1)

    nq, nk = H * hd, Hkv * hd
    assert rel_err(rope_ref.adjacent_to_hf_columns(qkv[:, :nq], H, hd), head(wq, H, qn_hf)) < 1e-12
    got_k = rope_ref.adjacent_to_hf_columns(qkv[:, nq : nq + nk], Hkv, hd)
    assert rel_err(got_k, head(wk, Hkv, kn_hf)) < 1e-12
    assert rel_err(qkv[:, nq + nk :], y @ wv.T) < 1e-12
    with pytest.raises(coda.CodaInputError, match="give both"):
        coda.gemm_rope(x, w_qkv, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, q_norm=qn_hf)
    shape = dict(head_dim=hd, n_heads=H, n_kv_heads=Hkv)
    with pytest.raises(coda.CodaInputError, match="qk_norm_after_rope: needs q_norm"):
        coda.gemm_rope(x, w_qkv, pos, **shape, qk_norm_after_rope=True)
    with pytest.raises(coda.CodaInputError, match="qk_norm_after_rope: must be a bool"):
        coda.gemm_rope(x, w_qkv, pos, **shape, q_norm=qn_hf, k_norm=kn_hf, qk_norm_after_rope=1)


@pytest.mark.parametrize("after_rope", [False, True], ids=["qwen3", "hunyuan"])
def test_gemm_rope_kernel_path_runs_the_epilogue_program(after_rope, monkeypatch):
    """The public op's kernel path (bf16, the epilogue programs run by the tile interpreter on
    the CPU: the GPU's operands, ``column_rows`` or ``post_rows``) equals its reference path
    to one bf16 rounding, for Qwen3's order and Hunyuan's; the two orders differ."""
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    g = gen(7)
    M, K, H, Hkv, hd = 40, 24, 4, 2, 32
    x, w = randn(g, M, K).bfloat16(), randn(g, K, (H + 2 * Hkv) * hd).bfloat16()
    qn, kn = (1 + 0.5 * randn(g, 2, hd)).bfloat16()
    kw = dict(head_dim=hd, n_heads=H, n_kv_heads=Hkv, q_norm=qn, k_norm=kn)
    pos = torch.arange(M) * 37
    got = coda.gemm_rope(x, w, pos, backend="kernel", qk_norm_after_rope=after_rope, **kw)
    want = coda.gemm_rope(x, w, pos, backend="reference", qk_norm_after_rope=after_rope, **kw)
    assert got.dtype == torch.bfloat16 and rel_err(got.double(), want.double()) < 2**-8
    other = coda.gemm_rope(x, w, pos, backend="reference", qk_norm_after_rope=not after_rope, **kw)
    assert rel_err(other.double(), want.double()) > 2**-4


# -- level 2: sm_90a ---------------------------------------------------------------------------
# F1 with QK-norm in the epilogue (prepass statistic): head_dim 64 and 128 (Qwen3's)
QK_NORM_COMPILES = {64: (256, 512), 128: (256, 1024)}


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", sorted(QK_NORM_COMPILES))
def test_qk_norm_rope_compiles_for_sm90(head_dim):
    k, n = QK_NORM_COMPILES[head_dim]
    assert qkn.compile_gemm_qk_norm_rope(k, n, head_dim) in (0, 1)
    assert qkn.compile_gemm_qk_norm_rope(k, n, head_dim, keep_z=True) in (0, 1)  # training F1
    for keep_z in (False, True):  # Qwen3-VL's multimodal RoPE; Hunyuan's gains after RoPE
        assert qkn.compile_gemm_qk_norm_rope(k, n, head_dim, keep_z=keep_z, mrope=True) in (0, 1)
        assert qkn.compile_gemm_qk_norm_rope(k, n, head_dim, keep_z=keep_z, post=True) in (0, 1)


# -- level 3: on an SM90 GPU --------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,K,H,Hkv,hd", [(4096, 1024, 16, 8, 128), (777, 512, 4, 2, 64)])
def test_gpu_qk_norm_rope(M, K, H, Hkv, hd):
    """Qwen3's QK-norm in the QKV GEMM's epilogue vs the fp32 reference, no worse than the
    PyTorch bf16 path (project, per-head F.rms_norm, RoPE, each rounded to bf16)."""
    g, x, w, r = _gpu_inputs(M, K, (H + 2 * Hkv) * hd, M + hd)
    qn = 1 + 0.1 * torch.randn(hd, device="cuda", generator=g)
    kn = 1 + 0.1 * torch.randn(hd, device="cuda", generator=g)
    qn, kn = qn.bfloat16(), kn.bfloat16()
    pos = torch.arange(M, device="cuda") % 2048
    kw = dict(head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=r, q_norm=qn, k_norm=kn, eps=1e-6)
    got = coda.gemm_rope(x, w, pos, backend="kernel", **kw)
    cs = rope_ref.rope_table(pos.cpu(), hd).cuda()
    want = rope_ref.gemm_qk_norm_rope_ref(x, w, r, cs, H, Hkv, hd, qn, kn, 1e-6)
    z = (x.float() * r[:, None]).bfloat16() @ w
    nq, nk = H * hd, Hkv * hd

    def normed(t, n, wt):
        return torch.nn.functional.rms_norm(t.view(M, n, hd), (hd,), wt, 1e-6)

    qk = torch.cat([normed(z[:, :nq], H, qn), normed(z[:, nq : nq + nk], Hkv, kn)], 1)
    peer = torch.cat([rope_ref.rope_adjacent_ref(qk, cs.bfloat16()).flatten(1), z[:, nq + nk :]], 1)
    assert_no_worse("qkv", got, want, peer)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,H,Hkv,hd", [(4096, 1024, 16, 8, 128), (777, 512, 4, 2, 64)])
def test_gpu_qk_norm_rope_gains_after_rope(M, K, H, Hkv, hd):
    """Hunyuan's QK-norm of the rotated heads in the QKV GEMM's epilogue (the gains after
    RoPE: ``post_rows``), training and inference forms, vs the fp32 reference, no worse than
    HF's bf16 path (project, RoPE, per-head F.rms_norm with the gains, each rounded)."""
    g, x, w, r = _gpu_inputs(M, K, (H + 2 * Hkv) * hd, M + 2 * hd)
    qn, kn = (1 + 0.3 * torch.randn(2, hd, device="cuda", generator=g)).bfloat16()
    pos = (torch.arange(M, device="cuda") % 2048).float()
    freq = rp.rope_freq_table(hd, H + Hkv, Hkv).cuda()
    head_w, plain, post_w = qkn.post_rows(qn, kn, H, Hkv, Hkv)
    args = (x, w, r, pos, freq, head_w, plain, hd, 1e-6, qkn.qk_norm_config(hd))
    got = qkn.gemm_qk_norm_rope_kernel(*args, post_w=post_w)
    trained = qkn.gemm_qk_norm_rope_kernel(*args, keep_z=True, post_w=post_w)[0]
    cs = rope_ref.rope_table(pos.long().cpu(), hd).cuda()
    one = torch.ones(hd, device="cuda")
    unit = rope_ref.gemm_qk_norm_rope_ref(x, w, r, cs, H, Hkv, hd, one, one, 1e-6)
    want = unit * torch.cat([qn.float().repeat(H), kn.float().repeat(Hkv), one.repeat(Hkv)])
    z = (x.float() * r[:, None]).bfloat16() @ w
    nq, nk = H * hd, Hkv * hd
    rot = rope_ref.rope_adjacent_ref(z[:, : nq + nk].view(M, H + Hkv, hd), cs.bfloat16())
    rot = rot.bfloat16()
    F_ = torch.nn.functional
    q, k = F_.rms_norm(rot[:, :H], (hd,), qn, 1e-6), F_.rms_norm(rot[:, H:], (hd,), kn, 1e-6)
    peer = torch.cat([q.flatten(1), k.flatten(1), z[:, nq + nk :]], 1)
    assert_no_worse("qkv", got, want, peer)
    assert torch.equal(trained, got)
    op = coda.gemm_rope(
        x, w, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=r, q_norm=qn, k_norm=kn,
        eps=1e-6, backend="kernel", qk_norm_after_rope=True,
    )  # fmt: skip
    assert torch.equal(op, got)  # (the public op runs this kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv", [(4, 2), (3, 2)])  # n_rot = 384: whole tiles; 320: one cut
def test_gpu_training_f1_keeps_z_for_q_and_k_only(H, Hkv):
    """The training F1 keeps z for the q and k columns only, in buffers narrower than its
    tile grid (``launch`` plans with full-width stand-ins; the TMA store clips at the
    buffer's bound). Given column slices of wider buffers holding a sentinel: the kept
    columns equal the full-width F1's bitwise, and nothing past the bound is written."""
    from coda.kernels._launch import launch

    M, K, hd, eps = 777, 512, 64, 1e-6
    N, n_rot = (H + 2 * Hkv) * hd, (H + Hkv) * hd
    g, x, w, r = _gpu_inputs(M, K, N, 3)
    qn, kn = (1 + 0.1 * torch.randn(2, hd, device="cuda", generator=g)).bfloat16()
    head_w, plain = qkn.column_rows(qn, kn, H, Hkv, Hkv)
    pos = (torch.arange(M, device="cuda") % 1000).float()
    freq = rp.rope_freq_table(hd, H + Hkv, Hkv).cuda()
    cfg = qkn.qk_norm_config(hd)
    args = (x, w, r, pos, freq, head_w, plain, hd, eps, cfg)
    qkv_all, ze_all, zo_all, s_all = qkn.gemm_qk_norm_rope_kernel(*args, keep_z=True)
    qkv, ze, zo, s = qkn.gemm_qk_norm_rope_kernel(*args, keep_z=True, z_cols=n_rot)
    assert ze.shape == (M, n_rot // 2)
    for got, want in ((qkv, qkv_all), (ze, ze_all[:, : n_rot // 2]), (zo, zo_all[:, : n_rot // 2])):
        assert torch.equal(got, want)
    assert torch.equal(s, s_all)
    sentinel = -7.0
    wide = torch.full((2, M, N // 2 + 64), sentinel, device="cuda", dtype=torch.bfloat16)
    outputs = {"z_even": wide[0, :, : n_rot // 2], "z_odd": wide[1, :, : n_rot // 2]}
    outputs["head_s"] = torch.empty_like(s)
    operands = {"rstd": r, "pos": pos, "freq": freq, "head_w": head_w, "plain": plain}
    operands["head_rstd"] = hd
    d = torch.empty_like(qkv)
    launch(
        qkn.qk_norm_rope_program(eps, True), x, w, config=cfg, d=d, operands=operands,
        outputs=outputs,
    )  # fmt: skip
    assert torch.equal(wide[0, :, : n_rot // 2], ze) and torch.equal(wide[1, :, : n_rot // 2], zo)
    assert (wide[:, :, n_rot // 2 :] == sentinel).all()  # the clipped tiles wrote nothing
