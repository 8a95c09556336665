"""The hand-written Triton kernels against their torch oracles: B11's row passes
(``coda.kernels.row_passes`` vs ``drope.drope_heads``, ``drope.drope_bias_heads``,
``qk_norm.dqk_norm_rope_heads``), the
LM head's exact target entries (``coda.kernels.target_terms`` vs the torch form of
``add_target_terms``) and its final-norm backward with those entries folded in
(``coda.kernels.final_norm_rows`` vs ``head_norm_bwd_torch``): on the CPU through Triton's
interpreter (it must be switched on before triton is imported, so those cases run in a child
process), compiled for sm_90 without a GPU, and on the H200.

Cases: odd token counts that are not a multiple of the kernels' 64-row block, batch
boundaries inside a block, every head gradient layout attention produces (views of one
(B, S, heads, hd) buffer, or contiguous (B, heads, S, hd)), z whole or as its even/odd
columns, head_dim 6 to 128 (powers of two and not), float64 (to round-off) and bf16 (within
one bf16 step)."""

from __future__ import annotations

import pytest
import torch
import triton_child

CASES = [  # (B, S, H, Hkv, hd)
    (2, 37, 4, 2, 16),
    (1, 70, 3, 1, 8),
    (3, 5, 2, 2, 32),
    (1, 75, 2, 1, 128),  # (131 tokens: 7 s a dtype in the interpreter)
    (2, 11, 2, 2, 6),  # head_dims that are not powers of two (Triton pads the tile)
    (1, 67, 2, 1, 96),
]


