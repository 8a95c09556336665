"""CE-S's row passes (``coda.kernels.ce_scaled_rows``: the strip u, xs = c a, the glue's
per-row values, the final norm's statistic S): each Triton kernel in Triton's interpreter
against its torch form (level 1, in a child process: ``triton_child``), its sm_90 compile
(level 2) and on the H200 at the LM heads' shapes (level 3). The passes inside the whole
method: tests/test_ce_scaled_exp.py."""

from __future__ import annotations

import pytest
import torch

from coda.kernels import ce_scaled_rows as rows
from coda.kernels.linear_cross_entropy_chunked import target_coef

# -- the strip u as a Triton pass (``strip_u_triton``) --------------------------------------------
STRIP_CASES = [(1, 1, 64), (37, 3, 192), (130, 5, 128), (300, 7, 256), (129, 668, 192)]


def strip_case(C, t_n, tile_n, seed=0, device="cpu") -> bool:
    """The kernel's u against the torch form, bitwise: k integer-valued (as GEMM1's rounded
    tile statistic), some tiles > 100 below their row's max (the floor), padded token counts."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randint(-30, 30, (C, t_n), generator=g, device=device).float()
    k[:, 0] -= 150.0 * (torch.rand(C, generator=g, device=device) < 0.3)  # floored tiles
    K = k.amax(dim=1)
    got = rows.strip_u_triton(k, K, tile_n, torch.bfloat16)
    ref = rows.strip_u_torch(k, K, tile_n, torch.bfloat16)
    return got.shape == ref.shape and torch.equal(got, ref)


_STRIP_CHILD = """
import json, sys
sys.path.insert(0, "tests")
from test_ce_scaled_rows import STRIP_CASES, strip_case
print(json.dumps([strip_case(*c, seed=i) for i, c in enumerate(STRIP_CASES)]))
"""


def test_strip_kernel_in_triton_interpreter_equals_torch_form():
    import triton_child

    assert triton_child.results(_STRIP_CHILD) == [True] * len(STRIP_CASES)


def test_strip_comparison_can_fail():
    """A strip off by one power of two anywhere is caught: ``torch.equal`` on the powers."""
    k = torch.tensor([[0.0, -3.0]])
    u = rows.strip_u_torch(k, k.amax(1), 128, torch.bfloat16)
    assert u.shape == (4, 1) and u[:, 0].tolist() == [1.0, 1.0, 0.125, 0.125]
    assert not torch.equal(u, rows.strip_u_torch(k - 1.0, k.amax(1), 128, torch.bfloat16))


@pytest.mark.compile
@pytest.mark.parametrize("tile_n", [64, 128, 192, 256])
def test_strip_kernel_compiles_for_sm90(tile_n):
    assert rows.compile_strip_u(tile_n) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("C, t_n, tile_n", [(4096, 668, 192), (16384, 171, 192), (333, 7, 256)])
def test_gpu_strip_kernel_equals_torch_form(C, t_n, tile_n):
    """At the LM heads' chunk shapes (Llama's V = 128256 at 4096 tokens; V = 32768 at 16384)."""
    assert strip_case(C, t_n, tile_n, device="cuda")


# -- xs = c (.) a as a Triton pass (``row_scaled_triton``) ----------------------------------------
# (rows, d): one row, rows and columns off the block (8 x 512), a chunk of whole blocks
ROW_SCALE_CASES = [(1, 1), (7, 100), (37, 513), (129, 1000), (16, 1024)]


def row_scale_case(C, D, seed=0, device="cpu", dtype=torch.bfloat16) -> float:
    """The kernel's xs against the torch form: the largest difference in units of the torch
    form's last place (0 where bitwise equal). c spans signs, zeros (ignored rows) and 40
    binades; a includes values that round differently once scaled."""
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(C, D, generator=g, device=device).to(dtype)
    c = torch.randn(C, generator=g, device=device) * torch.exp2(
        torch.randint(-20, 20, (C,), generator=g, device=device).float()
    )
    c[::5] = 0.0
    got, ref = rows.row_scaled_triton(a, c), rows.row_scaled_torch(a, c)
    assert got.shape == ref.shape and got.dtype == ref.dtype and got.is_contiguous()
    ulp = torch.finfo(dtype).eps * ref.double().abs().clamp(min=torch.finfo(dtype).tiny)
    return float(((got.double() - ref.double()).abs() / ulp).max()) if got.numel() else 0.0


_ROW_SCALE_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from triton_child import counted
from test_ce_scaled_rows import ROW_SCALE_CASES, row_scale_case
from coda.kernels import ce_scaled_rows as rows
out = [row_scale_case(*c, seed=i) for i, c in enumerate(ROW_SCALE_CASES)]
out += [row_scale_case(*c, seed=i, dtype=torch.float32) for i, c in enumerate(ROW_SCALE_CASES)]
launched = counted(rows, "row_scaled_triton")
a, c = torch.randn(9, 40).bfloat16(), torch.randn(9)
got, ref = rows.row_scaled(a, c).double(), rows.row_scaled_torch(a, c).double()  # the kernel
close = bool(((got - ref).abs() <= ref.abs() * 2.0**-7).all())  # within one bf16 step
rows.row_scaled(a.t().contiguous().t(), c)  # column-major: the torch form
print(json.dumps(out + [close, len(launched)]))
"""


