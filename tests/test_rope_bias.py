"""F1 with Qwen2's q, k, v biases (``gemm_rope.rope_scaled_bias``) and the public op that runs
it (``coda.gemm_rope(..., bias=)``) at the levels of proof: the op's reference path equals
Qwen2's attention input in HF's conventions (float64), its kernel path runs the clipped
training program (the tile interpreter on the CPU), the program equals its float64 definition
through the interpreter, and on the H200 it is within one bf16 rounding of that definition, no
worse than PyTorch's bf16 form, its z within one rounding, and the public op's output the
training forward's bitwise. (The sm_90a compiles: ``test_forward_kernels.COMPILES`` and
``test_rope_loads_integer_positions_for_sm90``.)"""

import pytest
import torch
from conftest import fro_err, random_dims, rel_err
from test_forward_kernels import F64, _gpu_inputs, gen, randn

import coda
from coda import layouts
from coda.kernels import gemm_rope as rp
from coda.kernels.config import DEFAULT
from coda.kernels.tuned import config_for
from coda.reference import rope as rope_ref


@pytest.mark.parametrize("seed", range(3))
def test_gemm_rope_with_bias_is_qwen2_attention_input(seed):
    """``coda.gemm_rope(..., bias=)`` on HF weights and biases converted with coda.layouts
    equals Qwen2's q/k/v in HF's own conventions (each projection with its bias, then
    rotate_half RoPE), float64, biases of 4 (trained k biases' size): the op's reference
    path and the layouts agree (its kernel path: the next test, and ``test_gpu_rope_bias``)."""
    d = random_dims(seed, M=(1, 40), K=(1, 15), H=(1, 3), Hkv=(1, 2), half=(1, 6))
    g, hd = gen(seed), 2 * d["half"]
    M, K, Hkv = d["M"], 2 * d["K"], d["Hkv"]  # (K even: 16-byte rows on the kernel path)
    H = d["H"] * Hkv
    x, r = randn(g, M, K), 0.5 + torch.rand(M, dtype=F64, generator=g)
    wq, wk, wv = randn(g, H * hd, K), randn(g, Hkv * hd, K), randn(g, Hkv * hd, K)
    bq, bk, bv = randn(g, H * hd, scale=4), randn(g, Hkv * hd, scale=4), randn(g, Hkv * hd)
    pos = torch.randint(0, 500, (M,), generator=g)
    w_qkv = layouts.qkv_weight_from_hf(wq, wk, wv, n_heads=H, n_kv_heads=Hkv)
    bias_qkv = layouts.qkv_bias_from_hf(bq, bk, bv, n_heads=H, n_kv_heads=Hkv)
    kw = dict(head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=r)
    qkv = coda.gemm_rope(x, w_qkv, pos, bias=bias_qkv, **kw)
    y = r[:, None] * x
    theta = rope_ref.rope_angles(pos, hd)
    cos, sin = torch.cat([theta.cos()] * 2, -1)[:, None], torch.cat([theta.sin()] * 2, -1)[:, None]

    def head(w, b, n):
        return rope_ref.apply_rope_hf((y @ w.T + b).view(M, n, hd), cos, sin).flatten(1)

    nq, nk = H * hd, Hkv * hd
    assert rel_err(rope_ref.adjacent_to_hf_columns(qkv[:, :nq], H, hd), head(wq, bq, H)) < 1e-12
    got_k = rope_ref.adjacent_to_hf_columns(qkv[:, nq : nq + nk], Hkv, hd)
    assert rel_err(got_k, head(wk, bk, Hkv)) < 1e-12
    assert rel_err(qkv[:, nq + nk :], y @ wv.T + bv) < 1e-12
    plain = coda.gemm_rope(x, w_qkv, pos, **kw)  # the same signature without a bias: its own
    assert rel_err(plain[:, nq + nk :], y @ wv.T) < 1e-12


def test_gemm_rope_bias_kernel_path_runs_the_clipped_training_program(monkeypatch):
    """On the kernel path (forced on the CPU: the tile interpreter) ``bias=`` runs F1 with a
    bias, z's store clipped to one 16-byte row (``lean_z_cols``: no backward follows a
    public op), and returns its output: the reference's to bf16 round-off."""
    import coda.env
    from coda import ops

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    seen = []
    real = ops.lib.gemm_rope_bias
    monkeypatch.setattr(ops.lib, "gemm_rope_bias", lambda *a: seen.append(a[-1]) or real(*a))
    g, M, K, H, Hkv, hd = gen(5), 70, 32, 4, 2, 16
    bf = torch.bfloat16
    x, w = randn(g, M, K, dtype=bf), randn(g, K, (H + 2 * Hkv) * hd, dtype=bf, scale=K**-0.5)
    b, pos = randn(g, (H + 2 * Hkv) * hd, dtype=bf, scale=4), torch.arange(M) % 9
    got = coda.gemm_rope(x, w, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, bias=b)
    assert coda.last_path("gemm_rope")[0] == "kernel" and seen == [16]
    cs = rope_ref.rope_table(pos, hd)
    want = rope_ref.gemm_rope_ref(x.double(), w.double(), torch.ones(M), cs, H, Hkv, hd, b)
    assert got.dtype == bf and rel_err(got, want) < 2**-7


