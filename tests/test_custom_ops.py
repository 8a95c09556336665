"""The kernel path under torch.compile: every kernel launch is a ``torch.library`` custom op
(``coda.kernels.library``) with a fake implementation, so the layer's and LM head's autograd
Functions trace with no graph break. On the CPU the ops run the tile interpreter, which makes
this testable in CI: ``opcheck`` on every op (schema, fake-tensor shapes/dtypes/strides), and a
compiled kernel-path step equal to the eager one, bit for bit in float64."""

from __future__ import annotations

import pytest
import torch
from conftest import no_cache_warnings_from_dynamo, rel_err

import coda.nn as cnn
from coda.kernels import library, op_support
from coda.kernels.config import GemmConfig

CFG = [64, 32, 1, 1, 1, 8, 1]  # a small tile config (GemmConfig fields)
BF = torch.bfloat16


def _r(*s, dtype=BF):
    return torch.randn(*s).to(dtype)


def op_samples():
    M, K, N, f, d, V = 40, 48, 64, 32, 48, 80
    rstd = torch.rand(M) + 0.5
    t = torch.randint(0, V, (M,))
    t[::5] = -100
    lse = torch.randn(M).abs() + 3
    samples = {
        "gemm_rope": (_r(M, K), _r(K, N), rstd, torch.arange(M).float(), torch.randn(N), CFG),
        "gemm_qk_norm_rope": (
            _r(M, K),
            _r(K, N),
            rstd,
            torch.arange(M).float(),
            torch.randn(N),
            torch.randn(N),
            torch.zeros(N),
            32,  # (head_dim: a multiple of the epilogue's 32-column subtile)
            1e-6,
            CFG,
            None,
            None,
        ),
        "gemm_residual_rms": (_r(M, K), _r(K, N), _r(M, N), _r(N), 1e-5, CFG, _r(N)),
        "gemm_residual": (_r(M, K), _r(K, N), _r(M, N), CFG, None),
        "gemm_residual_add": (_r(M, K), _r(K, N), _r(M, N), CFG, [2, M // 2]),
        "gemm_output_sumsq": (_r(M, K), _r(K, N), CFG),
        # the norm after a sublayer: y, its partials (M, T), x0, fp32 gains (Gemma's 1 + w)
        "post_norm_rows": (_r(M, N), torch.rand(M, 2), _r(M, N), torch.randn(N), 1e-6, [2, 20]),
        "post_norm_next_rows": (
            _r(M, N),
            torch.rand(M, 2),
            _r(M, N),
            torch.randn(N),
            1e-6,
            torch.randn(N),
        ),  # fmt: skip
        "post_norm_bwd_rows": (_r(M, N), _r(M, N), torch.rand(M) + 0.5, _r(N)),
        "gemm_swiglu": (_r(M, K), _r(K, 2 * f), rstd, CFG, "gelu_tanh"),
        "gemm_swiglu_only": (_r(M, K), _r(K, 2 * f), rstd, CFG, "silu"),
        "gemm_scale_rows": (_r(M, K), _r(K, N), rstd, CFG),
        "lm_head_stats": (_r(M, d), _r(d, V), rstd, t, CFG, None),
        "dswiglu": (_r(M, d), _r(f, d), _r(M, 2 * f), rstd, CFG, "gelu_tanh"),
        # xIELU's B4: u one column per column of s, its (a_p, a_n, beta, eps)
        "dxielu": (_r(M, d), _r(f, d), _r(M, f), rstd, torch.tensor([0.8, 0.9, 0.5, -1e-6]), CFG),
        "norm_bwd": (_r(M, N), _r(d, N), _r(M, d), _r(d), torch.randn(M), _r(M, d), CFG),
        "wgrad_gamma_rows": (_r(M, d), _r(M, N), _r(d)),
        "lm_head_bwd": (
            _r(M, d),
            _r(d, V),
            rstd,
            lse,
            torch.randn(M),
            t,
            torch.rand(M),
            24,
            CFG,
            None,
            None,
            True,
            None,
        ),
        "lm_head_chunked": (
            _r(M, d),
            _r(d, V),
            torch.ones(M),
            t,
            torch.rand(M),
            16,
            CFG,
            0.1,
            1e-3,
            True,
        ),
        "lm_head_scaled": (  # V a multiple of 128 (its strips)
            _r(M, d),
            _r(d, 128),
            torch.ones(M),
            t,
            torch.rand(M),
            128,
            CFG,
            0.1,
            1e-3,
            False,  # (a frozen weight: no dW; the chunked op's row takes it)
        ),
    }
    B, S, H, Hkv, hd = 2, 5, 2, 1, 16  # attention's head gradients, as views of one buffer
    heads = _r(B, S, H + 2 * Hkv, hd).transpose(1, 2)
    dq, dk, dv = heads[:, :H], heads[:, H : H + Hkv], heads[:, H + Hkv :]
    rows, n_qkv = B * S, (H + 2 * Hkv) * hd
    theta = torch.randn(rows, hd // 2)
    rot = (torch.rand(rows) + 0.5, theta.cos(), theta.sin())
    samples["drope_rows"] = (dq, dk, dv, _r(rows, n_qkv), *rot, d)
    z_half = (_r(rows, n_qkv // 2), _r(rows, n_qkv // 2))  # F1's z with a QKV bias, kept whole
    samples["drope_bias_rows"] = (dq, dk, dv, *z_half, *rot, d)
    samples["dqk_norm_rows"] = (
        dq,
        dk,
        dv,
        _r(rows, (H + Hkv) * hd // 2),  # z on the q and k columns, as F1 keeps it
        _r(rows, (H + Hkv) * hd // 2),
        _r(rows, n_qkv)[:, (H + Hkv) * hd :],  # the stored v, a column slice of qkv
        torch.rand(rows, H + Hkv) + 0.5,
        *rot,
        _r(hd),
        _r(hd),
        d,
    )
    # F1's QK-norm row pass: Qwen3's per-head weights here (OLMo's: the test below)
    qk_rows = (_r(rows, n_qkv), _r(hd), _r(hd), rot[1], rot[2], H, Hkv, hd, 1e-6)
    samples["qk_norm_rows"] = qk_rows
    # a column-major x: the rows the Triton kernel does not take, whose torch form would keep
    # x's strides (the fake's row-major output must hold for them too)
    samples["norm_rows"] = (_r(d, M).t(), _r(d), 1e-5, True)
    tokens = torch.randint(0, V, (M,))
    samples["embedding_backward"] = (tokens, _r(M, d), V, int(tokens[0]))  # (a padding row)
    # the training variant of the QK-norm epilogue: the same inputs, and z kept on the first
    # 32 of N = 64 columns (the tiles past them clipped)
    samples["gemm_qk_norm_rope_keep_z"] = (*samples["gemm_qk_norm_rope"][:-2], 32, None, None)
    # F1 with Qwen2's QKV bias, z kept whole for the backward (clipped: the test below)
    samples["gemm_rope_bias"] = (*samples["gemm_rope"][:5], _r(N), CFG, N, None, None)
    return samples


@pytest.mark.parametrize("name", sorted(library.OPS))
def test_opcheck(name):
    args = op_samples()[name]
    torch.library.opcheck(library.OPS[name], args, test_utils=("test_schema", "test_faketensor"))


def test_lm_head_bwd_forms_dw_in_the_weights_storage():
    """The recompute backward given the (d, V) view of an ``nn.Linear``-style (V, d) weight
    forms dW in (V, d) rows (its transpose then is the gradient, no copy: run 290 spent 0.45
    to 3.9 ms a step on that copy) and equals the row-major form (to float32 round-off); the
    fake says the same."""
    args = op_samples()["lm_head_bwd"]
    w = args[1]
    wt = w.t().contiguous().t()  # the same values as a view of (V, d) rows
    G, S, dw = library.OPS["lm_head_bwd"](*args)
    G2, S2, dw2 = library.OPS["lm_head_bwd"](args[0], wt, *args[2:])
    assert dw.is_contiguous() and dw2.t().is_contiguous() and not dw2.is_contiguous()
    for got, want in ((G2, G), (S2, S), (dw2, dw)):  # (torch's CPU matmul rounds by layout)
        assert rel_err(got, want) < 1e-5
    with_view = (args[0], wt, *args[2:])
    torch.library.opcheck(
        library.OPS["lm_head_bwd"], with_view, test_utils=("test_schema", "test_faketensor")
    )


def test_opcheck_qk_norm_over_the_whole_projections():
    """F1's row pass and B11 with OLMo's QK-norm (weights of H hd and Hkv hd; z kept whole by
    F1's row-pass form, its statistic one column for q and one for k): the fakes' statistic
    and weight gradients take those shapes."""
    dq, dk, dv, _, _, z_v, _, *rot, _, _, d = op_samples()["dqk_norm_rows"]
    H, Hkv, hd = dq.shape[1], dk.shape[1], dq.shape[-1]
    rows = rot[0].shape[0]
    z = _r(rows, (H + Hkv) * hd)
    args = (dq, dk, dv, z, None, z_v, torch.rand(rows, 2) + 0.5, *rot, _r(H * hd), _r(Hkv * hd))
    out = library.OPS["dqk_norm_rows"](*args, d)
    assert [t.shape for t in out[2:]] == [(H * hd,), (Hkv * hd,)]
    torch.library.opcheck(
        library.OPS["dqk_norm_rows"], (*args, d), test_utils=("test_schema", "test_faketensor")
    )
    fwd = (_r(rows, (H + 2 * Hkv) * hd), args[-2], args[-1], *rot[1:], H, Hkv, hd, 1e-6)
    qkv, s = library.OPS["qk_norm_rows"](*fwd)
    assert qkv.shape == (rows, (H + 2 * Hkv) * hd) and s.shape == (rows, 2)
    torch.library.opcheck(
        library.OPS["qk_norm_rows"], fwd, test_utils=("test_schema", "test_faketensor")
    )


def test_opcheck_without_a_gate():
    """F4's and B4's ops for an MLP without a gate (relu2): s as wide as W_il, u (M, f)."""
    a, w, r, cfg, _ = op_samples()["gemm_swiglu"]
    for name in ("gemm_swiglu", "gemm_swiglu_only"):
        out = library.OPS[name](a, w, r, cfg, "relu2")
        s = out[0] if isinstance(out, tuple) else out
        assert s.shape == (a.shape[0], w.shape[1])
        torch.library.opcheck(
            library.OPS[name],
            (a, w, r, cfg, "relu2"),
            test_utils=("test_schema", "test_faketensor"),
        )
    dx, w_d, u, rstd, cfg, _ = op_samples()["dswiglu"]
    u = u[:, : w_d.shape[0]].contiguous()  # (one column of u per column of s)
    torch.library.opcheck(
        library.OPS["dswiglu"], (dx, w_d, u, rstd, cfg, "relu2"),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip


def test_opcheck_with_xielu():
    """F4's ops with xIELU's numbers (a (4,) fp32 tensor) and its own B4 op, ``dxielu``
    (the coefficients' gradient partials a fourth output, (2, M, T_N))."""
    a, w, r, cfg, _ = op_samples()["gemm_swiglu"]
    act = torch.tensor([0.8, 0.9, 0.5, -1e-6])
    for name in ("gemm_swiglu", "gemm_swiglu_only"):
        args = (a, w, r, cfg, "xielu", act)
        torch.library.opcheck(
            library.OPS[name], args, test_utils=("test_schema", "test_faketensor")
        )
    out = library.OPS["dxielu"](*op_samples()["dxielu"])
    assert out[3].shape == (2, *out[2].shape)  # (opcheck: ``test_opcheck``)


def test_opcheck_with_a_residual_scale():
    """F3 and F5 with a branch multiplier (Granite's): the scaled programs, a float argument."""
    rms = (*op_samples()["gemm_residual_rms"][:-1], None, 0.22)
    add = (*op_samples()["gemm_residual_add"], 0.22)
    for name, args in (("gemm_residual_rms", rms), ("gemm_residual_add", add)):
        torch.library.opcheck(
            library.OPS[name], args, test_utils=("test_schema", "test_faketensor")
        )


@pytest.mark.parametrize("name", ["lm_head_stats", "lm_head_bwd"])
def test_opcheck_with_a_logit_softcap(name):
    """The LM-head ops with a soft-cap (Gemma 2's): the capped programs."""
    args = (*op_samples()[name][:-1], 30.0)
    torch.library.opcheck(library.OPS[name], args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("want_dw", [False, True])
def test_opcheck_capped_three_gemm_program(want_dw):
    """CE-S's op with a soft-cap (its capped GEMM1, the target's slope), with and without dW."""
    args = (*op_samples()["lm_head_scaled"][:-1], want_dw, 30.0)
    torch.library.opcheck(
        library.OPS["lm_head_scaled"], args, test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize(
    "name", ["gemm_rope_bias", "gemm_qk_norm_rope", "gemm_qk_norm_rope_keep_z"]
)
def test_opcheck_with_multimodal_rope(name):
    """The F1 ops with multimodal RoPE's height and width rows and section flags."""
    args = op_samples()[name]
    M, N = args[0].shape[0], args[1].shape[1]
    sect = torch.randint(0, 2, (N,)).float()
    args = (*args[:-2], torch.arange(2 * M).float().view(2, M) % 7, sect)
    torch.library.opcheck(library.OPS[name], args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", ["gemm_qk_norm_rope", "gemm_qk_norm_rope_keep_z"])
def test_opcheck_with_gains_after_rope(name):
    """The QK-norm F1 ops with Hunyuan's gains after the rotation (``post_w``), and the two
    row passes with them (``post``)."""
    args = (*op_samples()[name], torch.randn(op_samples()[name][1].shape[1]))
    torch.library.opcheck(library.OPS[name], args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("name", ["dqk_norm_rows", "qk_norm_rows"])
def test_opcheck_row_passes_with_gains_after_rope(name):
    args = (*op_samples()[name], True)
    torch.library.opcheck(library.OPS[name], args, test_utils=("test_schema", "test_faketensor"))


def test_opcheck_gemm_rope_bias_with_z_clipped():
    """The bias op where no backward follows: z's store clipped to 16 columns."""
    args = (*op_samples()["gemm_rope_bias"][:-3], 16, None, None)
    torch.library.opcheck(
        library.OPS["gemm_rope_bias"], args, test_utils=("test_schema", "test_faketensor")
    )


def test_every_op_is_sampled():
    assert set(op_samples()) == set(library.OPS)


@pytest.mark.parametrize(
    "method,kind",
    [
        ("recompute", "llama"),
        ("chunked", "llama"),
        ("scaled_exp", "llama"),
        ("recompute", "qk_norm"),
        ("scaled_exp", "biases"),  # q, k, v and o biases (Llama's attention_bias=True)
        ("scaled_exp", "gemma3"),  # norms after each sublayer, QK-norm, 1 + w gains, GeGLU
        ("scaled_exp", "olmo"),  # norms after each sublayer only, QK-norm over all of q, k
        ("chunked", "granite"),  # each sublayer's output times 0.22 before its residual add
        ("recompute", "hunyuan"),  # the QK-norm of the rotated q and k
        ("scaled_exp", "arcee"),  # an MLP without a gate, relu(x)^2
        ("chunked", "apertus"),  # an MLP without a gate, xIELU (two learned scalars), QK-norm
    ],
)
def test_compiled_kernel_path_equals_eager_float64(method, kind):
    torch.manual_seed(0)
    F64 = torch.float64
    V = 128  # a multiple of 128 for scaled_exp's strips
    flags = dict(qk_norm=kind == "qk_norm", qkv_bias=kind == "biases", o_bias=kind == "biases")
    if kind == "gemma3":
        flags = dict(qk_norm=True, post_norms=True, norm_offset=1.0, activation="gelu_tanh")
    if kind == "olmo":
        flags = dict(qk_norm="whole", post_norms=True, pre_norms=False, fp32_gains=True)
    if kind == "granite":
        flags = dict(residual_scale=0.22)
    if kind == "hunyuan":
        flags = dict(qk_norm=True, qk_norm_after_rope=True)
    if kind == "arcee":
        flags = dict(activation="relu2")
    if kind == "apertus":
        flags = dict(activation="xielu", qk_norm=True)
    layer = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=F64, **flags)
    if kind in ("gemma3", "olmo", "hunyuan"):  # (gains away from their start: a lost one shows)
        with torch.no_grad():
            for p in (*layer._norm_gains(), layer.q_norm, layer.k_norm):
                p.normal_(0.0, 0.3)
    if kind == "biases":
        with torch.no_grad():
            layer.bias_qkv.normal_(0.0, 2.0)
            layer.bias_o.normal_()
    head = cnn.LMHeadLoss(40, V, method=method, chunk=50, dtype=F64, label_smoothing=0.1)
    params = [*layer.parameters(), *head.parameters()]
    x = torch.randn(2, 9, 40, dtype=F64, requires_grad=True)
    t = torch.randint(0, V, (18,))
    t[::4] = -100

    def step(x):
        return head._kernel_loss(layer._kernel_forward(x).reshape(-1, 40), t, "mean")

    with no_cache_warnings_from_dynamo():
        explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, [str(b.reason) for b in explained.break_reasons]
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (step, compiled):
        for p in (x, *params):
            p.grad = None
        loss = fn(x)
        loss.backward()
        results.append([loss.detach(), x.grad.clone(), *(p.grad.clone() for p in params)])
    for a, b in zip(*results):
        assert rel_err(a, b, floor=1e-300) < 1e-12


def test_compiled_step_runs_the_norms_as_coda_ops():
    """F0 and the final norm reach a traced step as ``coda::norm_rows`` (the kernel eager calls
    launch), not as torch forms for Inductor to regenerate (NOTES, session 44)."""
    torch.manual_seed(0)
    F64 = torch.float64
    layer = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=F64)
    head = cnn.LMHeadLoss(40, 128, method="scaled_exp", chunk=50, dtype=F64)
    x = torch.randn(2, 9, 40, dtype=F64, requires_grad=True)
    t = torch.randint(0, 128, (18,))
    targets = []

    def recording(gm, example_inputs):  # every call in the graph and its Function bodies
        for mod in gm.modules():
            if isinstance(mod, torch.fx.GraphModule):
                targets.extend(n.target for n in mod.graph.nodes if n.op == "call_function")
        return gm

    def step(x):
        return head._kernel_loss(layer._kernel_forward(x).reshape(-1, 40), t, "mean")

    with no_cache_warnings_from_dynamo():
        torch.compile(step, backend=recording, fullgraph=True)(x).backward()
    assert targets.count(torch.ops.coda.norm_rows.default) == 2  # F0, the final norm
    # OLMo's QK-norm row pass (F1's, forward) likewise: ``coda::qk_norm_rows``
    layer = cnn.DecoderLayer(40, 4, 2, 56, head_dim=10, dtype=F64, qk_norm="whole")
    targets.clear()
    with no_cache_warnings_from_dynamo():
        torch.compile(step, backend=recording, fullgraph=True)(x).backward()
    assert targets.count(torch.ops.coda.qk_norm_rows.default) == 1


def test_config_round_trip():
    for c in (GemmConfig(128, 192, 2, 1, True, 8), GemmConfig(128, 192, 2, 1, False, 8, 2)):
        assert op_support.config_of(op_support.config_ints(c)) == c