def test_row_scale_kernel_in_triton_interpreter_equals_torch_form():
    """xs's Triton kernel in Triton's interpreter against ``(c[:, None] * a).to(a.dtype)``:
    fp32 rows bitwise, bf16 rows within one bf16 step (the interpreter truncates where the GPU
    rounds to nearest even; on the H200 the test below is bitwise), at sizes off and on the
    block; ``row_scaled`` launches it for a contiguous ``a`` (and ``c``) and only then."""
    import triton_child

    results = triton_child.results(_ROW_SCALE_CHILD)
    *ulps, close, launched = results
    n = len(ROW_SCALE_CASES)
    assert all(u <= 1.0 for u in ulps[:n]), ulps[:n]  # bf16: truncation, at most one step
    assert ulps[n:] == [0.0] * n  # fp32 out: the product itself, bitwise
    assert launched == 1 and close


def test_row_scale_comparison_can_fail():
    """A row scaled by the wrong factor is caught by the case's measure."""
    a, c = torch.randn(4, 8).bfloat16(), torch.ones(4)
    ref = rows.row_scaled_torch(a, c)
    wrong = rows.row_scaled_torch(a, c * 1.01)
    ulp = torch.finfo(torch.bfloat16).eps * ref.double().abs().clamp(min=1e-30)
    assert ((wrong.double() - ref.double()).abs() / ulp).max() > 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("C, D", [(16384, 2048), (4096, 4096), (333, 1000)])
def test_gpu_row_scale_kernel_equals_torch_form(C, D):
    """At the LM heads' chunk shapes (d = 2048 at 16384 tokens; d = 4096 at 4096) and an odd
    one: bitwise, bf16 and fp32 rows."""
    assert row_scale_case(C, D, device="cuda") == 0.0
    assert row_scale_case(C, D, device="cuda", dtype=torch.float32) == 0.0


# -- the glue's per-row values as a Triton pass (``scaled_glue_triton``) --------------------------
# (rows, N-tiles, z_loss, label smoothing): rows and tiles off the block (16 x 128), one tile,
# several steps of the running max, the options
GLUE_CASES = [(1, 1, 0.0, 0.0), (37, 171, 0.0, 0.0), (130, 300, 1e-4, 0.1), (16, 668, 0.0, 0.0)]


def glue_inputs(C, t_n, seed=0, device="cpu"):
    """GEMM1's statistics as it writes them (k integer-valued, per-tile sums in [1, tile_n
    sqrt 2], the rising maxima in later tiles too), ignored rows (weight 0), and on even rows
    a confident prediction: one tile far above the rest with lse near 0, so that l_y - lse
    is a small number held to full precision (expm1's case: p_y - 1 near 0)."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.randint(-40, 40, (C, t_n), generator=g, device=device).float()
    k += torch.arange(t_n, device=device) % 7 == 3  # maxima late in the row
    s = 1.0 + 100.0 * torch.rand(C, t_n, generator=g, device=device)
    k[::2], s[::2, -1] = k[::2] - 80.0, 1.0  # confident rows: the last tile holds lse ~ 0
    k[::2, -1] = 0.0
    lse = rows.lse_from_scaled(s, k)
    y = (
        lse
        - torch.rand(C, generator=g, device=device)
        * torch.tensor([1e-6, 10.0], device=device)[torch.arange(C, device=device) % 2]
    )
    rstd = 0.5 + torch.rand(C, generator=g, device=device)
    w = torch.full((C,), 1.0 / max(C, 1), device=device)
    w[::3] = 0.0
    return s, k, y, rstd, w


def glue_case(C, t_n, z_loss, smoothing, seed=0, device="cpu") -> list[float]:
    """Each of the kernel's four outputs against the torch form: K's largest difference (0:
    exact), lse's relative to |lse| + 1, c's relative to c, and coef's relative to coef as the
    torch form gives it from the kernel's own lse (its target term e^(l_y - lse) - 1 is near
    0 on half the rows, where l_y - lse inherits lse's rounding in either form: this isolates
    the kernel's expm1, which a plain e^x - 1 fails by orders of magnitude)."""
    s, k, y, rstd, w = glue_inputs(C, t_n, seed, device)
    got = rows.scaled_glue_triton(s, k, y, rstd, w, z_loss, smoothing)
    ref = rows.scaled_glue(s, k, y, rstd, w, z_loss, smoothing)
    coef_ref = target_coef(y, got[0], rstd, w, smoothing, z_loss)
    if not C:
        return [0.0] * 4

    def rel(a, b, scale):
        return float(((a.double() - b.double()).abs() / scale.double().clamp(min=1e-30)).max())

    return [
        rel(got[1], ref[1], torch.ones_like(ref[1])),
        rel(got[0], ref[0], ref[0].abs() + 1.0),
        rel(got[2], ref[2], ref[2].abs()),
        rel(got[3], coef_ref, coef_ref.abs()),
    ]


