"""GEMM1 of the GEMM-Residual-RMSNorm-GEMM block at all three levels of proof:
the program through the tile interpreter == the reference (CPU, float64, ragged tiles); the
kernel compiles for sm_90a (CPU, ``compile`` tests); the kernel on an SM90 GPU meets CODA's
error protocol (``gpu`` tests). Bad input raises a clear error."""

import pytest
import torch
from conftest import assert_no_worse, fro_err, random_dims, rel_err

import coda
from coda import env
from coda.kernels import gemm_residual_rms as kern
from coda.kernels.config import DEFAULT, GemmConfig
from coda.reference.rmsnorm import (
    gemm_residual_rms_ref,
    gemm_residual_rms_torch,
    sumsq_partials_ref,
)

SMALL = GemmConfig(tile_m=64, tile_n=32)


def inputs(M, K, N, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, dtype=dtype, device=device, generator=g)
    w = torch.randn(K, N, dtype=dtype, device=device, generator=g) / K**0.5
    res = torch.randn(M, N, dtype=dtype, device=device, generator=g)
    gamma = 1 + 0.1 * torch.randn(N, dtype=dtype, device=device, generator=g)
    return x, w, res, gamma


# -- level 1: the program equals the reference -------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_gamma", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("config", [SMALL, DEFAULT], ids=["64x32", "default"])
def test_interpreted_program_equals_reference(seed, with_gamma, with_bias, config):
    d = random_dims(seed, M=(1, 300), K=(1, 40), N=(1, 420))
    x, w, res, gamma = inputs(d["M"], d["K"], d["N"], seed=seed)
    gamma = gamma if with_gamma else None
    bias = 3 * torch.randn(d["N"], dtype=x.dtype) if with_bias else None
    h, a, r, parts = kern.gemm_residual_rms_interpreted(x, w, res, gamma, 1e-5, config, bias)
    h_ref, a_ref, r_ref = gemm_residual_rms_ref(x, w, res, gamma, 1e-5, bias)
    if with_bias:  # the bias is in h, not a no-op
        assert rel_err(h, gemm_residual_rms_ref(x, w, res, gamma, 1e-5)[0]) > 0.1
    assert rel_err(h, h_ref) < 1e-14 and rel_err(r, r_ref) < 1e-13
    assert parts.shape == (d["M"], config.grid(d["M"], d["N"])[1])
    assert rel_err(parts, sumsq_partials_ref(h_ref, config.tile_n)) < 1e-13
    assert (a is None) == (gamma is None)
    if gamma is not None:
        assert rel_err(a, a_ref) < 1e-14


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("config", [SMALL, DEFAULT], ids=["64x32", "default"])
def test_statistic_free_program_is_the_residual_gemm(seed, config):
    """``stats=False`` (a layer's down projection): h alone, as the program with the
    statistic computes it, and no partials."""
    d = random_dims(seed, M=(1, 300), K=(1, 40), N=(1, 420))
    x, w, res, _ = inputs(d["M"], d["K"], d["N"], seed=seed)
    h, a, parts = kern.epilogue_gemm(x, w, res, None, config, stats=False)
    assert a is None and parts is None
    assert rel_err(h, gemm_residual_rms_ref(x, w, res, None, 1e-5)[0]) < 1e-14


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("stats", [True, False], ids=["normed", "plain"])
def test_scaled_branch_programs_are_the_residual_plus_the_scaled_product(seed, stats):
    """``scale`` c (Granite's residual multiplier): h = residual + c (x @ w), with the
    normed output and its statistic (F3) or alone (F5), through the interpreter on a ragged
    tile grid; c = 1 runs the unscaled programs."""
    d = random_dims(seed, M=(1, 300), K=(1, 40), N=(1, 420))
    x, w, res, gamma = inputs(d["M"], d["K"], d["N"], seed=seed)
    gamma = gamma if stats else None
    c = 0.22
    h, a, parts = kern.epilogue_gemm(x, w, res, gamma, SMALL, stats=stats, scale=c)
    h_ref, a_ref, r_ref = gemm_residual_rms_ref(c * x, w, res, gamma, 1e-5)
    assert rel_err(h, h_ref) < 1e-14
    assert rel_err(h, gemm_residual_rms_ref(x, w, res, gamma, 1e-5)[0]) > 0.05  # (c applied)
    if stats:
        assert rel_err(a, a_ref) < 1e-14
        assert rel_err(parts, sumsq_partials_ref(h_ref, SMALL.tile_n)) < 1e-13
    plain = kern.program_for(gamma, stats)
    assert kern.program_for(gamma, stats, scaled=True) is not plain


