"""B11's Triton row passes (``coda.kernels.row_passes``) against their torch oracles
(``drope.drope_heads``, ``qk_norm.dqk_norm_rope_heads``): on the CPU through Triton's
interpreter (it must be switched on before triton is imported, so those cases run in a child
process), compiled for sm_90 without a GPU, and on the H200.

Cases: odd token counts that are not a multiple of the kernels' 64-row block, batch
boundaries inside a block, every head gradient layout attention produces (views of one
(B, S, heads, hd) buffer, or contiguous (B, heads, S, hd)), z whole or as its even/odd
columns, head_dim 8 to 128, float64 (to round-off) and bf16 (within one bf16 step)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CASES = [  # (B, S, H, Hkv, hd)
    (2, 37, 4, 2, 16),
    (1, 70, 3, 1, 8),
    (3, 5, 2, 2, 32),
    (1, 131, 2, 1, 128),
]


def row_pass_case(B, S, H, Hkv, hd, dtype, device="cpu", contiguous_q=False, seed=0):
    """Inputs of both passes, and the largest error of each output against its oracle, in
    units of the output's largest magnitude."""
    from coda.kernels.drope import drope_heads
    from coda.kernels.qk_norm import dqk_norm_rope_heads
    from coda.kernels.row_passes import dqk_norm_rope_heads_triton, drope_heads_triton

    g = torch.Generator(device=device).manual_seed(seed)

    def r(*s, dt=dtype):
        return torch.randn(*s, generator=g, device=device, dtype=dt)

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    M, N, d = B * S, (H + 2 * Hkv) * hd, 3 * hd
    heads = r(B, S, H + 2 * Hkv, hd).transpose(1, 2)
    dq, dk, dv = heads[:, :H], heads[:, H : H + Hkv], heads[:, H + Hkv :]
    if contiguous_q:
        dq = dq.contiguous()
    rstd = torch.rand(M, generator=g, device=device, dtype=acc) + 0.5
    theta = r(M, hd // 2, dt=acc)
    cos, sin = theta.cos(), theta.sin()

    def errs(got, ref):
        return [((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
                for a, b in zip(got, ref)]  # fmt: skip

    out = {}
    qkv = r(M, N)
    args = (dq, dk, dv, qkv, rstd, cos, sin, H + Hkv, hd, d)
    out["drope"] = errs(drope_heads_triton(*args), drope_heads(*args))
    z, s = r(M, N), torch.rand(M, H + Hkv, generator=g, device=device, dtype=acc) + 0.5
    qn, kn = r(hd), r(hd)
    rest = (rstd, cos, sin, qn, kn, H, Hkv, hd, d)
    ref = dqk_norm_rope_heads(dq, dk, dv, z, s, *rest)
    out["qk_whole_z"] = errs(dqk_norm_rope_heads_triton(dq, dk, dv, z, None, s, *rest), ref)
    s_wide = torch.rand(M, N // hd, generator=g, device=device, dtype=acc)  # as F1 stores it
    s_wide[:, : H + Hkv] = s
    z_even, z_odd = z[:, 0::2].contiguous(), z[:, 1::2].contiguous()
    split = dqk_norm_rope_heads_triton(dq, dk, dv, z_even, z_odd, s_wide[:, : H + Hkv], *rest)
    out["qk_split_z"] = errs(split, ref)
    return out


def _bound(dtype):
    # float64: round-off; bf16: one rounding step of the output (the oracle rounds the same
    # fp32 value, summed in another order) and fp32 order for the statistics
    return 1e-13 if dtype == torch.float64 else 2**-7


_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_row_passes import CASES, row_pass_case
out = []
for dtype in (torch.float64, torch.bfloat16):
    for i, case in enumerate(CASES):
        errs = row_pass_case(*case, dtype=dtype, contiguous_q=bool(i % 2), seed=i)
        out.append([str(dtype), case, errs])
print(json.dumps(out))
"""


def test_row_passes_in_triton_interpreter_equal_oracles():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 2 * len(CASES)
    for dtype, case, errs in results:
        bound = _bound(torch.float64 if "float64" in dtype else torch.bfloat16)
        for name, e in errs.items():
            assert max(e) <= bound, (dtype, case, name, e)


def test_row_passes_detect_a_wrong_rotation():
    """The comparison above can fail: the oracle with the rotation's sign flipped differs."""
    from coda.kernels.drope import drope_rows, pack_heads

    torch.manual_seed(0)
    B, S, H, Hkv, hd = 1, 9, 2, 1, 8
    heads = torch.randn(B, H + 2 * Hkv, S, hd, dtype=torch.float64)
    dqkv = pack_heads(heads[:, :H], heads[:, H : H + Hkv], heads[:, H + Hkv :])
    qkv, rstd = torch.randn_like(dqkv), torch.rand(S, dtype=torch.float64) + 0.5
    theta = torch.randn(S, hd // 2, dtype=torch.float64)
    a = drope_rows(dqkv, qkv, rstd, theta.cos(), theta.sin(), H + Hkv, hd, 3 * hd)[0]
    b = drope_rows(dqkv, qkv, rstd, theta.cos(), -theta.sin(), H + Hkv, hd, 3 * hd)[0]
    assert (a - b).abs().max() > _bound(torch.float64) * a.abs().max()


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 128])
def test_row_passes_compile_for_sm90(head_dim):
    from coda.kernels.row_passes import compile_row_passes

    assert all(n > 0 for n in compile_row_passes(head_dim))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(4, 1024, 32, 8, 64), (2, 2048, 16, 8, 128)])
def test_gpu_row_passes_equal_oracles(case):
    for dtype in (torch.float64, torch.bfloat16):
        for contiguous_q in (False, True):
            errs = row_pass_case(*case, dtype=dtype, device="cuda", contiguous_q=contiguous_q)
            for name, e in errs.items():
                assert max(e) <= _bound(dtype), (dtype, case, name, e)
