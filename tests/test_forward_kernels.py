"""The forward Transformer++ kernels (SwiGLU, RoPE, LM-head CE, the RMSNorm-GEMM block) at the
three levels of proof, plus the HF <-> coda weight layouts and bad input.

Level 1 runs each epilogue program through the tile interpreter in float64, on random shapes
with ragged tiles, against the reference; level 2 compiles every kernel configuration for
sm_90a; level 3 (``gpu``) checks CODA's error protocol and one compile for many token counts."""

import pytest
import torch
from conftest import assert_no_worse, fro_err, random_dims, rel_err

import coda
import coda.env
from coda import layouts
from coda.kernels import gemm_rmsnorm_gemm as rg
from coda.kernels import gemm_rope as rp
from coda.kernels import gemm_swiglu as sw
from coda.kernels import linear_cross_entropy as ce
from coda.kernels import qk_norm as qkn
from coda.kernels.config import DEFAULT, GemmConfig
from coda.primitives.interpreter import interpret
from coda.reference import cross_entropy as ce_ref
from coda.reference import rmsnorm as rn_ref
from coda.reference import rope as rope_ref
from coda.reference import swiglu as sw_ref
from coda.reference.layer import LayerShape, attention_ref

F64 = torch.float64
SMALL = GemmConfig(tile_m=64, tile_n=32)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=F64, device="cpu", scale=1.0):
    return scale * torch.randn(*shape, dtype=dtype, generator=g).to(device)


# -- level 1 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", [SMALL, DEFAULT], ids=["64x32", "default"])
def test_swiglu_program(seed, config):
    d = random_dims(seed, M=(1, 200), K=(1, 40), f=(1, 230))
    g = gen(seed)
    a, w = randn(g, d["M"], d["K"]), randn(g, d["K"], 2 * d["f"])
    r = 0.5 + torch.rand(d["M"], dtype=F64, generator=g)
    s, u = sw.gemm_swiglu_interpreted(a, w, r, config)
    s_ref, u_ref = sw_ref.gemm_swiglu_ref(a, w, r)
    assert rel_err(s, s_ref) < 1e-14 and rel_err(u, u_ref) < 1e-14


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", [SMALL, DEFAULT], ids=["64x32", "default"])
def test_rope_program(seed, config):
    d = random_dims(seed, M=(1, 150), K=(1, 40), H=(1, 4), Hkv=(1, 2), half=(1, 8))
    g, hd = gen(seed), 2 * d["half"]
    H, Hkv = d["H"] * d["Hkv"], d["Hkv"]
    a, w = randn(g, d["M"], d["K"]), randn(g, d["K"], (H + 2 * Hkv) * hd)
    r = 0.5 + torch.rand(d["M"], dtype=F64, generator=g)
    pos = torch.randint(0, 4096, (d["M"],), generator=g)
    freq = rp.rope_freq_table(hd, H + Hkv, Hkv)
    got = rp.gemm_rope_interpreted(a, w, r, pos.double(), freq, config)
    want = rope_ref.gemm_rope_ref(a, w, r, rope_ref.rope_table(pos, hd), H, Hkv, hd)
    # freq is inv_freq / 2pi split into two float32s: ~2^-48 relative, times angles < 4096
    assert rel_err(got, want) < 1e-10


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


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", [SMALL, DEFAULT], ids=["64x32", "default"])
def test_lm_head_program(seed, config):
    d = random_dims(seed, M=(1, 120), K=(1, 40), V=(2, 700))
    g = gen(seed)
    a, w = randn(g, d["M"], d["K"]), randn(g, d["K"], d["V"])
    r = 0.5 + torch.rand(d["M"], dtype=F64, generator=g)
    target = torch.randint(0, d["V"], (d["M"],), generator=g)
    target[torch.rand(d["M"], generator=g) < 0.25] = -100
    parts, tl = ce.lm_head_stats_interpreted(a, w, r, target, config)
    logits = r[:, None] * (a @ w)
    assert rel_err(parts, ce_ref.lse_partials_ref(logits, config.tile_n)) < 1e-13
    for reduction in ("mean", "sum", "none"):
        got = ce_ref.ce_from_stats_ref(
            ce_ref.lse_combine_ref(parts), tl, target, reduction=reduction
        )
        want = ce_ref.linear_cross_entropy_ref(a, w, r, target, reduction=reduction)
        assert rel_err(got, want) < 1e-13 or (target == -100).all()


