"""Backward kernels, autograd layers and HF weights at the three levels of proof.

Level 1 (CPU, float64): each backward epilogue program through the tile interpreter equals its
reference; the CE-A loop (interpreted) equals autograd; the nn modules' reference path equals
the canonical HF layer under autograd, every gradient; HF weights round-trip exactly.
Level 2: every backward kernel compiles for sm_90a. Level 3 (``gpu``): every gradient of the
kernel path against an fp32 reference, normalized by the plain PyTorch bf16 path's error."""

import pytest
import torch
from conftest import fro_err, random_dims, rel_err

import coda
import coda.nn as cnn
from coda.kernels import drope, dswiglu, rmsnorm_bwd, wgrad
from coda.kernels import gemm_rmsnorm_gemm as rg
from coda.kernels import linear_cross_entropy_bwd as ceb
from coda.kernels import linear_cross_entropy_chunked as cec
from coda.kernels.config import GemmConfig
from coda.primitives.interpreter import interpret
from coda.reference import cross_entropy as ce_ref
from coda.reference import layer as L
from coda.reference import rmsnorm as rn_ref
from coda.reference import rope as rope_ref
from coda.reference import swiglu as sw_ref

F64 = torch.float64
SMALL = GemmConfig(tile_m=64, tile_n=32)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(g, *shape):
    return torch.randn(tuple(shape), dtype=F64, generator=g)


# -- level 1 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_dswiglu_program(seed):
    d = random_dims(seed, M=(1, 150), dm=(1, 40), f=(1, 100))
    g = gen(seed)
    dx, w_d, u = rnd(g, d["M"], d["dm"]), rnd(g, d["f"], d["dm"]), rnd(g, d["M"], 2 * d["f"])
    r = 0.5 + torch.rand(d["M"], dtype=F64, generator=g)
    dz, s, stat = dswiglu.dswiglu_interpreted(dx, w_d, u, r, SMALL)
    s_ref, dz_ref, S_ref = sw_ref.dswiglu_ref(dx @ w_d.t(), u, r)
    assert rel_err(dz, dz_ref) < 1e-13 and rel_err(s, s_ref) < 1e-13
    corr = rmsnorm_bwd.norm_corr(r, stat, 7)
    assert rel_err(corr, rn_ref.norm_corr_ref(r, S_ref, 7)) < 1e-13


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("residual", [False, True])
def test_norm_bwd_program(seed, residual):
    d = random_dims(seed, M=(1, 150), n2=(1, 60), d=(1, 90))
    g = gen(seed)
    M, n2, dd = d["M"], d["n2"], d["d"]
    dz, w2, h = rnd(g, M, n2), rnd(g, dd, n2), rnd(g, M, dd)
    gamma, corr, dres = rnd(g, dd), rnd(g, M), rnd(g, M, dd) if residual else None
    dh, dgamma = rmsnorm_bwd.norm_bwd_interpreted(dz, w2, h, gamma, corr, dres, SMALL)
    dh_ref, dg_ref = rn_ref.norm_bwd_apply_ref(dz @ w2.t(), h, gamma, corr, dres)
    assert rel_err(dh, dh_ref) < 1e-13 and rel_err(dgamma, dg_ref) < 1e-13


@pytest.mark.parametrize("seed", range(3))
def test_wgrad_gamma_rows_program(seed):
    d = random_dims(seed, M=(1, 90), d=(1, 70), n=(1, 80))
    g = gen(seed)
    h, dz, gamma = rnd(g, d["M"], d["d"]), rnd(g, d["M"], d["n"]), rnd(g, d["d"])
    out = interpret(rg.scale_rows, h.t() @ dz, {"scale": gamma}, tile_m=64, tile_n=32)["D"]
    assert rel_err(out, rn_ref.wgrad_gamma_rows_ref(h, dz, gamma)) < 1e-13