_GLUE_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from triton_child import counted
from test_ce_scaled_rows import GLUE_CASES, glue_case, glue_inputs
from coda.kernels import ce_scaled_rows as rows
out = [glue_case(*c, seed=i) for i, c in enumerate(GLUE_CASES)]
launched = counted(rows, "scaled_glue_triton")
s, k, y, rstd, w = glue_inputs(9, 5)
rows.glue_pass(s, k, y, rstd, w, 0.0, 0.0)  # contiguous rows: the kernel
strided = torch.stack([rstd, rstd], 1)[:, 0]
ref = rows.scaled_glue(s, k, y, strided, w, 0.0, 0.0)
got = rows.glue_pass(s, k, y, strided, w, 0.0, 0.0)  # a strided rstd: the torch form
same = all(torch.equal(a, b) for a, b in zip(got, ref))
print(json.dumps(out + [[len(launched), same]]))
"""


def test_glue_kernel_in_triton_interpreter_equals_torch_form():
    """The glue's Triton kernel in Triton's interpreter (Kahan's expm1 there, libdevice's on
    the GPU) against the torch form: K exact, lse, c and coef to fp32 round-off (coef
    relative to itself, its target term near 0 on half the rows); ``glue_pass`` takes it for
    contiguous rows and only then."""
    import triton_child

    *cases, (launched, strided_same) = triton_child.results(_GLUE_CHILD)
    assert launched == 1 and strided_same  # glue_pass: the kernel for contiguous rows only
    for K_err, lse_err, c_err, coef_err in cases:
        assert K_err == 0.0 and lse_err < 1e-6 and c_err < 1e-5 and coef_err < 1e-5


def test_glue_comparison_can_fail():
    """A glue off by one tile's sum is caught by the case's measure."""
    s, k, y, rstd, w = glue_inputs(8, 5)
    ref = rows.scaled_glue(s, k, y, rstd, w, 0.0, 0.0)
    s2 = s.clone()
    s2[:, 0] *= 1.5
    bad = rows.scaled_glue(s2, k, y, rstd, w, 0.0, 0.0)
    assert float(((bad[2] - ref[2]).abs() / ref[2].abs().clamp(min=1e-30)).max()) > 1e-5


@pytest.mark.compile
@pytest.mark.parametrize("compiled", ["compile_row_scaled", "compile_scaled_glue"])
def test_xs_and_glue_kernels_compile_for_sm90(compiled):
    assert getattr(rows, compiled)() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("C, t_n", [(16384, 171), (4096, 668), (333, 7)])
def test_gpu_glue_kernel_equals_torch_form(C, t_n):
    """At the LM heads' chunk shapes (V = 32768 at 16384 tokens; V = 128256 at 4096) and an
    odd one, with and without the options: as on the CPU."""
    for z_loss, smoothing in ((0.0, 0.0), (1e-4, 0.1)):
        K_err, lse_err, c_err, coef_err = glue_case(C, t_n, z_loss, smoothing, device="cuda")
        assert K_err == 0.0 and lse_err < 1e-6 and c_err < 1e-5 and coef_err < 1e-5


# -- the final norm's statistic from dX's row-dot partials (``norm_stat_rows_triton``) -------------
# (rows, partials): one row, rows off the block (128) and partials off its step (16), d = 2048's
# 8 partials at 16384 rows, d = 4096's 16, an empty call
NORM_STAT_CASES = [(1, 1), (37, 8), (130, 17), (300, 40), (16384, 8), (256, 16), (0, 8)]


def norm_stat_inputs(C, T, seed=0, device="cpu", dtype=torch.float32):
    """Partials of both signs, so that some rows' S cancels near 0; ignored rows (coef 0)."""
    g = torch.Generator(device=device).manual_seed(seed)
    part = torch.randn(C, T, generator=g, device=device, dtype=dtype)
    rstd = 0.2 + torch.rand(C, generator=g, device=device, dtype=dtype)
    coef = torch.randn(C, generator=g, device=device, dtype=dtype)
    coef[::4] = 0.0
    y = 5.0 * torch.randn(C, generator=g, device=device, dtype=dtype)
    return part, rstd, coef, y