@pytest.mark.parametrize("seed", range(3))
def test_scale_rows_program_and_block(seed):
    d = random_dims(seed, M=(1, 150), K=(1, 30), d=(1, 70), N2=(1, 90))
    g = gen(seed)
    x, w1, res = randn(g, d["M"], d["K"]), randn(g, d["K"], d["d"]), randn(g, d["M"], d["d"])
    gamma, w2 = 1 + 0.1 * randn(g, d["d"]), randn(g, d["d"], d["N2"])
    h, a, r = rn_ref.gemm_residual_rms_ref(x, w1, res, gamma)
    z = interpret(rg.scale_rows, a @ w2, {"scale": r}, tile_m=64, tile_n=32)["D"]
    h_c, z_c, r_c = rn_ref.gemm_rmsnorm_gemm_ref(x, w1, res, gamma, w2)
    assert rel_err(z, z_c) < 1e-13
    out = coda.gemm_rmsnorm_gemm(x, w1, res, gamma, w2)
    assert torch.equal(out.z, z_c) and torch.equal(out.h, h_c) and torch.equal(out.rstd, r_c)


@pytest.mark.parametrize("seed", range(3))
def test_gemm_rope_with_qk_norm_is_qwen3_attention_input(seed):
    """``coda.gemm_rope(..., q_norm=, k_norm=)`` on HF weights converted with coda.layouts
    equals Qwen3's q/k/v in HF's own conventions (q_norm on HF-ordered heads, rotate_half
    RoPE), float64: the op, its reference and the layouts agree."""
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
    )
    y = r[:, None] * x
    theta = rope_ref.rope_angles(pos, hd)  # exact float64 angles (HF's own are fp32)
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)

    def head(w, n, norm):
        t = rn_ref.head_rmsnorm_ref((y @ w.T).view(M, n, hd), norm, eps)
        return rope_ref.apply_rope_hf(t, cos[:, None], sin[:, None]).flatten(1)

    nq, nk = H * hd, Hkv * hd
    assert rel_err(rope_ref.adjacent_to_hf_columns(qkv[:, :nq], H, hd), head(wq, H, qn_hf)) < 1e-12
    got_k = rope_ref.adjacent_to_hf_columns(qkv[:, nq : nq + nk], Hkv, hd)
    assert rel_err(got_k, head(wk, Hkv, kn_hf)) < 1e-12
    assert rel_err(qkv[:, nq + nk :], y @ wv.T) < 1e-12
    with pytest.raises(coda.CodaInputError, match="give both"):
        coda.gemm_rope(x, w_qkv, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, q_norm=qn_hf)


def test_public_ops_reference_path_on_cpu():
    g = gen(0)
    M, K, H, Hkv, hd, f, V = 19, 16, 4, 2, 8, 24, 40
    x = randn(g, M, K, dtype=torch.bfloat16)
    r = 0.5 + torch.rand(M, generator=g)
    w_il = randn(g, K, 2 * f, dtype=torch.bfloat16)
    out = coda.gemm_swiglu(x, w_il, r, save_preact=True)
    s, u = sw_ref.gemm_swiglu_ref(x, w_il, r)
    assert torch.equal(out.s, s.bfloat16()) and torch.equal(out.preact, u.bfloat16())
    assert coda.gemm_swiglu(x, w_il).preact is None
    w_qkv = randn(g, K, (H + 2 * Hkv) * hd, dtype=torch.bfloat16)
    pos = torch.arange(M) % 7
    qkv = coda.gemm_rope(x, w_qkv, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=r)
    want = rope_ref.gemm_rope_ref(x, w_qkv, r, rope_ref.rope_table(pos, hd), H, Hkv, hd)
    assert torch.equal(qkv, want.bfloat16())
    w_lm = randn(g, K, V, dtype=torch.bfloat16)
    t = torch.randint(0, V, (M,), generator=g)
    loss = coda.linear_cross_entropy(x, w_lm, t, rstd=r)
    assert loss.dtype == torch.float32
    assert torch.equal(loss, ce_ref.linear_cross_entropy_ref(x, w_lm, r, t).float())
    for op in ("gemm_swiglu", "gemm_rope", "linear_cross_entropy"):
        assert coda.last_path(op)[0] == "reference"