def _final_norm_ce_case(seed, M, d, V, reduction):
    """Leaves h, gamma, w of the final norm + LM head, targets with ~20 % ignored rows, and
    the canonical loss (autograd graph attached)."""
    g = gen(seed)
    h = rnd(g, M, d).requires_grad_(True)
    gamma = (1 + 0.1 * rnd(g, d)).requires_grad_(True)
    w = rnd(g, d, V).requires_grad_(True)
    t = torch.randint(0, V, (M,), generator=g)
    t[torch.rand(M, generator=g) < 0.2] = -100
    logits = rn_ref.rmsnorm_ref(h, gamma, 1e-5) @ w
    return h, gamma, w, t, ce_ref.cross_entropy_ref(logits, t, reduction=reduction)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_backward_loop(seed, reduction):
    """The CE-A loop (B1 interpreted, one-hot fix-up, B2/B3 in torch, final norm backward)
    equals autograd of the canonical final norm + LM head + CE, for every chunk size."""
    d = random_dims(seed, M=(1, 60), d=(1, 24), V=(2, 300), chunk=(1, 120))
    h, gamma, w, t, loss = _final_norm_ce_case(seed, d["M"], d["d"], d["V"], reduction)
    g = gen(seed)
    upstream = rnd(g, *loss.shape)
    loss.backward(upstream)
    hd, gd, wd = h.detach(), gamma.detach(), w.detach()
    a, r = hd * gd, rn_ref.rstd_ref(hd, 1e-5)
    logits = r[:, None] * (a @ wd)
    lse = torch.logsumexp(logits, -1)
    tl = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
    scale = ceb.row_scale(t, -100, reduction, upstream).double()
    G, S, dw = ceb.linear_cross_entropy_bwd_kernel(
        a, wd, r, lse, tl, t, scale, d["chunk"], SMALL, interpreted=True
    )
    dh, dgamma = ceb.final_norm_bwd(G, S, hd, gd, r)
    assert rel_err(dh, h.grad) < 1e-12 and rel_err(dgamma, gamma.grad) < 1e-12
    assert rel_err(dw, w.grad) < 1e-12


def test_the_backward_loop_frees_each_chunk_s_logit_gradients_before_the_next(monkeypatch):
    """CE-A's backward keeps one vocabulary chunk's dz~ (M x chunk bf16, 0.5 GiB at its
    default) alive at a time: when B1 makes a chunk's, no earlier chunk's is referenced."""
    import weakref

    made = []
    b1 = ceb.grad_logits_interpreted

    def recording(*args, **kwargs):
        assert all(ref() is None for ref in made), "an earlier chunk's dz is still alive"
        dz, s = b1(*args, **kwargs)
        made.append(weakref.ref(dz))
        return dz, s

    monkeypatch.setattr(ceb, "grad_logits_interpreted", recording)
    h, gamma, w, t, loss = _final_norm_ce_case(0, 20, 8, 100, "mean")
    hd, gd, wd = h.detach(), gamma.detach(), w.detach()
    a, r = hd * gd, rn_ref.rstd_ref(hd, 1e-5)
    logits = r[:, None] * (a @ wd)
    lse = torch.logsumexp(logits, -1)
    tl = logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
    scale = ceb.row_scale(t, -100, "mean", torch.ones(())).double()
    ceb.linear_cross_entropy_bwd_kernel(a, wd, r, lse, tl, t, scale, 24, SMALL, interpreted=True)
    assert len(made) == 5  # V = 100 in chunks of 24


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cross_entropy_chunked_loop(seed, reduction):
    """CE-C (interpreted F6' per row chunk, the softmax-gradient row kernel, B2'/B3') gives the
    loss and the g = 1 gradients of autograd, for every row-chunk size, the final norm's
    backward adding G's target entries (``head_norm_bwd_torch``)."""
    d = random_dims(seed, M=(1, 90), d=(1, 24), V=(2, 300), rows=(1, 40))
    h, gamma, w, t, loss = _final_norm_ce_case(seed, d["M"], d["d"], d["V"], reduction)
    loss.backward()
    from coda.kernels.final_norm_rows import head_norm_bwd_torch

    hd, gd, wd = h.detach(), gamma.detach(), w.detach()
    r = rn_ref.rstd_ref(hd, 1e-5)
    y, ones = hd * r[:, None] * gd, torch.ones_like(r)  # the normed operand, as the layer runs it
    one = torch.ones((), dtype=F64)
    weight = ceb.row_scale(t, -100, reduction, one)
    lse, tl, G, coef, S, dw = cec.linear_cross_entropy_chunked(
        y, wd, ones, t, weight, d["rows"], SMALL, interpreted=True
    )
    assert rel_err(ce_ref.ce_from_stats_ref(lse, tl, t, reduction=reduction), loss.detach()) < 1e-12
    dh, dgamma = head_norm_bwd_torch(G, coef, S, t, wd, hd, gd, r, one)
    assert rel_err(dh, h.grad) < 1e-12 and rel_err(dgamma, gamma.grad) < 1e-12
    assert rel_err(dw, w.grad) < 1e-12