def test_public_op_reference_path_on_cpu():
    x, w, res, gamma = inputs(37, 24, 56, dtype=torch.bfloat16)
    out = coda.gemm_residual_rms(x, w, res, gamma, eps=1e-6)
    h, a, r = gemm_residual_rms_ref(x, w, res, gamma, eps=1e-6)
    assert coda.last_path("gemm_residual_rms")[0] == "reference"
    assert out.h.dtype == torch.bfloat16 and out.rstd.dtype == torch.float32
    assert torch.equal(out.h, h.bfloat16()) and torch.equal(out.normed, a.bfloat16())
    assert torch.equal(out.rstd, r)
    # the deferred scale identity, through the public op
    w2 = torch.randn(56, 40, dtype=torch.float64)
    y = out.rstd.double()[:, None] * (out.normed.double() @ w2)
    canon = torch.nn.functional.rms_norm(out.h.double(), (56,), gamma.double(), 1e-6) @ w2
    assert rel_err(y, canon) < 2e-2  # the bf16 roundings of h and h*gamma differ; bound 2^-6


def test_public_op_with_a_bias_is_the_biased_projection():
    """``bias=``: h = residual + (x @ w + bias), the reference path; a wrong length is named."""
    x, w, res, gamma = inputs(37, 24, 56)
    b = torch.randn(56, dtype=torch.float64)
    out = coda.gemm_residual_rms(x, w, res, gamma, eps=1e-6, bias=b)
    lin = torch.nn.functional.linear(x, w.t(), b)
    assert rel_err(out.h, res + lin) < 1e-14 and rel_err(out.normed, (res + lin) * gamma) < 1e-14
    want = torch.nn.functional.rms_norm(res + lin, (56,), None, 1e-6) / (res + lin)
    assert rel_err(out.rstd[:, None].expand(-1, 56), want) < 1e-12
    with pytest.raises(coda.CodaInputError, match=r"bias: expected shape \(w.shape\[1\],\)"):
        coda.gemm_residual_rms(x, w, res, gamma, bias=b[:-1])