def test_public_ops_take_the_tuned_tile_unless_given_one(monkeypatch):
    """Without ``config`` each op's kernel path runs the tile ``tuned.config_for`` names for
    its kernel at its GEMM's (K, N), as the layers do; a given config wins. The kernels are
    stood in for by spies (no GPU here): this checks the choice, tests/test_tuned.py that
    every tile of the table compiles."""
    from coda import ops
    from coda.kernels import tuned

    # one tile per kernel at (K, N) = (16, 48), so each op shows which kernel it asked for
    kernels = ("swiglu", "residual", "rope", "lm_head")
    picks = {k: GemmConfig(128, 64 * (i + 1), 2, 1, True) for i, k in enumerate(kernels)}
    for kernel, cfg in picks.items():
        monkeypatch.setitem(tuned.TUNED, (kernel, 16, 48), cfg)
    second = GemmConfig(256, 128, 2, 1, False)  # gemm_rmsnorm_gemm's GEMM2, (48, 64)
    monkeypatch.setitem(tuned.TUNED, ("scale_rows", 48, 64), second)
    monkeypatch.setitem(tuned.TUNED, ("residual", 48, 64), DEFAULT)  # another kernel's: unused
    seen = []
    monkeypatch.setattr(ops, "_start", lambda *a: "kernel")
    monkeypatch.setattr(ops, "_kernel_layout", lambda *a: None)
    monkeypatch.setattr(ops.lib, "gemm_swiglu_only", lambda *a: seen.append(a[3]))
    monkeypatch.setattr(ops.lib, "gemm_residual_rms", lambda *a: seen.append(a[5]) or (1, 2, 3))
    monkeypatch.setattr(ops.lib, "gemm_rope", lambda *a: seen.append(a[-1]))
    monkeypatch.setattr(
        ops, "gemm_rmsnorm_gemm_kernel", lambda *a: seen.append(a[-2:]) or (1, 2, 3)
    )
    monkeypatch.setattr(ops, "linear_cross_entropy_kernel", lambda *a: seen.append(a[6]) or (0,))
    bf = torch.bfloat16
    x, w, w2 = (
        torch.zeros(5, 16, dtype=bf),
        torch.zeros(16, 48, dtype=bf),
        torch.zeros(48, 64, dtype=bf),
    )
    res, g, pos = torch.zeros(5, 48, dtype=bf), torch.ones(48, dtype=bf), torch.arange(5)
    coda.gemm_swiglu(x, w)
    coda.gemm_residual_rms(x, w, res, g)
    coda.gemm_rope(x, w, pos, head_dim=8, n_heads=2, n_kv_heads=2)
    coda.gemm_rmsnorm_gemm(x, w, res, g, w2)
    coda.linear_cross_entropy(x, w, torch.zeros(5, dtype=torch.long))
    p = picks
    assert seen == [p["swiglu"], p["residual"], p["rope"], (p["residual"], second), p["lm_head"]]
    seen.clear()
    coda.gemm_swiglu(x, w, config=DEFAULT)
    coda.gemm_rmsnorm_gemm(x, w, res, g, w2, config2=DEFAULT)
    assert seen == [DEFAULT, (p["residual"], DEFAULT)]


