"""``coda._metadata.matcher``, the predicate both host memos match a call with: a later call
matches exactly when every tensor has the same Python type, device, dtype, shape, strides
and requires_grad (never the data or the address) and every other value is the same value of
the same type, through torch's C++ tensor guards and through the plain-tuple fallback."""

import pytest
import torch

from coda import _metadata


@pytest.fixture(params=["torch guards", "signature tuples"])
def matcher(request, monkeypatch):
    if request.param == "torch guards":
        if _metadata.TENSOR_GUARDS is None:
            pytest.skip("this torch lacks the C++ tensor guards")
    else:
        monkeypatch.setattr(_metadata, "TENSOR_GUARDS", None)
    return _metadata.matcher


def test_the_pinned_torch_has_the_guards():
    """The torch versions coda is tested with (CI's 2.13, the H200 image's 2.11; 2.14.1 and
    2.15.0, whose CPU suites passed in session 70) pass the import-time probe, so the memos
    take the C++ path; a torch of that range that changed them would fall back silently, and
    this says so. Other versions may fall back (correct, slower)."""
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if not (2, 11) <= version <= (2, 15):
        pytest.skip(f"torch {torch.__version__} is outside the tested 2.11-2.15")
    assert _metadata.TENSOR_GUARDS is not None


def test_same_metadata_other_data_matches(matcher):
    x, w = torch.randn(6, 4), torch.randn(4, 8, dtype=torch.float64)
    matches = matcher((x, None, w, 3, "pair"))
    assert matches(torch.zeros(6, 4), None, torch.ones(4, 8, dtype=torch.float64), 3, "pair")
    buf = torch.empty(6 * 4 + 1)
    assert matches(buf[1:].view(6, 4), None, w, 3, "pair")  # another address, same strides


@pytest.mark.parametrize(
    "position, value",
    [
        (0, torch.randn(6, 4).t().contiguous().t()),  # strides
        (0, torch.randn(5, 4)),  # shape
        (0, torch.randn(6, 4, dtype=torch.bfloat16)),  # dtype
        (0, torch.randn(6, 4, requires_grad=True)),  # requires_grad
        (0, torch.nn.Parameter(torch.randn(6, 4), requires_grad=False)),  # Python type
        (0, torch.empty(6, 4, device="meta")),  # device
        (0, None),  # a tensor where one was
        (1, torch.randn(6, 4)),  # a tensor where None was
        (2, 4),  # another plain value
        (2, True),  # not the same type (True == 1)
        (3, 1.0),  # 1.0 == 1, not the same type
    ],
)
def test_any_other_metadata_does_not_match(matcher, position, value):
    x = torch.randn(6, 4)
    matches = matcher((x, None, 1, 1))
    later = [torch.randn(6, 4), None, 1, 1]
    later[position] = value
    assert not matches(*later)


def test_all_tensors_and_no_tensors(matcher):
    x = torch.randn(3, 3)
    assert matcher((x, x))(torch.randn(3, 3), torch.randn(3, 3))
    assert not matcher((x, x))(torch.randn(3, 3), torch.randn(3, 3).t()[:, :2])
    assert matcher((None, 2))(None, 2) and not matcher((None, 2))(None, 3)
