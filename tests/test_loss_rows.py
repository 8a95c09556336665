"""The LM head's row weights and loss reduction as single Triton launches
(``coda.kernels.loss_rows``) against their torch forms (``coda.primitives.aux``): in Triton's
interpreter on the CPU (a child process: the interpreter is chosen when triton is imported),
compiled for sm_90 without a GPU, and on the H200.

Cases: token counts 1 to past two of the kernel's blocks (not multiples of it), int64 and
int32 targets, every reduction, label smoothing and z-loss on and off, every row ignored
("mean" is NaN, the weights all 0), float64 (to round-off) and float32. The weights are equal
bitwise (a correctly rounded division, as torch's); the loss to round-off (its sum runs in
another order)."""

from __future__ import annotations

import pytest
import torch
import triton_child

from coda.primitives import aux

SIZES = (1, 7, 2049, 5000, 16385, 40000)  # one step (up to MAX_BLOCK rows) and several
OPTIONS = ((0.0, 0.0), (0.1, 0.0), (0.0, 1e-4), (0.2, 1e-3))  # (label_smoothing, z_loss)


def case_inputs(M, dtype, target_dtype, seed=0, device="cpu", ignored=0.3):
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randint(0, 50, (M,), generator=g, device=device, dtype=target_dtype)
    t[torch.rand(M, generator=g, device=device) < ignored] = -100
    lse = torch.randn(M, generator=g, device=device, dtype=dtype) + 5
    y = torch.randn(M, generator=g, device=device, dtype=dtype)
    logit_sum = torch.randn(M, generator=g, device=device, dtype=dtype) * 10
    return t, lse, y, logit_sum


def loss_rows_errors(M, dtype, target_dtype, seed=0, device="cpu", ignored=0.3, loss=None):
    """Per reduction: whether the weights equal the torch form's bitwise, and the loss's
    largest error relative to its largest magnitude over every option (inf where NaN
    disagrees). ``loss``: the loss function under test (``loss_rows``'s by default)."""
    from coda.kernels import loss_rows

    loss = loss or loss_rows.ce_loss_from_stats
    t, lse, y, logit_sum = case_inputs(M, dtype, target_dtype, seed, device, ignored)
    out = {}
    for reduction in ("mean", "sum", "none"):
        w = loss_rows.ce_row_weights(t, -100, reduction, dtype)
        w_ref = aux.ce_row_weights(t, -100, reduction, dtype)
        same_w = w.dtype == w_ref.dtype and torch.equal(w, w_ref)
        err = 0.0
        for smoothing, z_loss in OPTIONS:
            kw = dict(logit_sum=logit_sum if smoothing else None, vocab=50,
                      label_smoothing=smoothing, z_loss=z_loss)  # fmt: skip
            got = loss(lse, y, t, -100, reduction, **kw)
            ref = aux.ce_loss_from_stats(lse, y, t, -100, reduction, **kw)
            if got.shape != ref.shape or got.dtype != ref.dtype:
                return {"shape": [list(got.shape), str(got.dtype)]}
            if not torch.equal(got.isnan(), ref.isnan()):
                err = float("inf")
                continue
            got, ref = got.nan_to_num().double(), ref.nan_to_num().double()
            scale = ref.abs().max().clamp(min=1e-30)
            err = max(err, float((got - ref).abs().max() / scale))
        out[reduction] = [same_w, err]
    return out


_BOUND = {torch.float64: 1e-14, torch.float32: 1e-6}

_CHILD = """
import json, sys, torch
sys.path.insert(0, "tests")
from test_loss_rows import SIZES, loss_rows_errors
from coda.kernels import loss_rows
launches = []
launch = loss_rows.kernel
loss_rows.kernel = lambda fn: launches.append(fn.__name__) or launch(fn)
out = []
for M in SIZES:
    for dt in (torch.float64, torch.float32):
        for tdt in (torch.int64, torch.int32):
            out.append([M, str(dt), loss_rows_errors(M, dt, tdt, seed=M)])
none_valid = loss_rows_errors(9, torch.float64, torch.int64, ignored=1.1)
out.append(["all ignored", "torch.float64", none_valid])
n = len(launches)
t = torch.zeros(8, 2, dtype=torch.int64)[:, 0]  # strided targets: the torch form, no launch
loss_rows.ce_row_weights(t, -100, "mean")
loss_rows.ce_loss_from_stats(torch.ones(8), torch.zeros(8), t, -100, "sum")
strided = len(launches)
big = torch.zeros(40000, dtype=torch.int64)  # past the weights' MAX_ROWS, inside the loss's
loss_rows.ce_row_weights(big, -100, "mean")
loss_rows.ce_loss_from_stats(torch.ones(40000), torch.zeros(40000), big, -100, "sum")
print(json.dumps([out, n, strided, launches[strided:]]))
"""


def test_loss_rows_in_triton_interpreter_equal_torch_forms():
    out, launched, after_strided, past_max = triton_child.results(_CHILD)
    assert launched > 0 and after_strided == launched  # the kernels ran; strided rows did not
    assert past_max == ["_loss_kernel"]  # rows past the weights' MAX_ROWS: their torch form
    for M, dtype, errs in out:
        bound = _BOUND[getattr(torch, dtype.split(".")[1])]
        assert set(errs) == {"mean", "sum", "none"}, (M, dtype, errs)
        for reduction, (same_w, err) in errs.items():
            assert same_w and err <= bound, (M, dtype, reduction, same_w, err)


def test_loss_rows_comparison_can_fail():
    """The measure above catches a loss whose smoothing term has the wrong sign."""

    def wrong(lse, y, t, ii, reduction, **kw):
        kw["label_smoothing"] = -kw["label_smoothing"]
        return aux.ce_loss_from_stats(lse, y, t, ii, reduction, **kw)

    errs = loss_rows_errors(40, torch.float64, torch.int64, loss=wrong)
    assert all(err > 1e-3 for _, err in errs.values())


@pytest.mark.compile
@pytest.mark.parametrize("target", ["*i64", "*i32"])
def test_loss_rows_compile_for_sm90(target):
    from coda.kernels import loss_rows

    for mean in (True, False):
        assert loss_rows.compile_row_weights(mean, target) > 0
    for reduction in ("none", "sum", "mean"):
        for smooth in (False, True):
            for z in (False, True):
                assert loss_rows.compile_loss(reduction, smooth, z, target) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [16384, 4097, 3])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
def test_gpu_loss_rows_equal_torch_forms(M, target_dtype):
    """On the GPU, fp32 as the LM head runs them: weights bitwise, the loss to round-off; and
    every row ignored."""
    for ignored in (0.3, 1.1):
        errs = loss_rows_errors(M, torch.float32, target_dtype, device="cuda", ignored=ignored)
        for reduction, (same_w, err) in errs.items():
            assert same_w and err <= _BOUND[torch.float32], (M, reduction, same_w, err)