def test_layouts_round_trip_and_attention_unchanged():
    g = gen(1)
    s = LayerShape(batch=2, seq=9, d=16, heads=4, kv_heads=2, head_dim=8, ffn=12, vocab=8)
    hd, M = s.head_dim, s.tokens
    q_proj, k_proj = randn(g, s.heads * hd, s.d), randn(g, s.kv_heads * hd, s.d)
    v_proj = randn(g, s.kv_heads * hd, s.d)
    w_qkv = layouts.qkv_weight_from_hf(q_proj, k_proj, v_proj, n_heads=4, n_kv_heads=2)
    back = layouts.qkv_weight_to_hf(w_qkv, n_heads=4, n_kv_heads=2, head_dim=hd)
    assert all(torch.equal(a, b) for a, b in zip(back, (q_proj, k_proj, v_proj)))
    gate, up = randn(g, s.ffn, s.d), randn(g, s.ffn, s.d)
    w_il = layouts.gate_up_weight_from_hf(gate, up)
    assert all(torch.equal(a, b) for a, b in zip(layouts.gate_up_weight_to_hf(w_il), (gate, up)))
    # SwiGLU through coda's interleaved weight == HF's MLP activation
    y = randn(g, M, s.d)
    hf_act = torch.nn.functional.silu(y @ gate.T) * (y @ up.T)
    assert rel_err(coda.gemm_swiglu(y, w_il).s, hf_act) < 1e-14
    # attention through coda's rotated q/k (adjacent layout) == HF attention
    pos = torch.arange(s.seq).repeat(s.batch)
    theta = rope_ref.rope_angles(pos, hd)
    q = rope_ref.rope_hf_ref((y @ q_proj.T).view(M, s.heads, hd), theta).flatten(1)
    k = rope_ref.rope_hf_ref((y @ k_proj.T).view(M, s.kv_heads, hd), theta).flatten(1)
    # the scores themselves: q . k per (query head, its kv head, token pair) are unchanged
    qkv = coda.gemm_rope(y, w_qkv, pos, head_dim=hd, n_heads=4, n_kv_heads=2)
    nq, nkv = s.heads * hd, s.kv_heads * hd
    rep = s.heads // s.kv_heads
    scores_hf = torch.einsum(
        "mhd,nhd->hmn", q.view(M, 4, hd), k.view(M, 2, hd).repeat_interleave(rep, 1)
    )
    scores = torch.einsum(
        "mhd,nhd->hmn",
        qkv[:, :nq].view(M, 4, hd),
        qkv[:, nq : nq + nkv].view(M, 2, hd).repeat_interleave(rep, 1),
    )
    assert rel_err(scores, scores_hf) < 1e-13
    o_hf = attention_ref(q, k, y @ v_proj.T, s)
    o = attention_ref(qkv[:, :nq], qkv[:, nq : nq + nkv], qkv[:, nq + nkv :], s)
    assert rel_err(o, o_hf) < 1e-13


def test_forward_ops_bad_input():
    x, w = torch.randn(8, 16), torch.randn(16, 10)
    with pytest.raises(coda.CodaInputError, match="w_il: dim 1 .2f. must be even"):
        coda.gemm_swiglu(x, w[:, :9])
    with pytest.raises(coda.CodaInputError, match="rstd: expected shape"):
        coda.gemm_swiglu(x, w, torch.ones(7))
    with pytest.raises(
        coda.CodaInputError, match="rstd: dtype must be torch.float32 for torch.float32 inputs"
    ):
        coda.gemm_swiglu(x, w, torch.ones(8, dtype=torch.float64))
    with pytest.raises(coda.CodaInputError, match=r"w_qkv: dim 1 must equal \(n_heads"):
        coda.gemm_rope(x, w, torch.arange(8), head_dim=2, n_heads=2, n_kv_heads=2)
    with pytest.raises(coda.CodaInputError, match="head_dim must be even"):
        coda.gemm_rope(x, torch.randn(16, 9), torch.arange(8), head_dim=3, n_heads=1, n_kv_heads=1)
    with pytest.raises(coda.CodaInputError, match="positions: expected shape"):
        coda.gemm_rope(x, w, torch.arange(5), head_dim=2, n_heads=3, n_kv_heads=1)
    for base in ("1e4", 0.0, -1e4, float("nan")):  # NaN rotations before the rule
        with pytest.raises(coda.CodaInputError, match="rope_base: must be a finite positive"):
            coda.gemm_rope(
                x, w, torch.arange(8), head_dim=2, n_heads=3, n_kv_heads=1, rope_base=base
            )
    with pytest.raises(coda.CodaInputError, match="target: dtype must be int32 or int64"):
        coda.linear_cross_entropy(x, w, torch.zeros(8))
    with pytest.raises(coda.CodaInputError, match="reduction: must be one of"):
        coda.linear_cross_entropy(x, w, torch.zeros(8, dtype=torch.long), reduction="avg")
    with pytest.raises(coda.CodaInputError, match=r"w2: dim 0 must equal w1.shape\[1\]"):
        coda.gemm_rmsnorm_gemm(x, w, torch.randn(8, 10), torch.ones(10), torch.randn(9, 4))
    with pytest.raises(coda.CodaInputError, match=r"bias: expected shape \(\(n_heads"):
        coda.gemm_rope(
            x, w, torch.arange(8), head_dim=2, n_heads=3, n_kv_heads=1, bias=torch.ones(9)
        )
    with pytest.raises(coda.CodaInputError, match="bias: not with q_norm"):
        coda.gemm_rope(
            x, w, torch.arange(8), head_dim=2, n_heads=3, n_kv_heads=1, bias=torch.ones(10),
            q_norm=torch.ones(2), k_norm=torch.ones(2),
        )  # fmt: skip
    with pytest.raises(coda.CodaInputError, match="all tensors must share one dtype"):
        coda.gemm_rope(
            x, w, torch.arange(8), head_dim=2, n_heads=3, n_kv_heads=1, bias=torch.ones(10).double()
        )
    with pytest.raises(NotImplementedError, match="forward-only"):
        coda.gemm_swiglu(x, w.requires_grad_(True))
    for convert in (layouts.head_weight_from_hf, layouts.head_weight_to_hf):  # one rule both ways
        rule = r"1-D QK-norm weight of whole heads of even length \(head_dim {}\)"
        with pytest.raises(coda.CodaInputError, match=rule.format(7)):
            convert(torch.ones(7))
        with pytest.raises(coda.CodaInputError, match=rule.format(8)):  # (OLMo's: whole heads)
            convert(torch.ones(12), head_dim=8)