@pytest.mark.parametrize("seed", range(3))
def test_drope_rows(seed):
    d = random_dims(seed, M=(1, 40), Hr=(1, 4), Hv=(1, 2), half=(1, 8))
    g, hd = gen(seed), 2 * d["half"]
    M, n_rot, n_v = d["M"], d["Hr"] * hd, d["Hv"] * hd
    pos = torch.randint(0, 5000, (M,), generator=g)
    freq = rope_ref.inv_freq(hd) / (2 * torch.pi)
    hi = freq.float()
    cos, sin = drope.rotation_tables(pos, hi, (freq - hi.double()).float(), hd)
    cs = rope_ref.rope_table(pos, hd)
    pre = rnd(g, M, n_rot + n_v)  # q, k (pre-rotation) and v
    qkv = torch.cat(
        [rope_ref.rope_adjacent_ref(pre[:, :n_rot].view(M, -1, hd), cs).flatten(1), pre[:, n_rot:]],
        1,
    )
    dqkv, r = rnd(g, M, n_rot + n_v), 0.5 + torch.rand(M, dtype=F64, generator=g)
    dz0, corr0 = drope.drope_rows(dqkv, qkv, r.float(), cos, sin, d["Hr"], hd, 11)
    d_pre = torch.cat(
        [
            rope_ref.rope_adjacent_bwd_ref(dqkv[:, :n_rot].view(M, -1, hd), cs).flatten(1),
            dqkv[:, n_rot:],
        ],
        1,
    )
    assert rel_err(dz0, r[:, None] * d_pre) < 1e-5  # fp32 arithmetic inside
    S0 = (d_pre * pre).sum(-1)  # the statistic over the pre-rotation values, times r/r
    assert rel_err(corr0, rn_ref.norm_corr_ref(r, S0 / r, 11)) < 1e-5


def _small_layer(dtype=F64, seed=0):
    torch.manual_seed(seed)
    layer = cnn.DecoderLayer(48, 4, 2, 80, head_dim=12, dtype=dtype)
    head = cnn.LMHeadLoss(48, 37, dtype=dtype)
    with torch.no_grad():
        for p in (layer.attention_norm, layer.ffn_norm, head.final_norm):
            p.add_(0.1 * torch.randn_like(p))
    return layer, head


def test_modules_reference_path_match_hf_layer_every_gradient():
    layer, head = _small_layer()
    s = L.LayerShape(2, 7, 48, 4, 2, 12, 80, 37)
    x = torch.randn(2, 7, 48, dtype=F64, requires_grad=True)
    t = torch.randint(0, 37, (2, 7))
    t[0, 3] = -100
    loss = head(layer(x), t)
    loss.backward()
    hf = {**layer.hf_state_dict(), **head.hf_state_dict()}
    w = {
        "wq": hf["self_attn.q_proj.weight"].t(),
        "wk": hf["self_attn.k_proj.weight"].t(),
        "wv": hf["self_attn.v_proj.weight"].t(),
        "wo": hf["self_attn.o_proj.weight"].t(),
        "wg": hf["mlp.gate_proj.weight"].t(),
        "wu": hf["mlp.up_proj.weight"].t(),
        "wd": hf["mlp.down_proj.weight"].t(),
        "w_lm": hf["lm_head.weight"].t(),
        "g1": hf["input_layernorm.weight"],
        "g2": hf["post_attention_layernorm.weight"],
        "gf": hf["model.norm.weight"],
    }
    w = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    x2 = x.detach().clone().requires_grad_(True)
    loss_hf = L.lm_head_loss_ref(L.llama_layer_ref(x2.view(14, 48), w, s), w, t.view(-1), s)
    loss_hf.backward()
    assert rel_err(loss, loss_hf) < 1e-13 and rel_err(x.grad, x2.grad) < 1e-12
    grads = L.from_coda_grads(
        {
            "wqkv": layer.w_qkv.grad,
            "wo": layer.w_o.grad,
            "w_il": layer.w_il.grad,
            "wd": layer.w_d.grad,
            "g1": layer.attention_norm.grad,
            "g2": layer.ffn_norm.grad,
            "w_lm": head.weight.grad.t(),
            "gf": head.final_norm.grad,
        },
        s,
    )
    for name in w:
        assert rel_err(grads[name], w[name].grad) < 1e-12, name


