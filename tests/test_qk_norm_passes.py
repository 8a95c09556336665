"""OLMo's QK-norm row passes (``coda.kernels.qk_norm_passes``: the norm over the whole q and k
projections, F1's row pass and B11) against their torch forms (``qk_norm.qk_norm_rope_rows``,
``qk_norm.dqk_norm_rope_heads_split_z``): on the CPU through Triton's interpreter (in a child
process: it must be on before triton is imported), compiled for sm_90 without a GPU, and on
the H200. Then the layer's kernel path running them, against its reference path.

Cases: odd token counts that are not a multiple of a program's rows, batch boundaries inside
a program, GQA and not, head_dim 6 to 128 (powers of two and not), attention's two gradient
layouts, z as the QKV GEMM's whole output or its q and k columns (a view), fp32 weights (OLMo's
``fp32_gains``), float64 (to round-off) and bf16 (within one bf16 step)."""

from __future__ import annotations

import pytest
import torch
import triton_child

CASES = [  # (B, S, H, Hkv, hd)
    (2, 37, 4, 2, 16),
    (1, 70, 3, 3, 8),
    (3, 5, 2, 1, 32),
    (1, 131, 2, 2, 128),
    (2, 11, 2, 1, 6),  # a head_dim that is not a power of two (Triton pads the tile)
]


def whole_case(B, S, H, Hkv, hd, dtype, device="cpu", seed=0, shape=None, fp32_w=False):
    """The largest error of each output of both passes against its torch form, in units of
    the output's largest magnitude: {"fwd": [...], "bwd": [...]}."""
    from coda.kernels.qk_norm import dqk_norm_rope_heads_split_z, qk_norm_rope_rows
    from coda.kernels.qk_norm_passes import dqk_norm_whole_triton, qk_norm_whole_triton

    g = torch.Generator(device=device).manual_seed(seed)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g, device=device, dtype=dt)

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    w_dt = acc if fp32_w else dtype
    M, N, n_rot, d = B * S, (H + 2 * Hkv) * hd, (H + Hkv) * hd, 3 * hd
    theta = r(M, hd // 2, dt=acc)
    cos, sin = theta.cos(), theta.sin()
    qn, kn = 1 + 0.3 * r(H * hd, dt=w_dt), 1 + 0.3 * r(Hkv * hd, dt=w_dt)

    def errs(got, ref):
        return [((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
                for a, b in zip(got, ref)]  # fmt: skip

    z = r(M, N)
    eps = 1e-6
    out = {"fwd": errs(
        qk_norm_whole_triton(z, qn, kn, cos, sin, H, Hkv, hd, eps, shape=shape),
        qk_norm_rope_rows(z, qn, kn, cos, sin, H, Hkv, hd, eps),
    )}  # fmt: skip
    heads = r(B, S, H + 2 * Hkv, hd).transpose(1, 2)
    dq, dk, dv = heads[:, :H], heads[:, H : H + Hkv], heads[:, H + Hkv :]
    if seed % 2:
        dq = dq.contiguous()
    s = torch.rand(M, 2, generator=g, device=device, dtype=acc) + 0.5
    rstd = torch.rand(M, generator=g, device=device, dtype=acc) + 0.5
    qkv_v = torch.cat([r(M, n_rot), z[:, n_rot:]], dim=1)  # the stored v, a column slice
    z_qk = z[:, :n_rot]  # z's q and k columns as the forward keeps them (a view)
    rest = (s, rstd, cos, sin, qn, kn, H, Hkv, hd, d)
    got = dqk_norm_whole_triton(dq, dk, dv, z_qk, qkv_v[:, n_rot:], *rest, shape=shape)
    ref = dqk_norm_rope_heads_split_z(dq, dk, dv, z_qk, None, qkv_v[:, n_rot:], *rest)
    assert [t.shape for t in got] == [t.shape for t in ref]
    out["bwd"] = errs(got, ref)
    return out


def _bound(dtype):
    return 1e-13 if dtype == torch.float64 else 2**-7


_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_qk_norm_passes import CASES, whole_case
out = []
for dtype in (torch.float64, torch.bfloat16):
    for i, case in enumerate(CASES):
        out.append([str(dtype), case, whole_case(*case, dtype, seed=i, fp32_w=i == 2)])
for rows in (1, 4, 16):  # other launch shapes: rows per program
    errs = whole_case(3, 2 * rows - 1, 2, 1, 16, torch.float64, shape=(rows, 1))
    out.append(["shape", rows, errs])
print(json.dumps(out))
"""


def test_qk_norm_whole_passes_in_triton_interpreter_equal_torch_forms():
    results = triton_child.results(_CHILD)
    assert len(results) == 2 * len(CASES) + 3
    for dtype, case, errs in results:
        bound = _bound(torch.bfloat16 if "bfloat16" in dtype else torch.float64)
        for name, e in errs.items():
            assert max(e) <= bound, (dtype, case, name, e)


_LAYER_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
import triton_child
import coda.env, coda.nn as cnn
from coda.kernels import qk_norm_passes as qp
calls = {n: triton_child.counted(qp, n) for n in ("qk_norm_whole_triton", "dqk_norm_whole_triton")}
coda.env.kernel_support = lambda device, dtype=None: (True, "")
torch.manual_seed(0)
layer = cnn.DecoderLayer(
    64, 4, 2, 48, head_dim=16, dtype=torch.float64, qk_norm="whole", post_norms=True,
    pre_norms=False, fp32_gains=True,
)
with torch.no_grad():
    for p in layer.parameters():
        p.add_(0.2 * torch.randn_like(p))
x = torch.randn(2, 9, 64, dtype=torch.float64, requires_grad=True)
dy = torch.randn_like(x)
res = []
for backend in ("reference", "kernel"):
    layer.backend = backend
    for p in (*layer.parameters(), x):
        p.grad = None
    y = layer(x)
    y.backward(dy)
    res.append([y.detach()] + [x.grad] + [p.grad for p in layer.parameters()])
errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(res[1], res[0])]
print(json.dumps({"errs": errs, "calls": {n: len(c) for n, c in calls.items()}}))
"""


def test_layer_kernel_path_runs_the_whole_qk_norm_kernels():
    """An OLMo-form layer's kernel path with both passes run by the Triton kernels (in the
    interpreter) equals its reference path in float64: the kernels' wiring into the layer
    (F1's row pass, B11 in the attention-input Function), not only the kernels alone."""
    out = triton_child.results(_LAYER_CHILD)
    assert out["calls"] == {"qk_norm_whole_triton": 1, "dqk_norm_whole_triton": 1}, out
    assert max(out["errs"]) < 1e-12, out["errs"]


@pytest.mark.compile
@pytest.mark.parametrize("head_dim, head_w", [(64, "bf16"), (128, "bf16"), (128, "fp32")])
def test_qk_norm_whole_passes_compile_for_sm90(head_dim, head_w):
    from coda.kernels.qk_norm_passes import compile_qk_norm_whole

    assert all(n > 0 for n in compile_qk_norm_whole(head_dim, head_w=head_w))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(4, 1024, 16, 16, 128), (2, 2048, 32, 8, 128)])
def test_gpu_qk_norm_whole_passes_equal_torch_forms(case):
    for dtype in (torch.float64, torch.bfloat16):
        for seed in (0, 1):  # (dq as a view of one buffer, then contiguous)
            errs = whole_case(*case, dtype, device="cuda", seed=seed, fp32_w=seed == 1)
            for name, e in errs.items():
                assert max(e) <= _bound(dtype), (dtype, case, name, e)
