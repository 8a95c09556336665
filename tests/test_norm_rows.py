"""RMSNorm's row kernels (``coda.kernels.norm_rows``: the entry norm F0, the final norm, the
AUX statistics A1 / A6 / A8, dgamma's column sums A7 / A9) against their torch forms: in
Triton's interpreter on the CPU (switched on before triton is imported, so in a child
process), compiled for sm_90 without a GPU, and on the H200. Also the host-side memo that
lets a stack of layers share its RoPE tables (``env.TensorMemo``).

Cases: token counts that are not a multiple of a program's rows, row widths that are not
powers of two, partial counts of 1, under one chunk and over several (the AUX loop), float64
(to round-off) and bf16 (within one bf16 step of the torch form)."""

from __future__ import annotations

import pytest
import torch
import triton_child

NORM_CASES = [(37, 24), (5, 1000), (130, 256), (3, 2048)]  # (M, d)
STAT_CASES = [(45, 1), (200, 17), (129, 64), (7, 150)]  # (M, T)
COL_CASES = [(1, 5), (37, 150), (129, 64), (200, 1000)]  # (T, N): dgamma's partials


def norm_case(M, d, dtype, device="cpu", seed=0) -> dict:
    """Largest error of each output of both norm kernels against the torch forms, in units of
    the output's largest magnitude."""
    from coda.kernels import norm_rows as nr

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, d, generator=g, device=device, dtype=dtype) * 3
    gamma = 1 + 0.1 * torch.randn(d, generator=g, device=device, dtype=dtype)
    out = {}
    for name, scaled, torch_form in (
        ("entry", False, nr.entry_norm_torch),
        ("final", True, nr.final_norm_torch),
    ):
        got = nr.norm_rows_triton(x, gamma, 1e-5, scaled)
        ref = torch_form(x, gamma, 1e-5)
        out[name] = [_rel(a, b) for a, b in zip(got, ref)]
        out[name + " dtypes"] = [str(a.dtype) == str(b.dtype) for a, b in zip(got, ref)]
    return out


def stat_case(M, T, dtype, device="cpu", seed=0) -> dict:
    from coda.kernels import norm_rows as nr

    g = torch.Generator(device=device).manual_seed(seed)
    P = torch.rand(M, T, generator=g, device=device, dtype=dtype) * 5
    if T > 1:
        P = P[:, : T - 1]  # a column slice: rows at a stride wider than their length
    rstd = torch.rand(M, generator=g, device=device, dtype=dtype) + 0.5
    out = {}
    for mode in (nr.RSTD, nr.CORR, nr.CORR_SCALED):
        got = nr.row_stat_triton(P, rstd, 40, 1e-5, mode)
        out[f"mode {mode}"] = [_rel(got, nr.row_stat_torch(P, rstd, 40, 1e-5, mode))]
    return out