# -- level 2: every kernel configuration compiles for sm_90a ------------------------------------
COMPILES = {
    "swiglu_keep_preact": lambda m: sw.compile_gemm_swiglu(256, 512, save_preact=True, w_major=m),
    "swiglu_only": lambda m: sw.compile_gemm_swiglu(256, 512, save_preact=False, w_major=m),
    "geglu_keep_preact": lambda m: sw.compile_gemm_swiglu(
        256, 512, save_preact=True, w_major=m, activation="gelu_tanh"
    ),
    "geglu_only": lambda m: sw.compile_gemm_swiglu(
        256, 512, save_preact=False, w_major=m, activation="gelu_tanh"
    ),
    "rope": lambda m: rp.compile_gemm_rope(256, 640, w_major=m),
    "rope_bias": lambda m: rp.compile_gemm_rope_bias(256, 640, w_major=m),
    "rope_bias_lean": lambda m: rp.compile_gemm_rope_bias(256, 640, z_cols=16, w_major=m),
    "rope_bias_mrope": lambda m: rp.compile_gemm_rope_bias(256, 640, w_major=m, mrope=True),
    "lm_head_stats": lambda m: ce.compile_lm_head_stats(256, 1000, w_major=m),
    "lm_head_stats_capped": lambda m: ce.compile_lm_head_stats(256, 1000, w_major=m, capped=True),
    "scale_rows": lambda m: rg.compile_gemm_scale_rows(256, 520, w_major=m),
}
# every tile the tuned table hands out compiles in tests/test_tuned.py
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


@pytest.mark.compile
@pytest.mark.parametrize("w_major", ["n", "k"])
@pytest.mark.parametrize("kernel", sorted(COMPILES))
def test_compiles_for_sm90(kernel, w_major):
    assert COMPILES[kernel](w_major) in (0, 1)


@pytest.mark.compile
def test_rope_loads_integer_positions_for_sm90():
    """The RoPE epilogues load a caller's integer positions as they are (``coda.gemm_rope``
    passes int64 / int32 positions uncast; one vector load serves every program): F1 compiles
    with int64 positions, its QK-norm form with int32, its bias form (``bias=``, z's store
    clipped) with both."""
    assert rp.compile_gemm_rope(256, 640, pos_dtype=torch.int64) in (0, 1)
    for dt in (torch.int64, torch.int32):
        assert rp.compile_gemm_rope_bias(256, 640, z_cols=16, pos_dtype=dt) in (0, 1)
    assert qkn.compile_gemm_qk_norm_rope(256, 512, 64, pos_dtype=torch.int32) in (0, 1)