def test_hf_weights_round_trip_exactly():
    layer, head = _small_layer(torch.float32, seed=3)
    sd = {**layer.hf_state_dict("model.layers.0."), **head.hf_state_dict()}
    other, other_head = _small_layer(torch.float32, seed=4)
    other.load_hf_state_dict(sd, "model.layers.0.")
    other_head.load_hf_state_dict(sd)
    for a, b in zip(
        (*layer.parameters(), *head.parameters()), (*other.parameters(), *other_head.parameters())
    ):
        assert torch.equal(a, b)
    again = {**other.hf_state_dict("model.layers.0."), **other_head.hf_state_dict()}
    assert sd.keys() == again.keys() and all(torch.equal(sd[k], again[k]) for k in sd)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (48, 48)
    assert sd["lm_head.weight"].shape == (37, 48)


def test_module_dtype_mismatch_is_an_error():
    layer, _ = _small_layer(torch.float32)
    with pytest.raises(TypeError, match="x is torch.float64 but the parameters are"):
        layer(torch.zeros(1, 3, 48, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.complex64])
def test_layer_positions_must_be_integers(dtype):
    """Token positions of another dtype are refused, naming the rule: bool ones would
    otherwise rotate every token by position 0 or 1, a wrong result without an error."""
    layer, _ = _small_layer(torch.float32)
    with pytest.raises(coda.CodaInputError, match="positions: expected integer"):
        layer(torch.zeros(1, 3, 48), positions=torch.zeros(3, dtype=dtype))
    layer(torch.zeros(1, 3, 48), positions=torch.arange(3))  # the same call with integers runs


# -- level 2 ----------------------------------------------------------------------------------
COMPILES = {
    "dswiglu": lambda: dswiglu.compile_dswiglu(512, 768),
    "dgeglu": lambda: dswiglu.compile_dswiglu(512, 768, activation="gelu_tanh"),
    "norm_bwd": lambda: rmsnorm_bwd.compile_norm_bwd(1024, 512, residual=False),
    "norm_bwd_residual": lambda: rmsnorm_bwd.compile_norm_bwd(1024, 512, residual=True),
    "norm_bwd_fp32_gain": lambda: rmsnorm_bwd.compile_norm_bwd(
        1024, 512, residual=False, gamma=torch.float32
    ),
    "norm_bwd_residual_fp32_gain": lambda: rmsnorm_bwd.compile_norm_bwd(
        1024, 512, residual=True, gamma=torch.float32
    ),
    "ce_grad_logits": lambda: ceb.compile_grad_logits(256, 1000),
    "ce_grad_logits_capped": lambda: ceb.compile_grad_logits(256, 1000, capped=True),
    "ce_accumulate_fp32": lambda: ceb.compile_accumulate(1000, 512),
    "ce_dw_column_block": lambda: ceb.compile_dw_block(256, 2048),
    "wgrad_gamma_rows": lambda: wgrad.compile_wgrad_gamma_rows(512, 768),
    # an fp32 gain (``DecoderLayer(norm_offset=1.0)``: Gemma's 1 + w, formed in fp32)
    "wgrad_gamma_rows_fp32_gain": lambda: wgrad.compile_wgrad_gamma_rows(
        512, 768, gamma=torch.float32
    ),
    # Cleave's Split: the K = tokens loop cut in two, partials combined in split order
    "wgrad_gamma_rows_split_k": lambda: wgrad.compile_wgrad_gamma_rows(
        512, 768, config=GemmConfig(128, 192, 2, 1, False, split_k=2)
    ),
    "ce_chunked_logits": lambda: cec.compile_logits_chunk(256, 1000),
    "ce_chunked_g_fp32": lambda: cec.compile_g(256, 1000),
    "ce_chunked_dw_first": lambda: cec.compile_dw(256, 1000, accumulate=False),
    "ce_chunked_dw_accumulate": lambda: cec.compile_dw(256, 1000, accumulate=True),
    "ce_chunked_dw_accumulate_hf_layout": lambda: cec.compile_dw(
        256, 1000, accumulate=True, hf_layout=True
    ),
}


