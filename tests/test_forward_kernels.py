"""The forward Transformer++ kernels (SwiGLU, RoPE, LM-head CE, the RMSNorm-GEMM block) at the
three levels of proof, plus the HF <-> coda weight layouts and bad input (F1 with QK-norm:
``test_qk_norm_epilogue.py``).

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