def test_reference_path_is_reported_once():
    import warnings

    env._WARNED.clear()
    x, w, res, _ = inputs(8, 8, 8, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        coda.gemm_residual_rms(x, w, res)
        coda.gemm_residual_rms(x, w, res)
    msgs = [str(r.message) for r in rec if issubclass(r.category, coda.CodaReferencePathWarning)]
    assert len(msgs) == 1 and "reference path" in msgs[0] and "cpu" in msgs[0]


# -- level 2: the kernel compiles for sm_90a ---------------------------------------------------
@pytest.mark.compile
@pytest.mark.parametrize("with_gamma", [False, True])
@pytest.mark.parametrize("w_major", ["n", "k"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_compiles_for_sm90(with_gamma, w_major, with_bias):
    kw = dict(gamma=with_gamma, w_major=w_major, bias=with_bias)
    assert kern.compile_gemm_residual_rms(256, 520, **kw) in (0, 1)
    # M, N and K are dynamic: another problem size reuses the same compiled kernel
    assert kern.compile_gemm_residual_rms(512, 1032, m=1000, **kw) == 0


@pytest.mark.compile
def test_an_fp32_gain_compiles_for_sm90():
    """F3 with an fp32 gain (``DecoderLayer(norm_offset=1.0)``: Gemma's 1 + w, formed in
    fp32): a compile of its own (the gain's dtype is in the key), then reused."""
    kw = dict(gamma=True, gamma_dtype=torch.float32)
    assert kern.compile_gemm_residual_rms(256, 520, **kw) in (0, 1)
    assert kern.compile_gemm_residual_rms(512, 1032, m=1000, **kw) == 0


@pytest.mark.compile
def test_statistic_free_program_compiles_for_sm90():
    assert kern.compile_gemm_residual_rms(256, 520, gamma=False, stats=False) in (0, 1)
    assert kern.compile_gemm_residual_rms(512, 1032, gamma=False, stats=False, m=1000) == 0


@pytest.mark.compile
@pytest.mark.parametrize("stats", [True, False], ids=["normed", "plain"])
def test_scaled_branch_programs_compile_for_sm90(stats):
    """The scaled-branch programs (F3 with the gain and statistic, F5 without): c is a launch
    argument, so another value (and another size) reuses the compiled kernel."""
    kw = dict(gamma=stats, stats=stats)
    assert kern.compile_gemm_residual_rms(256, 520, scale=0.22, **kw) in (0, 1)
    assert kern.compile_gemm_residual_rms(512, 1032, m=1000, scale=0.5, **kw) == 0


# -- bad input ------------------------------------------------------------------------------
def test_bad_shapes_and_devices():
    x, w, res, gamma = inputs(16, 24, 32, dtype=torch.float32)
    with pytest.raises(coda.CodaInputError, match=r"w: dim 0 must equal x.shape\[1\] = 24"):
        coda.gemm_residual_rms(x, w[:20], res)
    with pytest.raises(coda.CodaInputError, match=r"residual: dim 1 must equal w.shape\[1\]"):
        coda.gemm_residual_rms(x, w, res[:, :30])
    with pytest.raises(coda.CodaInputError, match=r"gamma: expected shape \(w.shape\[1\],\)"):
        coda.gemm_residual_rms(x, w, res, gamma[:5])
    with pytest.raises(coda.CodaInputError, match="x: expected a 2-D tensor"):
        coda.gemm_residual_rms(x[None], w, res)
    with pytest.raises(coda.CodaInputError, match="one device; got x on cpu, w on meta"):
        coda.gemm_residual_rms(x, w.to("meta"), res)
    with pytest.raises(coda.CodaInputError, match="one dtype"):
        coda.gemm_residual_rms(x, w.double(), res)
    with pytest.raises(coda.CodaInputError, match="x: dtype must be one of"):
        coda.gemm_residual_rms(x.int(), w.int(), res.int())
    with pytest.raises(coda.CodaInputError, match="backend: must be one of"):
        coda.gemm_residual_rms(x, w, res, backend="fast")


@pytest.mark.parametrize("eps", ["1e-5", None, 0.0, -1e-5, float("inf"), float("nan"), True])
def test_a_bad_eps_is_named(eps):
    """eps, a plain argument of the signature: refused by its rule on the first call with it,
    not a TypeError from the norm or a NaN in the result."""
    x, w, res, gamma = inputs(16, 24, 32, dtype=torch.float32)
    w2 = torch.randn(32, 8)
    with pytest.raises(coda.CodaInputError, match="eps: must be a finite positive number"):
        coda.gemm_residual_rms(x, w, res, gamma, eps=eps)
    with pytest.raises(coda.CodaInputError, match="eps: must be a finite positive number"):
        coda.gemm_rmsnorm_gemm(x, w, res, gamma, w2, eps=eps)
    coda.gemm_rmsnorm_gemm(x, w, res, gamma, w2, eps=1e-6)  # the rule, not the signature


def test_kernel_backend_refuses_cpu():
    x, w, res, _ = inputs(16, 24, 32, dtype=torch.bfloat16)
    with pytest.raises(coda.UnsupportedDeviceError, match="tensors are on cpu"):
        coda.gemm_residual_rms(x, w, res, backend="kernel")


def test_unsupported_gpu_is_named(monkeypatch):
    env.kernel_support.cache_clear()  # the capability is cached per device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    ok, reason = env.kernel_support(torch.device("cuda", 0))
    assert not ok and "NVIDIA A100 is sm_80" in reason and "SM90" in reason
    with pytest.raises(coda.UnsupportedDeviceError, match="sm_80"):
        env.resolve_backend("gemm_residual_rms", "kernel", torch.device("cuda", 0))
    env.kernel_support.cache_clear()


@pytest.fixture
def pretend_sm90(monkeypatch):
    """Route the CPU call to the kernel path and stop at the kernel: what reaches it passed
    every kernel-path check."""
    from coda.kernels import library

    monkeypatch.setattr(env, "kernel_support", lambda device, dtype=None: (True, ""))
    reached = []
    monkeypatch.setattr(library, "gemm_residual_rms", lambda *a: reached.append(a) or (None,) * 3)
    partials = torch.ones(1, 1)  # what the AUX after the kernel reduces
    monkeypatch.setattr(library, "gemm_residual", lambda *a: reached.append(a) or (None, partials))
    return reached


@pytest.mark.parametrize("with_gamma", [False, True])
def test_kernel_path_with_a_bias_runs_the_bias_program(with_gamma, monkeypatch):
    """``bias=`` on the kernel path (forced on the CPU: the tile interpreter, bf16) runs the
    bias program (with or without the norm gain) and returns the reference's h to one bf16
    rounding; a non-contiguous bias is named."""
    monkeypatch.setattr(env, "kernel_support", lambda device, dtype=None: (True, ""))
    x, w, res, gamma = inputs(40, 24, 32, dtype=torch.bfloat16)
    gamma = gamma if with_gamma else None
    bias = (4 * torch.randn(64)).bfloat16()[::2]  # (strided: refused below)
    with pytest.raises(coda.CodaInputError, match="bias: must be contiguous"):
        coda.gemm_residual_rms(x, w, res, gamma, bias=bias)
    bias = bias.contiguous()
    out = coda.gemm_residual_rms(x, w, res, gamma, bias=bias)
    assert coda.last_path("gemm_residual_rms")[0] == "kernel"
    h, a, r = gemm_residual_rms_ref(x, w, res, gamma, bias=bias)
    assert rel_err(out.h, h) < 2**-8 and rel_err(out.rstd, r) < 1e-3
    assert (out.normed is None) == (gamma is None)
    plain = coda.gemm_residual_rms(x, w, res, gamma)  # the same signature without: its own
    assert rel_err(plain.h, gemm_residual_rms_ref(x, w, res, gamma)[0]) < 2**-8


def test_kernel_path_rejects_dtype_and_tma_alignment(pretend_sm90):
    x, w, res, gamma = inputs(16, 24, 32, dtype=torch.bfloat16)
    with pytest.raises(coda.CodaInputError, match=r"x: dtype must be one of \[torch.bfloat16\]"):
        coda.gemm_residual_rms(x.float(), w.float(), res.float())
    xk, wk = torch.randn(16, 20).bfloat16(), torch.randn(20, 32).bfloat16()
    with pytest.raises(coda.CodaInputError, match="x: rows must be 16-byte aligned.*multiple of 8"):
        coda.gemm_residual_rms(xk, wk, res)
    wn = torch.randn(24, 44).bfloat16()[:, :40]  # a view whose rows are 88 B apart
    with pytest.raises(coda.CodaInputError, match="w: rows must be 16-byte aligned"):
        coda.gemm_residual_rms(x, wn, torch.randn(16, 40).bfloat16())
    with pytest.raises(coda.CodaInputError, match="residual: the TMA needs a unit stride"):
        coda.gemm_residual_rms(x, w, res.t().contiguous().t())
    assert not pretend_sm90
    coda.gemm_residual_rms(x, w, res, gamma)  # a k-major weight view is also fine:
    coda.gemm_residual_rms(x, w.t().contiguous().t(), res)
    assert len(pretend_sm90) == 2


# -- level 3: the kernel on an SM90 GPU --------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(4096, 2048, 2048), (1000, 512, 1032), (333, 256, 520)])
@pytest.mark.parametrize("with_gamma", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_error_protocol(M, K, N, with_gamma, with_bias):
    """CODA's protocol: each output's error vs the fp32 reference is no worse than the plain
    PyTorch bf16 path's (with a bias: a ``Linear``'s, then the residual add). M and N include
    sizes that are not tile multiples."""
    x, w, res, gamma = inputs(M, K, N, dtype=torch.bfloat16, device="cuda", seed=M + N)
    gamma = gamma if with_gamma else None
    bias = res[0] if with_bias else None  # (a residual-sized bias)
    out = coda.gemm_residual_rms(x, w, res, gamma, bias=bias, backend="kernel")
    torch.cuda.synchronize()
    ref = gemm_residual_rms_ref(x, w, res, gamma, bias=bias)
    peer = gemm_residual_rms_torch(x, w, res, gamma, bias=bias)
    for name, got, r, p in zip(("h", "normed", "rstd"), out, ref, peer):
        if r is None:
            continue
        assert_no_worse(name, got, r, p)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(4096, 2048, 2048), (1000, 512, 1032)])
@pytest.mark.parametrize("stats", [True, False], ids=["normed", "plain"])
def test_scaled_branch_kernel_error_protocol(M, K, N, stats):
    """The scaled-branch programs (Granite's residual multiplier c = 0.22) on the GPU: h and
    the normed output no worse vs the fp32 reference than HF's bf16 form (the product
    rounded, times c rounded, then the add)."""
    x, w, res, gamma = inputs(M, K, N, dtype=torch.bfloat16, device="cuda", seed=M + 1)
    gamma, c = (gamma if stats else None), 0.22
    h, a, _ = kern.epilogue_gemm(x, w, res, gamma, DEFAULT, stats=stats, scale=c)
    torch.cuda.synchronize()
    ref = gemm_residual_rms_ref(c * x.float(), w.float(), res.float(), gamma)
    peer_h = res + (x @ w) * c
    assert_no_worse("h", h, ref[0], peer_h)
    if stats:
        assert_no_worse("normed", a, ref[1], peer_h * gamma)


@pytest.mark.gpu
def test_kernel_serves_any_m_without_recompiling():
    from coda import _quack

    compile_fn = _quack._modules()["host"]._compile_gemm_epi
    x, w, res, gamma = inputs(512, 256, 384, dtype=torch.bfloat16, device="cuda")
    coda.gemm_residual_rms(x, w, res, gamma, backend="kernel")
    before = compile_fn.cache_info().misses
    for m in (1, 7, 129, 300, 511):
        out = coda.gemm_residual_rms(x[:m], w, res[:m], gamma, backend="kernel")
        ref = gemm_residual_rms_ref(x[:m], w, res[:m], gamma)
        assert fro_err(out.h, ref[0]) < 1e-2
    assert compile_fn.cache_info().misses == before