def row_pass_case(B, S, H, Hkv, hd, dtype, device="cpu", contiguous_q=False, seed=0, shape=None):
    """Inputs of both passes, and the largest error of each output against its oracle, in
    units of the output's largest magnitude. ``shape``: the kernels' (rows per program,
    warps), else their default."""
    from coda.kernels.drope import drope_bias_heads, drope_heads
    from coda.kernels.qk_norm import dqk_norm_rope_heads
    from coda.kernels.row_passes import (
        dqk_norm_rope_heads_triton,
        drope_bias_heads_triton,
        drope_heads_triton,
    )

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
    out["drope"] = errs(drope_heads_triton(*args, shape=shape), drope_heads(*args))
    z, s = r(M, N), torch.rand(M, H + Hkv, generator=g, device=device, dtype=acc) + 0.5
    qn, kn = r(hd), r(hd)
    rest = (rstd, cos, sin, qn, kn, H, Hkv, hd, d)
    ref = dqk_norm_rope_heads(dq, dk, dv, z, s, *rest)
    n_rot = (H + Hkv) * hd
    # z's v columns from another buffer (the forward's stored v, a column slice of qkv)
    qkv_v = torch.cat([r(M, n_rot), z[:, n_rot:]], dim=1)
    z_v = qkv_v[:, n_rot:]
    whole = dqk_norm_rope_heads_triton(dq, dk, dv, z[:, :n_rot], None, z_v, s, *rest, shape=shape)
    out["qk_whole_z"] = errs(whole, ref)
    s_wide = torch.rand(M, N // hd, generator=g, device=device, dtype=acc)  # as F1 stores it
    s_wide[:, : H + Hkv] = s
    s_q = s_wide[:, : H + Hkv]
    for name, cols in (("qk_split_z", N), ("qk_split_z_rot", n_rot)):  # as wide as F1 keeps
        z_even, z_odd = z[:, 0:cols:2].contiguous(), z[:, 1:cols:2].contiguous()
        split = dqk_norm_rope_heads_triton(dq, dk, dv, z_even, z_odd, z_v, s_q, *rest, shape=shape)
        out[name] = errs(split, ref)
    # Hunyuan's gains after the rotation (z split as the training F1 keeps it)
    ref_post = dqk_norm_rope_heads(dq, dk, dv, z, s, *rest, post=True)
    post = dqk_norm_rope_heads_triton(
        dq, dk, dv, z_even, z_odd, z_v, s_q, *rest, shape=shape, post=True
    )
    out["qk_post"] = errs(post, ref_post)
    # with a QKV bias (Qwen2): the statistic on F1's stored z, the bias's gradient
    z_even, z_odd = z[:, 0::2].contiguous(), z[:, 1::2].contiguous()
    args = (dq, dk, dv, z_even, z_odd, rstd, cos, sin, d)
    out["bias"] = errs(drope_bias_heads_triton(*args, shape=shape), drope_bias_heads(*args))
    return out


def _bound(dtype):
    # float64: round-off; bf16: one rounding step of the output (the oracle rounds the same
    # fp32 value, summed in another order) and fp32 order for the statistics
    return 1e-13 if dtype == torch.float64 else 2**-7


TARGET_CASES = [  # (M, d, V, how the targets are drawn)
    (37, 24, 50, "uniform"),
    (200, 40, 7, "skewed"),  # runs longer than a program's 16 sorted rows
    (64, 520, 300, "one"),  # a single run over every row; d past one 512-column block
    (1500, 8, 9, "one"),  # one run over 94 chunks: six steps of the run pass's QB pieces
    (400, 40, 1000, "runs"),  # runs of 17: every one crosses a chunk's edge
    (33, 16, 90, "ignored"),  # every target ignored: nothing added
]


def target_terms_case(M, d, V, how, seed=0, device="cpu"):
    """Largest error of dW^T after the Triton form against the torch form, in units of the
    largest added term, and whether anything was added at all."""
    from coda.kernels.linear_cross_entropy_chunked import add_target_terms_torch
    from coda.kernels.target_terms import scatter_rows_triton

    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    a = torch.randn(M, d, generator=g, dtype=f64)
    if how == "skewed":
        target = (torch.rand(M, generator=g) ** 4 * V).long()
    elif how == "one":
        target = torch.full((M,), V // 2)
    elif how == "runs":
        target = torch.arange(M) // 17 % V
    else:
        target = torch.randint(0, V, (M,), generator=g)
    target[::5] = -100
    if how == "ignored":
        target[:] = -100
    coef = torch.randn(M, generator=g, dtype=f64) * (target >= 0)
    D0 = torch.randn(V, d, generator=g, dtype=f64)
    a, target, coef, D0 = (t.to(device) for t in (a, target, coef, D0))
    D1, D2 = D0.clone(), D0.clone()
    scatter_rows_triton(D1, a, target, coef)
    add_target_terms_torch(D2, a, target, coef)
    scale = max((D2 - D0).abs().max().item(), 1e-300)
    return (D1 - D2).abs().max().item() / scale, scale > 1e-300


HEAD_NORM_CASES = [(37, 24, 40), (64, 520, 300), (5, 256, 7), (4200, 40, 129)]  # (M, d, V)


def head_norm_case(M, d, V, dtype, seed=0, device="cpu", hf_layout=True, launch=None):
    """Largest error of (dh, dgamma) of the LM head's final-norm backward kernel (target
    entries folded in) against its torch form, in units of each output's largest magnitude:
    a third of the rows ignored (coef 0, target -100), W in HF's (V, d) storage or (d, V),
    row counts over and under the kernel's P row groups of BM rows."""
    from coda.kernels.final_norm_rows import head_norm_bwd_torch, head_norm_bwd_triton

    g = torch.Generator(device=device).manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32

    def rnd(*shape, dt=acc):
        return torch.randn(*shape, generator=g, device=device, dtype=dt)

    G, h = rnd(M, d), rnd(M, d, dt=dtype)
    w = rnd(V, d, dt=dtype).t() if hf_layout else rnd(d, V, dt=dtype)
    target = torch.randint(0, V, (M,), generator=g, device=device)
    target[::3] = -100
    coef, S = rnd(M) * (target >= 0), rnd(M) * d**0.5
    gamma, rstd = 1 + 0.1 * rnd(d, dt=dtype), rnd(M).abs() + 0.5
    up = torch.tensor(0.37, dtype=acc, device=device)
    got = head_norm_bwd_triton(G, coef, S, target, w, h, gamma, rstd, up, launch)
    ref = head_norm_bwd_torch(G, coef, S, target, w, h, gamma, rstd, up)
    return [((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            for a, b in zip(got, ref)]  # fmt: skip


def shape_case(rows: int) -> tuple:
    """(B, S, H, Hkv, hd) of the launch-shape case at ``rows`` rows per program: three
    sequences of rows - 1 tokens: 3 rows - 3 rows in all, so that every row count runs more
    than one program, the last one partial, with sequence boundaries inside programs (and
    the interpreter, whose cost is per program, runs two or three)."""
    return (3, rows - 1, 2, 1, 16)


# two children, run side by side (the interpreter's run is the suite's longest): the
# final-norm backward in float64, its launch shapes, the row passes' launch shapes and the
# target entries; then the final-norm backward in bf16 and the row passes' cases
_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_row_passes import CASES, HEAD_NORM_CASES, TARGET_CASES, head_norm_case
from test_row_passes import row_pass_case, shape_case, target_terms_case
from coda.kernels.row_passes import LAUNCH_SHAPES
from coda.kernels.final_norm_rows import LAUNCH_SHAPES as HEAD_SHAPES
PART = int(sys.argv[1])
out = []
for dtype in ((torch.float64,), (torch.bfloat16,))[PART]:
    for i, case in enumerate(HEAD_NORM_CASES):
        err = head_norm_case(*case, dtype, i, hf_layout=bool(i % 2))
        out.append(["head_norm " + str(dtype), case, {"err": err}])
if PART == 0:
    for launch in HEAD_SHAPES:  # every launch shape the probe times, rows over P row groups
        err = head_norm_case(4200, 40, 129, torch.float64, 9, launch=launch)
        out.append(["head_norm_launch", list(launch), {"err": err}])
    # every row count the launch shapes give (the interpreter runs a program as whole
    # arrays, so its warp count changes nothing here; every (rows, warps) compiles for sm_90
    # in test_row_passes_compile_at_every_launch_shape)
    for rows in sorted({bm for bm, _ in LAUNCH_SHAPES}):
        errs = row_pass_case(*shape_case(rows), torch.float64, shape=(rows, 1))
        out.append(["shape", rows, errs])
    for i, case in enumerate(TARGET_CASES):
        out.append(["target_terms", case, {"err": list(target_terms_case(*case, i))}])
else:
    for dtype in (torch.float64, torch.bfloat16):
        for i, case in enumerate(CASES):
            errs = row_pass_case(*case, dtype=dtype, contiguous_q=bool(i % 2), seed=i)
            out.append([str(dtype), case, errs])
print(json.dumps(out))
"""


def test_row_passes_in_triton_interpreter_equal_oracles():
    parts = triton_child.results_side_by_side(_CHILD, [["0"], ["1"]])
    results = [row for part in parts for row in part]
    from coda.kernels.row_passes import LAUNCH_SHAPES

    row_counts = {bm for bm, _ in LAUNCH_SHAPES}
    n_cases = len(row_counts) + 2 * len(CASES) + len(TARGET_CASES)
    from coda.kernels.final_norm_rows import LAUNCH_SHAPES as HEAD_SHAPES

    assert len(results) == n_cases + 2 * len(HEAD_NORM_CASES) + len(HEAD_SHAPES)
    for dtype, case, errs in results:
        if dtype == "target_terms":
            err, added = errs["err"]
            assert err <= 1e-13 and added == (case[3] != "ignored"), (case, err, added)
            continue
        bound = _bound(torch.bfloat16 if "bfloat16" in dtype else torch.float64)
        for name, e in errs.items():
            assert max(e) <= bound, (dtype, case, name, e)


def test_kernel_path_runs_the_triton_kernels_in_the_interpreter():
    """The layer's and LM head's whole kernel sequences (``test_kernel_path_cpu.py``, float64
    against the reference path) with B11 and the target entries run by the Triton kernels in
    the interpreter instead of their torch forms: the kernels' wiring into the autograd
    Functions (argument order, attention's gradient layouts), not only the kernels alone.
    A sign flipped in either kernel fails most of these cases."""
    cmd = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k"]
    cmd += ["layer_kernel_sequence or lm_head_kernel_sequence", "tests/test_kernel_path_cpu.py"]
    proc = triton_child.run(cmd)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "27 passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]


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
def test_target_terms_compile_for_sm90():
    from coda.kernels.target_terms import compile_target_terms

    assert all(n > 0 for n in compile_target_terms())


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_row_passes_compile_for_sm90(head_dim):
    from coda.kernels.row_passes import compile_row_passes

    assert all(n > 0 for n in compile_row_passes(head_dim))


@pytest.mark.compile
def test_row_passes_compile_with_gains_after_rope():
    """Hunyuan's QK-norm pass (``POST``: the gains after the rotation), at head_dim 128."""
    from coda.kernels.row_passes import compile_row_passes

    assert all(n > 0 for n in compile_row_passes(128, post=True))


@pytest.mark.compile
def test_row_passes_compile_for_gemma3_heads():
    """Gemma 3's heads: 256 wide, their QK-norm weights 1 + w in fp32."""
    from coda.kernels.row_passes import compile_row_passes

    assert all(n > 0 for n in compile_row_passes(256, head_w="fp32"))


# The launch-shape candidates (``LAUNCH_SHAPES``: what the probes sweep on the GPU, every one
# run in the interpreter above) compile here at the shape the kernels launch at and at the
# sweep's two ends: every candidate, 13 x 3 and 8 Triton compiles, took 79 s of the CPU suite
# with a cold Triton cache (session 78), for shapes no caller is handed.
@pytest.mark.compile
def test_head_norm_pass_compiles_at_its_launch_shape_and_the_sweeps_ends():
    from coda.kernels.final_norm_rows import LAUNCH, LAUNCH_SHAPES, compile_head_norm_bwd

    assert LAUNCH in LAUNCH_SHAPES
    for shape in (LAUNCH, LAUNCH_SHAPES[0], LAUNCH_SHAPES[-1]):
        assert compile_head_norm_bwd(shape) > 0, shape
    assert compile_head_norm_bwd(LAUNCH, gamma="fp32") > 0  # (an fp32 gain: Gemma's)


@pytest.mark.compile
def test_row_passes_compile_at_the_sweeps_ends():
    """(Their launch shapes, the tuned ones among them: ``test_row_passes_compile_for_sm90``.)"""
    from coda.kernels.row_passes import LAUNCH_SHAPES, compile_row_passes

    for shape in (LAUNCH_SHAPES[0], LAUNCH_SHAPES[-1]):
        assert all(n > 0 for n in compile_row_passes(128, shape=shape)), shape


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [(4, 1024, 32, 8, 64), (2, 2048, 16, 8, 128)])
def test_gpu_row_passes_equal_oracles(case):
    for dtype in (torch.float64, torch.bfloat16):
        for contiguous_q in (False, True):
            errs = row_pass_case(*case, dtype=dtype, device="cuda", contiguous_q=contiguous_q)
            for name, e in errs.items():
                assert max(e) <= _bound(dtype), (dtype, case, name, e)


@pytest.mark.gpu
@pytest.mark.parametrize("case", HEAD_NORM_CASES + [(16384, 2048, 32768), (4099, 4096, 128256)])
def test_gpu_head_norm_pass_equals_torch_form(case):
    for dtype in (torch.float64, torch.bfloat16):
        for hf_layout in (True, False):
            errs = head_norm_case(*case, dtype, device="cuda", hf_layout=hf_layout)
            assert max(errs) <= _bound(dtype), (dtype, case, hf_layout, errs)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["uniform", "skewed"])
def test_gpu_target_terms_equal_torch_form(how):
    err, added = target_terms_case(16384, 2048, 32768, how, device="cuda")
    assert added and err <= 1e-13, (how, err)


def test_tuned_launch_shapes_are_tested_candidates():
    """Every tuned (rows, warps) is one of the candidates the interpreter test runs."""
    from coda.kernels.row_passes import LAUNCH_SHAPES, TUNED

    assert TUNED and all(shape in LAUNCH_SHAPES for shape in TUNED.values()), TUNED


@pytest.mark.compile
def test_the_sass_reader_counts_a_compiled_pass():
    """``benchmarks/sass_row_passes.py`` (session 23's reading of the launch shapes) compiles a
    pass as the step specializes it and reads its registers and instructions back."""
    from benchmarks import sass_row_passes as sass

    c = sass.counts(sass.compiled("drope", 16, 2))
    assert c["registers"] > 0 and c["instructions"] > c["LDG"] > 0 and c["STG"] > 0, c


# -- the scatter's sort keys as one launch (``target_terms.sort_keys``) ---------------------------
KEY_CASES = [(1, 7), (100, 50), (4097, 1000), (20000, 128256)]  # (rows, V): off and on the block


def sort_keys_case(M, V, seed=0, device="cpu", dtype=torch.int64) -> bool:
    """The kernel's keys against the torch form, bitwise: indices in range, ignored (-100),
    padding at V and past it, the edges 0 and V - 1."""
    from coda.kernels.target_terms import sort_keys, sort_keys_torch

    g = torch.Generator().manual_seed(seed)
    index = torch.randint(-3, V + 3, (M,), generator=g)
    index[::7] = -100
    index[:2] = torch.tensor([0, V - 1])[: min(M, 2)]
    index = index.to(device=device, dtype=dtype)
    got, ref = sort_keys(index, V), sort_keys_torch(index, V)
    return got.dtype == ref.dtype == torch.int32 and torch.equal(got, ref)


_KEYS_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from triton_child import counted
from test_row_passes import KEY_CASES, sort_keys_case
from coda.kernels import target_terms
out = [sort_keys_case(*c, seed=i) for i, c in enumerate(KEY_CASES)]
out += [sort_keys_case(*c, seed=i, dtype=torch.int32) for i, c in enumerate(KEY_CASES)]
launched = counted(target_terms, "kernel")
index = torch.tensor([[3, -1], [9, 4]])
strided = target_terms.sort_keys(index[:, 0], 5)  # a strided index: the torch form
target_terms.sort_keys(index[:, 0].contiguous(), 5)  # contiguous: the kernel
print(json.dumps(out + [strided.tolist(), len(launched)]))
"""


def test_sort_keys_kernel_in_triton_interpreter_equals_torch_form():
    """The keys' Triton kernel in Triton's interpreter equals the torch form bitwise (int64 and
    int32 indices); ``sort_keys`` launches it for a contiguous index and only then."""
    *same, strided, launched = triton_child.results(_KEYS_CHILD)
    assert same == [True] * (2 * len(KEY_CASES))
    assert strided == [3, 5] and launched == 1


def test_sort_keys_comparison_can_fail():
    """A key that does not send an out-of-range index to V is caught by ``torch.equal``."""
    from coda.kernels.target_terms import sort_keys_torch

    index = torch.tensor([2, -100, 9])
    assert sort_keys_torch(index, 5).tolist() == [2, 5, 5]
    assert not torch.equal(sort_keys_torch(index, 5), index.clamp(0, 4).to(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M, V", [(16384, 128256), (4096, 32768), (333, 7)])
def test_gpu_sort_keys_kernel_equals_torch_form(M, V):
    assert sort_keys_case(M, V, device="cuda")
    assert sort_keys_case(M, V, device="cuda", dtype=torch.int32)
