"""The public ops' check memo (``coda.ops._checked``): an op runs its rules once per input
signature (dtypes, devices, shapes, strides, requires_grad, the grad mode and its plain
arguments) and afterwards only the per-call one metadata cannot show (each TMA operand's base
address). What must never happen: a later call with the same signature but a broken rule
passing unchecked. The kernel path runs here on the CPU (the tile interpreter) with the device
check stood in for."""

import pytest
import torch

import coda
from coda import env, ops

BF = torch.bfloat16


@pytest.fixture
def kernel_path(monkeypatch):
    """The kernel path on the CPU: SM90 support reported, launches through the interpreter."""
    monkeypatch.setattr(env, "kernel_support", lambda device, dtype=None: (True, ""))
    starts = []
    start = ops._start
    monkeypatch.setattr(ops, "_start", lambda *a: starts.append(a[0]) or start(*a))
    return starts


def _swiglu_inputs(m=8, k=16, f=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(BF)
    w = (torch.randn(k, 2 * f, generator=g) / k**0.5).to(BF)
    return x, w


def test_checks_run_once_per_signature(kernel_path):
    x, w = _swiglu_inputs()
    with torch.no_grad():
        first = coda.gemm_swiglu(x, w).s
        again = coda.gemm_swiglu(x.clone(), w.clone()).s  # same signature, new tensors
        coda.gemm_swiglu(x[:5], w)  # another token count: checked again
    assert torch.equal(first, again)
    assert kernel_path == ["gemm_swiglu", "gemm_swiglu"]
    assert coda.last_path("gemm_swiglu")[0] == "kernel"


def test_a_misaligned_base_address_fails_on_a_remembered_signature(kernel_path):
    x, w = _swiglu_inputs()
    coda.gemm_swiglu(x, w)
    buf = torch.empty(x.numel() + 1, dtype=BF)
    shifted = buf[1:].view_as(x).copy_(x)  # same shape and strides, base 2 bytes off
    with pytest.raises(coda.CodaInputError, match="x: base address must be 16-byte aligned"):
        coda.gemm_swiglu(shifted, w)


def test_grad_mode_and_requires_grad_are_part_of_the_signature(kernel_path):
    x, w = _swiglu_inputs()
    wg = w.clone().requires_grad_(True)
    with torch.no_grad():
        coda.gemm_swiglu(x, wg)
    with pytest.raises(NotImplementedError, match="forward-only"):
        coda.gemm_swiglu(x, wg)
    coda.gemm_swiglu(x, w)  # grad mode on, nothing requires grad: allowed


def test_plain_arguments_are_typed_in_the_signature():
    x = torch.randn(6, 16, dtype=BF)
    w = torch.randn(16, 3 * 8, dtype=BF)
    pos = torch.arange(6)
    coda.gemm_rope(x, w, pos, head_dim=8, n_heads=1, n_kv_heads=1, backend="reference")
    with pytest.raises(coda.CodaInputError, match="n_kv_heads: must be an integer"):
        coda.gemm_rope(x, w, pos, head_dim=8, n_heads=1, n_kv_heads=True, backend="reference")


def test_a_non_tensor_after_a_remembered_call_gets_the_rule_not_a_crash():
    x, w = _swiglu_inputs()
    coda.gemm_swiglu(x, w, backend="reference")
    with pytest.raises(coda.CodaInputError, match="x: expected a torch.Tensor"):
        coda.gemm_swiglu(x.tolist(), w, backend="reference")


def test_the_reference_warning_survives_the_memo(recwarn):
    x, w = _swiglu_inputs()
    coda.gemm_swiglu(x, w)
    env._WARNED.clear()
    with pytest.warns(coda.CodaReferencePathWarning):
        coda.gemm_swiglu(x, w)  # a remembered signature still reports its path


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype")
def test_a_tensor_without_plain_metadata_gets_the_rule_not_a_memo_crash():
    """A nested tensor has no shape or strides to key on (reading them raises): the op runs
    its checks uncached, and they name the rule."""
    x, w = _swiglu_inputs()
    coda.gemm_swiglu(x, w, backend="reference")
    nested = torch.nested.nested_tensor([x[:3], x[3:]])
    with pytest.raises(coda.CodaInputError, match="x: nested tensors are not supported"):
        coda.gemm_swiglu(nested, w, backend="reference")


def test_one_plan_tape_per_signature(kernel_path, monkeypatch):
    """The memo's verdict carries the signature's ``PlanTape``: the same tape for every call
    of one signature, another for another signature, none where the checks run uncached."""
    x, w = _swiglu_inputs()
    plain = ("auto", False, None)

    def tape_of(x, w):
        named = {"x": x, "w_il": w, "rstd": None}
        return ops._checked("gemm_swiglu", lambda: ops._start("gemm_swiglu", "auto", named),
                            plain, named, ("x", "w_il"))  # fmt: skip

    path, tape, _ = tape_of(x, w)
    assert path == "kernel" and isinstance(tape, coda._quack.PlanTape)
    assert tape_of(x.clone(), w.clone())[1] is tape
    assert tape_of(x[:5], w)[1] is not tape
    monkeypatch.setattr(ops, "PLAN_TAPES", False)  # the benchmarks' same-run comparison
    assert tape_of(x, w) == ("kernel", ops.UNTAPED, None)
    assert ops._checked("gemm_swiglu", lambda: "kernel", plain, {"x": [1]})[1] is ops.UNTAPED


def test_a_missing_rstd_is_one_kept_table_of_ones(monkeypatch):
    """``rstd=None`` (no row scale) reads one table of ones per row count and device, made
    once, not a fill launched per call; while a CUDA graph is captured (stood in) it is made
    afresh, as any device table then."""
    x = torch.randn(5, 8, dtype=BF)
    ones = ops._rstd(None, x)
    assert torch.equal(ones, torch.ones(5)) and ones.dtype == torch.float32
    assert ops._rstd(None, x.clone()) is ones and ops._rstd(None, x[:4]) is not ones
    given = torch.rand(5)
    assert ops._rstd(given, x) is given
    monkeypatch.setattr(env, "capturing", lambda t=None: True)
    assert ops._rstd(None, x) is not ones


@pytest.fixture(params=["torch guards", "signature tuples"])
def matcher(request, monkeypatch):
    """Both ways the memo matches a call to a remembered signature: torch's C++ tensor guards
    where this torch has them (probed at import), else ``signature`` tuples."""
    from coda import _metadata

    if request.param == "torch guards":
        if _metadata.TENSOR_GUARDS is None:
            pytest.skip("this torch lacks the C++ tensor guards the memo probes for")
    else:
        monkeypatch.setattr(_metadata, "TENSOR_GUARDS", None)
    ops._CHECKED.clear()
    yield request.param
    ops._CHECKED.clear()


def test_a_changed_tensor_is_checked_again_by_either_matcher(kernel_path, matcher):
    """Same op, plain arguments and token count, one tensor's metadata changed: each change
    gets the full checks, so a broken rule raises instead of riding a remembered verdict."""
    x, w = _swiglu_inputs()
    with torch.no_grad():
        coda.gemm_swiglu(x, w)
        coda.gemm_swiglu(x.clone(), w.clone())  # remembered
        assert kernel_path == ["gemm_swiglu"]
        cases = {
            "x: the TMA needs a unit stride": x.t().contiguous().t(),  # same shape, col-major
            "x: dtype must be one of": x.float(),
        }
        for rule, bad in cases.items():
            with pytest.raises(coda.CodaInputError, match=rule):
                coda.gemm_swiglu(bad, w)
        coda.gemm_swiglu(x, torch.nn.Parameter(w, requires_grad=False))  # another type: checked
        coda.gemm_swiglu(x, w, torch.rand(x.shape[0]))  # an rstd where there was None: checked
    assert kernel_path.count("gemm_swiglu") == 1 + len(cases) + 2


def test_the_memo_keeps_each_signatures_tile_config(kernel_path, matcher, monkeypatch):
    """The op's tile config is resolved with its checks, once per signature, and reused."""
    from coda.kernels import tuned

    looked_up = []
    lookup = tuned.config_for
    monkeypatch.setattr(ops, "config_for", lambda *a: looked_up.append(a) or lookup(*a))
    x, w = _swiglu_inputs()
    with torch.no_grad():
        for _ in range(3):
            coda.gemm_swiglu(x, w)
        coda.gemm_swiglu(x[:5], w)  # another token count: resolved again
    # twice per signature (its checks read the tile's width too), never per call
    assert [m for _, m, *_ in looked_up] == [8, 8, 5, 5]


def test_verdicts_per_key_are_bounded_newest_first(kernel_path, matcher, monkeypatch):
    """One key (op, plain arguments, grad mode, token count) keeps at most ``MAX_VERDICTS``
    signatures, the newest first; a dropped one is checked again when it comes back."""
    monkeypatch.setattr(ops, "MAX_VERDICTS", 2)
    x, w = _swiglu_inputs()
    signatures = [w, w.t().contiguous().t(), w.clone().requires_grad_(True)]  # 3 on one key
    with torch.no_grad():
        for wi in signatures:
            coda.gemm_swiglu(x, wi)
        (verdicts,) = ops._CHECKED.values()
        assert len(verdicts) == 2 and verdicts[0].matches(x, signatures[2], None)
        coda.gemm_swiglu(x, signatures[0])  # dropped: checked again
    assert kernel_path.count("gemm_swiglu") == 4


def test_rope_keeps_its_frequency_table_with_the_verdict_but_not_from_a_capture(
    kernel_path, matcher, monkeypatch
):
    """``gemm_rope`` looks its frequency table up with its tile config, once per signature;
    a call made while a CUDA graph is captured (stood in for) keeps no verdict, as a device
    table built then holds nothing outside the graph: each such call looks it up again."""
    looked_up = []
    lookup = ops.cached_freq_table
    monkeypatch.setattr(ops, "cached_freq_table", lambda *a: looked_up.append(a) or lookup(*a))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g).to(BF)
    w_qkv = (torch.randn(16, (2 + 2 * 1) * 8, generator=g) / 4).to(BF)
    pos = torch.arange(8)

    def rope():
        return coda.gemm_rope(x, w_qkv, pos, head_dim=8, n_heads=2, n_kv_heads=1)

    with torch.no_grad():
        first = [rope() for _ in range(3)]
        assert len(looked_up) == 1 and len(ops._CHECKED) == 1
        ops._CHECKED.clear()
        monkeypatch.setattr(ops, "capturing", lambda: True)
        captured = [rope() for _ in range(2)]
    assert len(looked_up) == 3 and not ops._CHECKED
    assert all(torch.equal(first[0], z) for z in first[1:] + captured)