def col_case(T, N, dtype, out_dtype, device="cpu", seed=0) -> dict:
    """dgamma's column sums: the kernel against the torch form, and its output dtype."""
    from coda.kernels import norm_rows as nr

    g = torch.Generator(device=device).manual_seed(seed)
    Q = torch.randn(T, N + 3, generator=g, device=device, dtype=dtype)[:, :N]  # strided rows
    got = nr.col_sums_triton(Q, out_dtype)
    ref = Q.sum(0).to(out_dtype)
    return {"col sums": [_rel(got, ref)], "col sums dtypes": [got.dtype == out_dtype]}


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _bound(dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 2.0**-7  # one bf16 step


_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_norm_rows import (
    COL_CASES, NORM_CASES, STAT_CASES, col_case, norm_case, stat_case, strided_rows_case
)
out = []
for dtype in (torch.float64, torch.bfloat16):
    for i, case in enumerate(NORM_CASES):
        out.append([str(dtype), case, norm_case(*case, dtype, seed=i)])
for dtype in (torch.float64, torch.float32):
    for i, case in enumerate(STAT_CASES):
        out.append([str(dtype), case, stat_case(*case, dtype, seed=i)])
for dtype, out_dtype in ((torch.float64, torch.float64), (torch.float32, torch.bfloat16)):
    for i, case in enumerate(COL_CASES):
        out.append([str(out_dtype), case, col_case(*case, dtype, out_dtype, seed=i)])
out.append(["fallback", None, strided_rows_case()])
print(json.dumps(out))
"""


def strided_rows_case() -> dict:
    """Rows the kernel does not take (a column stride other than 1) through the public entry
    points: the torch form's result, exactly, instead of the kernel's assertion."""
    from coda.kernels import norm_rows as nr

    x = torch.randn(24, 37, dtype=torch.float64).t()  # (37, 24) with column stride 37
    gamma = torch.rand(24, dtype=torch.float64) + 0.5
    got = [*nr.norm_rows(x, gamma, 1e-5, False), *nr.norm_rows(x, gamma, 1e-5, True)]
    ref = [*nr.entry_norm_torch(x, gamma, 1e-5), *nr.final_norm_torch(x, gamma, 1e-5)]
    return {"exact": [float(torch.equal(a, b)) for a, b in zip(got, ref)]}


def test_norm_rows_in_triton_interpreter_equal_torch_forms():
    results = triton_child.results(_CHILD)
    assert len(results) == 2 * (len(NORM_CASES) + len(STAT_CASES) + len(COL_CASES)) + 1
    assert results.pop()[2]["exact"] == [1.0] * 4
    for dtype, case, errs in results:
        fp32 = "float32" in dtype  # the AUX statistics in fp32, as the kernel path's
        bound = 1e-6 if fp32 else _bound(torch.bfloat16 if "bfloat16" in dtype else torch.float64)
        for name, e in errs.items():
            if name.endswith("dtypes"):
                assert all(e), (dtype, case, name)
            else:
                assert max(e) <= bound, (dtype, case, name, e)


def test_norm_rows_comparison_can_fail():
    """The comparison above detects a wrong statistic: the torch forms at another eps, or
    with the correction's sign flipped, differ beyond the bound."""
    from coda.kernels import norm_rows as nr

    torch.manual_seed(0)
    x, gamma = torch.randn(9, 24, dtype=torch.float64) * 0.01, torch.ones(24, dtype=torch.float64)
    a = nr.final_norm_torch(x, gamma, 1e-5)[1]
    b = nr.final_norm_torch(x, gamma, 1e-3)[1]
    assert _rel(a, b) > _bound(torch.float64)
    P, r = torch.rand(9, 5, dtype=torch.float64), torch.rand(9, dtype=torch.float64) + 0.5
    c = nr.row_stat_torch(P, r, 40, 0.0, nr.CORR)
    assert _rel(c, -c) > _bound(torch.float64)
    assert _rel(c, nr.row_stat_torch(P, r, 40, 0.0, nr.CORR_SCALED)) > _bound(torch.float64)


@pytest.mark.compile
@pytest.mark.parametrize("d", [1024, 2048, 4096, 8192])
def test_norm_rows_compile_for_sm90(d):
    from coda.kernels.norm_rows import compile_norm_rows

    assert all(size > 0 for size in compile_norm_rows(d))


@pytest.mark.compile
@pytest.mark.parametrize("d", [1152, 2048])  # (Gemma 3 1B's width, and a power of two)
def test_norm_rows_compile_for_sm90_with_an_fp32_gain(d):
    """The final norm and dgamma's column sums with an fp32 gain (Gemma's, and an fp32
    ``LMHeadLoss.final_norm`` under autocast): Triton specializes on the gain's dtype."""
    from coda.kernels.norm_rows import compile_norm_rows

    assert all(size > 0 for size in compile_norm_rows(d, gamma="fp32"))


def test_tensor_memo_keys_by_identity_version_and_args():
    from coda.env import TensorMemo

    calls = []

    def fn(t, k, other):
        calls.append(k)
        return t * k + other

    memo = TensorMemo(fn, maxsize=2)
    t, o = torch.arange(4.0), torch.ones(4)
    first = memo(t, 2, o)
    assert memo(t, 2, o) is first and calls == [2]  # remembered
    assert torch.equal(memo(t.clone(), 2, o), first) and calls == [2, 2]  # another tensor
    memo(t, 3, o)  # another plain argument
    memo(t, 2, o.clone())  # another tensor argument
    assert calls == [2, 2, 3, 2]
    t.add_(1)  # changed in place: its version moved
    assert torch.equal(memo(t, 2, o), t * 2 + o) and len(calls) == 5
    assert len(memo._memo) == 2  # bounded


def test_layer_stack_builds_rope_tables_once_per_positions(monkeypatch):
    """Layers given the same positions tensor share its float rows and their backward shares
    the cos/sin tables (``drope.cached_head_rotation``): one build per step, not per layer."""
    import coda.nn as cnn
    from coda.kernels import drope

    drope.cached_head_rotation.cache_clear()
    builds = []
    real = drope.cached_head_rotation.fn
    monkeypatch.setattr(drope.cached_head_rotation, "fn", lambda *a: builds.append(1) or real(*a))
    torch.manual_seed(0)
    layers = [cnn.DecoderLayer(32, 2, 1, 48, dtype=torch.float64) for _ in "ab"]
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])  # packed: restarts per document

    def stack(positions):  # the kernel path (the tile interpreter on the CPU)
        h = x
        for layer in layers:
            h = layer._kernel_forward(h, layer._positions(positions, 2, 5, x.device))
        return h

    stack(pos).sum().backward()
    assert len(builds) == 1, builds
    grad = x.grad.clone()
    x.grad = None
    stack(pos.clone()).sum().backward()  # new positions: built again, same result
    assert len(builds) == 2 and torch.equal(x.grad, grad)


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.float32, torch.int16, torch.float64]
)
def test_gemm_rope_casts_positions_at_most_once(monkeypatch, dtype):
    """``coda.gemm_rope`` on the kernel path (the tile interpreter on the CPU): int64, int32
    and float32 positions reach the epilogue as they are (it converts each value as it loads
    it: no cast at all); another dtype's float32 rows are made once per positions tensor
    (calls given the same tensor reuse them; a tensor changed in place or a new one is cast
    again). Every result equals the call's on the same positions in float32."""
    import coda
    import coda.env
    from coda.kernels import gemm_rope

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    gemm_rope.position_rows.cache_clear()
    casts = []
    real = gemm_rope.position_rows.fn
    monkeypatch.setattr(gemm_rope.position_rows, "fn", lambda *a: casts.append(1) or real(*a))
    torch.manual_seed(0)
    H, Hkv, hd, M, K = 2, 1, 8, 12, 16
    x = torch.randn(M, K).to(torch.bfloat16)
    w = (torch.randn(K, (H + 2 * Hkv) * hd) * K**-0.5).to(torch.bfloat16)
    pos = (torch.arange(M) % 5 + 1000).to(dtype)  # packed: restarts per document

    def call(p):
        with torch.no_grad():
            return coda.gemm_rope(x, w, p, head_dim=hd, n_heads=H, n_kv_heads=Hkv)

    per_call = 0 if dtype in gemm_rope.LOADED_POSITIONS else 1
    first = call(pos)
    assert coda.last_path("gemm_rope")[0] == "kernel"
    assert torch.equal(first, call(pos.to(torch.float32))) and len(casts) == per_call
    assert torch.equal(call(pos), first) and len(casts) == per_call  # remembered
    pos.add_(3)  # changed in place: cast again, and the rotation follows it
    moved = call(pos)
    assert len(casts) == 2 * per_call and not torch.equal(moved, first)
    assert torch.equal(moved, call(pos.clone())) and len(casts) == 3 * per_call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M,d", [(16384, 2048), (4097, 4096), (333, 8192), (77, 1000)])