@pytest.mark.compile
@pytest.mark.parametrize("kernel", sorted(COMPILES))
def test_compiles_for_sm90(kernel):
    assert COMPILES[kernel]() in (0, 1)


# -- level 3 ----------------------------------------------------------------------------------
def _grads(model_fn, params, x):
    for p in (*params, x):
        p.grad = None
    loss = model_fn()
    loss.backward()
    return loss.detach(), [x.grad.clone()] + [p.grad.clone() for p in params]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["recompute", "chunked", "scaled_exp"])
@pytest.mark.parametrize(
    "B,S,d,H,Hkv,f,V",
    [
        (2, 1024, 1024, 8, 4, 2816, 32768),
        (1, 777, 512, 4, 2, 1408, 5120),
        # V / 128 odd: CE-S's dW GEMM (V x d, a 2 x 1 cluster) has a cluster half past V
        (1, 777, 512, 4, 2, 1408, 6272),
    ],
)
def test_gpu_layer_and_head_every_gradient(B, S, d, H, Hkv, f, V, method):
    """Kernel path (bf16) vs fp32 reference of the same modules; each gradient's error no worse
    than the plain PyTorch bf16 path's (the reference path run in bf16)."""
    assert_layer_and_head_protocol(B, S, d, H, Hkv, f, V, method)


def assert_layer_and_head_protocol(B, S, d, H, Hkv, f, V, method, skip=(), **layer_options):
    """CODA's protocol on one layer + LM head step (``test_gpu_layer_and_head_every_gradient``;
    ``layer_options``: more ``DecoderLayer`` arguments, e.g. ``activation``; ``skip``: the
    gradients a caller pools over seeds instead, as one-element ones)."""
    shape = (B, S, d, H, Hkv, f, V, method)
    (loss, loss_ref, loss_bf), grads = layer_and_head_step(*shape, 0, **layer_options)
    # the loss is one fp32 sum over M rows: its reduction-order noise (~1e-6 relative) is the
    # floor below which neither path is more accurate than the other
    floor = 1e-5 * abs(float(loss_ref))
    assert abs(loss - loss_ref) <= abs(loss_bf - loss_ref) + floor, (loss, loss_ref, loss_bf)
    worse = []
    for name, (got, ref, peer) in grads.items():
        e_k, e_t = fro_err(got, ref), fro_err(peer, ref)
        assert torch.isfinite(got).all(), name
        print(f"d{name}: coda {e_k:.3e}  torch bf16 {e_t:.3e}  ratio {e_k / e_t:.3f}")
        if e_k > e_t and name not in skip:
            worse.append(f"d{name} ({e_k / e_t:.3f})")
    assert not worse, "normalized error > 1: " + ", ".join(worse)