def norm_stat_case(C, T, seed=0, device="cpu", dtype=torch.float32) -> float:
    """The kernel's S against the torch form, normwise relative to the torch form's largest
    |S| (rows whose S cancels to ~0 differ relatively by the partials' summation order alone)."""
    args = norm_stat_inputs(C, T, seed, device, dtype)
    got, ref = rows.norm_stat_rows_triton(*args), rows.norm_stat_rows_torch(*args)
    assert got.shape == ref.shape == (C,) and got.dtype == ref.dtype
    if not C:
        return 0.0
    return float((got - ref).abs().max() / ref.abs().max())


_NORM_STAT_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from triton_child import counted
from test_ce_scaled_rows import NORM_STAT_CASES, norm_stat_case, norm_stat_inputs
from coda.kernels import ce_scaled_rows as rows
out = [norm_stat_case(*c, seed=i) for i, c in enumerate(NORM_STAT_CASES)]
out += [norm_stat_case(*c, seed=i, dtype=torch.float64) for i, c in enumerate(NORM_STAT_CASES)]
launched = counted(rows, "norm_stat_rows_triton")
part, rstd, coef, y = norm_stat_inputs(9, 5)
rows.norm_stat_rows(part, rstd, coef, y)  # contiguous tables: the kernel
strided = torch.stack([rstd, rstd], 1)[:, 0]
same = torch.equal(rows.norm_stat_rows(part, strided, coef, y),
                   rows.norm_stat_rows_torch(part, strided, coef, y))  # the torch form
print(json.dumps(out + [len(launched), same]))
"""


def test_norm_stat_kernel_in_triton_interpreter_equals_torch_form():
    """S's Triton kernel in Triton's interpreter against the torch form (the partials' sum, then
    ``norm_stat_from_dot``): to fp32 and float64 round-off of the largest |S| at every case
    (its divisions correctly rounded, as torch's; only the partials' summation order differs);
    ``norm_stat_rows`` launches it for contiguous tables and only then."""
    import triton_child

    *errs, launched, strided_same = triton_child.results(_NORM_STAT_CHILD)
    n = len(NORM_STAT_CASES)
    assert all(e < 1e-6 for e in errs[:n]), errs[:n]
    assert all(e < 1e-14 for e in errs[n:]), errs[n:]
    assert launched == 1 and strided_same


def test_norm_stat_comparison_can_fail():
    """A statistic missing its target term (coef l_y / r), or divided by r once, is caught."""
    part, rstd, coef, y = norm_stat_inputs(64, 8)
    ref = rows.norm_stat_rows_torch(part, rstd, coef, y)
    no_target = rows.norm_stat_rows_torch(part, rstd, torch.zeros_like(coef), y)
    once = rows.norm_stat_rows_torch(part, rstd, coef, y) * rstd
    assert float((no_target - ref).abs().max() / ref.abs().max()) > 1e-3
    assert float((once - ref).abs().max() / ref.abs().max()) > 1e-3


@pytest.mark.compile
def test_norm_stat_kernel_compiles_for_sm90():
    assert rows.compile_norm_stat_rows() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("C, T", [(16384, 8), (4096, 16), (333, 7)])
def test_gpu_norm_stat_kernel_equals_torch_form(C, T):
    """At the LM heads' shapes (d = 2048's 8 partials at 16384 tokens, d = 4096's 16 at a
    4096-token chunk) and an odd one: as in the interpreter."""
    assert norm_stat_case(C, T, device="cuda") < 1e-6