def test_a_bias_after_a_call_without_runs_its_own_checks():
    """The op's memo files a call by its every tensor argument, given or not: a call with a
    bias (or QK-norm weights) after one without, same shapes otherwise, is checked as new (a
    wrong-length bias named), not matched to the earlier call's verdict."""
    x, w, pos = torch.randn(8, 16), torch.randn(16, 48), torch.arange(8)
    kw = dict(head_dim=8, n_heads=2, n_kv_heads=2)
    plain = coda.gemm_rope(x, w, pos, **kw)
    with pytest.raises(coda.CodaInputError, match="bias: expected shape"):
        coda.gemm_rope(x, w, pos, bias=torch.ones(40), **kw)
    with pytest.raises(coda.CodaInputError, match="q_norm: expected shape"):
        coda.gemm_rope(x, w, pos, q_norm=torch.ones(6), k_norm=torch.ones(8), **kw)
    assert torch.equal(coda.gemm_rope(x, w, pos, **kw), plain)


def rope_bias_errors(M, K, H, Hkv, hd, device, dtype=torch.bfloat16, config=DEFAULT):
    """F1 with Qwen2's bias (``gemm_rope_bias_kernel``) against its float64 definition
    RoPE(r acc + b), with biases of 4 (trained k biases' size): (output's error, the PyTorch
    bf16 form's error (a Linear with its bias, then RoPE), z's error, whether the output with
    z's store clipped to one row (no backward follows) equals the training form's, and that
    clipped z its leading columns)."""
    g = torch.Generator().manual_seed(M + K)
    n = (H + 2 * Hkv) * hd
    x = torch.randn(M, K, generator=g).to(device, dtype)
    w = (torch.randn(K, n, generator=g) / K**0.5).to(device, dtype)
    r = (0.5 + torch.rand(M, generator=g)).to(device)
    b = (4 * torch.randn(n, generator=g)).to(device, dtype)
    pos = torch.arange(M) % 1024
    freq = rp.rope_freq_table(hd, H + Hkv, Hkv, device=device)
    pos_rows = pos.to(device, torch.float32)
    out, z_even, z_odd = rp.gemm_rope_bias_kernel(x, w, r, pos_rows, freq, b, config)
    lean, ze, zo = rp.gemm_rope_bias_kernel(x, w, r, pos_rows, freq, b, config, rp.lean_z_cols(n))
    cs = rope_ref.rope_table(pos, hd).to(device)
    z64 = r.double()[:, None] * (x.double() @ w.double())

    def rotated(z):
        qk = z[:, : (H + Hkv) * hd].reshape(M, H + Hkv, hd)
        return torch.cat([rope_ref.rope_adjacent_ref(qk, cs).flatten(1), z[:, (H + Hkv) * hd :]], 1)

    want = rotated(z64 + b.double())
    lin = (r[:, None].to(dtype) * (x @ w)) + b  # PyTorch's form, in the inputs' dtype
    z = torch.stack([z_even, z_odd], -1).flatten(1)
    return (
        fro_err(out, want),
        fro_err(rotated(lin.double()).to(dtype), want),
        fro_err(z, z64),
        torch.equal(lean, out) and torch.equal(ze, z_even[:, :8]) and torch.equal(zo, z_odd[:, :8]),
    )


def test_rope_bias_through_the_interpreter_float64():
    """``rope_bias_errors``'s own check on the CPU (the tile interpreter, float64): the
    program equals its definition to round-off (the angle's float-float turns: ~1e-14)."""
    out, _, z, same = rope_bias_errors(70, 24, 3, 1, 8, "cpu", torch.float64)
    assert out < 1e-12 and z < 1e-12 and same


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,H,Hkv,hd", [(4096, 896, 14, 2, 64), (1000, 512, 4, 2, 128)])
def test_gpu_rope_bias(M, K, H, Hkv, hd):
    """H200: F1 with a bias (Qwen2.5-0.5B's shape first) within one bf16 rounding of its
    float64 definition and no worse than PyTorch's bf16 form; z (kept for B11) within one
    rounding of r acc; the forward no backward follows (z's store clipped) and the public op
    write the same output bitwise."""
    cfg = config_for("rope", M, K, (H + 2 * Hkv) * hd)
    out, torch_err, z, same = rope_bias_errors(M, K, H, Hkv, hd, "cuda", config=cfg)
    assert same and z < 2**-8, (z, same)
    assert out < 2**-8 and out <= torch_err, (out, torch_err)
    # the public op (``coda.gemm_rope(bias=)``, int64 positions loaded as they are) writes
    # the training forward's output bitwise
    g, x, w, r = _gpu_inputs(M, K, (H + 2 * Hkv) * hd, 11)
    b = 4 * torch.randn((H + 2 * Hkv) * hd, device="cuda", generator=g).bfloat16()
    pos = torch.arange(M, device="cuda") % 1024
    kw = dict(head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=r, bias=b, backend="kernel")
    got = coda.gemm_rope(x, w, pos, **kw)
    freq = rp.rope_freq_table(hd, H + Hkv, Hkv, device="cuda")
    train = rp.gemm_rope_bias_kernel(x, w, r, pos.float(), freq, b, cfg)[0]
    assert coda.last_path("gemm_rope")[0] == "kernel" and torch.equal(got, train)