def test_gpu_norm_rows_equal_torch_forms(M, d):
    """The compiled kernels on the H200 against the torch forms at the layers' widths: bf16
    outputs within one bf16 step, the fp32 statistics to fp32 round-off."""
    for name, e in norm_case(M, d, torch.bfloat16, "cuda").items():
        if name.endswith("dtypes"):
            assert all(e), name
        else:
            assert e[0] <= _bound(torch.bfloat16) and e[1] <= 1e-5, (name, e)
    for T in (1, d // 128, 3 * d // 128 + 1):
        for name, e in stat_case(M, T, torch.float32, "cuda").items():
            assert max(e) <= 1e-5, (T, name, e)
    for T in (1, M // 128 + 1):  # dgamma's partials: one per 128-token tile
        col = col_case(T, d, torch.float32, torch.bfloat16, "cuda")
        assert col["col sums dtypes"] == [True] and col["col sums"][0] <= _bound(torch.bfloat16)


def test_device_table_caches_keep_nothing_beyond_a_graph_capture(monkeypatch):
    """While a CUDA graph is captured, a device tensor built holds nothing until the graph
    replays: the tensor caches then keep nothing beyond the capture (``env.capturing`` stood
    in): nothing at all in a capture not coda's, and for the capture's length in one coda opens
    (``env.capture_memo``, ``GraphedStep``'s)."""
    from coda import env
    from coda.kernels import gemm_rope, qk_norm

    built = []
    memo = env.TensorMemo(lambda t: built.append(1) or t + 1)

    @env.host_cache(device_tensors=True)
    def table(n):
        built.append(1)
        return torch.zeros(n)

    t = torch.zeros(3)
    monkeypatch.setattr(env, "capturing", lambda t=None: True)
    for _ in range(2):
        memo(t), table(4)
    inv = torch.rand(4, dtype=torch.float64)
    assert gemm_rope.shared_freq_table(inv, (2, 1), "cpu") is not gemm_rope.shared_freq_table(
        inv, (2, 1), "cpu"
    )
    assert qk_norm._plain_row(4, 2, torch.float32, "cpu") is not qk_norm._plain_row(
        4, 2, torch.float32, "cpu"
    )
    assert len(built) == 4 and not memo._memo and table.cache_info().currsize == 0
    # inside coda's own capture (GraphedStep): once per capture, forgotten at its end
    for _ in range(2):
        with env.capture_memo():
            for _ in range(3):  # every layer of the captured step
                assert torch.equal(memo(t), t + 1) and torch.equal(table(4), torch.zeros(4))
            with env.capture_memo():  # a nested one starts empty and leaves the outer's
                memo(t)
            memo(t)
    assert len(built) == 4 + 2 * 3 and not memo._memo and table.cache_info().currsize == 0
    assert env._CAPTURE_MEMO is None
    monkeypatch.undo()
    for _ in range(2):
        memo(t), table(4)
    assert len(built) == 12  # outside a capture: each built once, then remembered