def layer_and_head_step(B, S, d, H, Hkv, f, V, method, seed, device="cuda", **layer_options):
    """One layer + LM head step at ``seed`` on the kernel path (bf16), and the same modules'
    reference path in fp32 and in bf16 (the plain PyTorch path): ((loss, fp32's, bf16's),
    {gradient name: (kernel path's, fp32's, bf16's)}). On the CPU (``cpu_numerics.py``) the
    kernel path is the interpreter's model of the GPU's roundings."""
    torch.manual_seed(seed)
    kw = {"device": device, **layer_options}
    layer = cnn.DecoderLayer(d, H, Hkv, f, backend="kernel", **kw)
    head = cnn.LMHeadLoss(d, V, device=device, backend="kernel", method=method)
    with torch.no_grad():
        for p in (*layer._norm_gains(), head.final_norm):  # (a post-norm layer's four)
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(B, S, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, V, (B, S), device=device)
    t[:, ::5] = -100
    params = [*layer.parameters(), *head.parameters()]
    loss, grads = _grads(lambda: head(layer(x), t), params, x)

    def variant(dtype, backend):
        lay = cnn.DecoderLayer(d, H, Hkv, f, dtype=dtype, backend=backend, **kw)
        hd = cnn.LMHeadLoss(d, V, device=device, dtype=dtype, backend=backend)
        with torch.no_grad():
            for a, b in zip((*lay.parameters(), *hd.parameters()), params):
                a.copy_(b)
        xx = x.detach().to(dtype).requires_grad_(True)
        return _grads(lambda: hd(lay(xx), t), [*lay.parameters(), *hd.parameters()], xx)

    loss_ref, grads_ref = variant(torch.float32, "reference")
    loss_bf, grads_bf = variant(torch.bfloat16, "reference")
    names = ["x"] + [n for n, _ in layer.named_parameters()] + ["final_norm", "w_lm"]
    return (loss, loss_ref, loss_bf), dict(zip(names, zip(grads, grads_ref, grads_bf)))


@pytest.mark.gpu
@pytest.mark.parametrize("qk_norm", [False, True])
def test_gpu_frozen_weights_give_the_same_other_gradients(qk_norm):
    """H200: with W_qkv and W_il frozen (their gradient GEMMs skipped), every other gradient
    of a bf16 layer step is bitwise the all-trainable step's (SDPA's math backend), and the
    frozen weights get none."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    layer = cnn.DecoderLayer(1024, 8, 4, 2816, head_dim=128, device="cuda", qk_norm=qk_norm)
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def grads():
        for p in (*layer.parameters(), x):
            p.grad = None
        with sdpa_kernel(SDPBackend.MATH):
            layer(x).backward(dy)
        return {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}

    want = grads()
    frozen = ("w_qkv", "w_il")
    for n, p in layer.named_parameters():
        p.requires_grad_(n not in frozen)
    got = grads()
    for name, g in want.items():
        if name in frozen:
            assert got[name] is None, name
        else:
            assert torch.equal(got[name], g), name


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["scaled_exp", "chunked", "recompute"])
def test_gpu_a_frozen_lm_head_gives_the_same_other_gradients(method):
    """H200: a frozen LM-head weight (no dW GEMM, no V x d accumulator): the loss, dX and
    dgamma bitwise the trainable head's, and no weight gradient."""
    torch.manual_seed(0)
    head = cnn.LMHeadLoss(1024, 8192, method=method, device="cuda")
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 8192, (2048,), device="cuda")
    t[::7] = -100

    def step():
        x.grad = head.final_norm.grad = head.weight.grad = None
        loss = head(x, t)
        loss.backward()
        return loss.detach(), x.grad, head.final_norm.grad

    want = step()
    head.weight.requires_grad_(False)
    got = step()
    assert head.weight.grad is None
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("V,d", [(32768, 2048), (128256, 4096), (1000, 24)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_weight_grad_cast_is_the_torch_form_bitwise(V, d, dtype):
    """H200: the LM head's dW cast (``weight_grad_from_acc`` through its Triton kernel) equals
    torch's ``(acc * g).to(dtype)`` bitwise in ``LMHeadLoss``'s layout, for bf16 weights and
    for fp32 ones (autocast's master weights), at the benchmark's shapes and an odd one."""
    g = torch.tensor(0.37, device="cuda")
    acc = torch.randn(V, d, device="cuda") * 50  # CE-S's (V, d)-major accumulator
    like = torch.empty(V, d, device="cuda", dtype=dtype).t()
    got = ceb.weight_grad_from_acc(acc.t(), g, like)
    assert got.stride() == like.stride() and got.dtype == dtype
    assert torch.equal(got, (acc.t() * g).to(dtype))