# -- level 3: on an SM90 GPU --------------------------------------------------------------------
def _gpu_inputs(M, K, N, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16, generator=g) / K**0.5
    r = 0.5 + torch.rand(M, device="cuda", generator=g)
    return g, x, w, r


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,f", [(4096, 2048, 5632), (1000, 512, 1000)])
def test_gpu_swiglu(M, K, f):
    g, x, w, r = _gpu_inputs(M, K, 2 * f, M + f)
    out = coda.gemm_swiglu(x, w, r, save_preact=True, backend="kernel")
    s_ref, u_ref = sw_ref.gemm_swiglu_ref(x, w, r)
    assert_no_worse("s", out.s, s_ref, sw_ref.gemm_swiglu_torch(x, w, r))
    assert_no_worse("preact", out.preact, u_ref, x @ w)


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


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,H,Hkv", [(4096, 2048, 16, 8), (777, 512, 4, 2)])
def test_gpu_rope(M, K, H, Hkv):
    hd = 128
    g, x, w, r = _gpu_inputs(M, K, (H + 2 * Hkv) * hd, M)
    pos = torch.arange(M, device="cuda") % 2048
    got = coda.gemm_rope(
        x, w, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=r, backend="kernel"
    )
    cs = rope_ref.rope_table(pos.cpu(), hd).cuda()
    want = rope_ref.gemm_rope_ref(x, w, r, cs, H, Hkv, hd)
    assert_no_worse("qkv", got, want, rope_ref.gemm_rope_torch(x, w, r, pos.cpu(), H, Hkv, hd))
    for other in (pos.int(), pos.float(), pos.short()):  # loaded as they are, or cast once
        same = coda.gemm_rope(
            x, w, other, head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=r, backend="kernel"
        )
        assert torch.equal(same, got), other.dtype
    nv = Hkv * hd
    assert (
        torch.equal(got[:, -nv:], (r[:, None] * (x.float() @ w.float()))[:, -nv:].bfloat16())
        or fro_err(got[:, -nv:], want[:, -nv:]) < 4e-3
    )  # V passes unrotated


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,V", [(4096, 2048, 32768), (1000, 512, 32008)])
def test_gpu_linear_cross_entropy(M, K, V):
    g, x, w, r = _gpu_inputs(M, K, V, V)
    w = w * 4  # logits of a few units, as after training
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    t[::7] = -100
    for reduction in ("mean", "none"):
        got = coda.linear_cross_entropy(x, w, t, rstd=r, reduction=reduction, backend="kernel")
        want = ce_ref.linear_cross_entropy_ref(x, w, r, t, reduction=reduction)
        peer = ce_ref.linear_cross_entropy_torch(x, w, r, t, reduction=reduction)
        if reduction == "none":
            assert_no_worse("loss_rows", got, want, peer)
        else:
            assert abs(got - want) <= abs(peer - want) + 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,d,N2", [(4096, 2048, 2048, 4096), (555, 512, 520, 1000)])
def test_gpu_rmsnorm_gemm_block(M, K, d, N2):
    g, x, w1, _ = _gpu_inputs(M, K, d, M)
    res = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, generator=g)
    gamma = 1 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16, generator=g)
    w2 = torch.randn(d, N2, device="cuda", dtype=torch.bfloat16, generator=g) / d**0.5
    out = coda.gemm_rmsnorm_gemm(x, w1, res, gamma, w2, backend="kernel")
    ref = rn_ref.gemm_rmsnorm_gemm_ref(x, w1, res, gamma, w2)
    peer = rn_ref.gemm_rmsnorm_gemm_torch(x, w1, res, gamma, w2)
    for name, a, b, c in zip(("h", "z", "rstd"), out, ref, peer):
        assert_no_worse(name, a, b, c)


@pytest.mark.gpu
def test_gpu_one_compile_serves_every_token_count():
    from coda import _quack

    compile_fn = _quack._modules()["host"]._compile_gemm_epi
    g, x, w, r = _gpu_inputs(600, 256, 512, 0)
    t = torch.randint(0, 512, (600,), device="cuda", generator=g)
    pos = torch.arange(600, device="cuda")
    res, gamma = x[:, :256].contiguous(), r[:256].bfloat16()

    def all_ops(m):
        coda.gemm_swiglu(x[:m], w, r[:m], save_preact=True, backend="kernel")
        coda.gemm_rope(
            x[:m], w, pos[:m], head_dim=64, n_heads=4, n_kv_heads=2, rstd=r[:m], backend="kernel"
        )
        coda.linear_cross_entropy(x[:m], w, t[:m], rstd=r[:m], backend="kernel")
        return coda.gemm_rmsnorm_gemm(x[:m], w[:, :256], res[:m], gamma, w, backend="kernel")

    all_ops(600)
    before = compile_fn.cache_info().misses
    for m in (1, 65, 129, 333, 599):
        out = all_ops(m)
        ref = rn_ref.gemm_rmsnorm_gemm_ref(x[:m], w[:, :256], res[:m], gamma, w)
        assert fro_err(out.z, ref[1]) < 1e-2
    assert compile_fn.cache_info().misses == before
