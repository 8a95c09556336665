"""The pinned GPU-side stack: ``coda._quack`` refuses a quack-kernels or nvidia-cutlass-dsl
other than the versions its kernels are built and tested on, by name and before a kernel
meets it deep in the DSL (``CODA_ALLOW_UNPINNED_QUACK=1``: a warning instead), and its pins
are pyproject.toml's; ``python -m coda`` (and a result record's stack) says whether the
installed ones are the pins. On the CPU: no kernel runs, only the import and the check."""

import pathlib
import re
import warnings

import pytest
import quack
import torch

from coda import _quack

PINS = (_quack.QUACK_VERSION, _quack.CUTLASS_DSL_VERSION)
OTHER = ("0.0.1", "0.0.2")  # versions no pin will be


def _stack(quack_version, cutlass_version):
    """Installed versions in ``_quack.versions()``'s form."""
    return {"quack": quack_version, "cutlass_dsl": cutlass_version}


def test_the_pins_are_pyproject_toml_s():
    text = (pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'"quack-kernels==([^"]+)"', text).group(1) == _quack.QUACK_VERSION
    assert re.search(r'"nvidia-cutlass-dsl==([^"]+)"', text).group(1) == _quack.CUTLASS_DSL_VERSION


def test_the_pinned_versions_pass(monkeypatch):
    monkeypatch.delenv(_quack.ALLOW_UNPINNED, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", _quack.UnpinnedStackWarning)
        _quack.check_pins(_stack(*PINS))


@pytest.mark.parametrize("which", ["quack", "cutlass", "both"])
def test_another_version_is_refused_by_name(monkeypatch, which):
    monkeypatch.delenv(_quack.ALLOW_UNPINNED, raising=False)
    q = OTHER[0] if which in ("quack", "both") else PINS[0]
    c = OTHER[1] if which in ("cutlass", "both") else PINS[1]
    with pytest.raises(_quack.UnpinnedStackError) as err:
        _quack.check_pins(_stack(q, c))
    message = str(err.value)
    named_q = f"quack-kernels {OTHER[0]} (coda pins quack-kernels=={PINS[0]})"
    named_c = f"nvidia-cutlass-dsl {OTHER[1]} (coda pins nvidia-cutlass-dsl=={PINS[1]})"
    assert (named_q in message) == (q != PINS[0])
    assert (named_c in message) == (c != PINS[1])
    assert _quack.ALLOW_UNPINNED in message and "pip install -e ." in message
    assert isinstance(err.value, ImportError)


def test_the_override_warns_instead(monkeypatch):
    monkeypatch.setenv(_quack.ALLOW_UNPINNED, "1")
    with pytest.warns(_quack.UnpinnedStackWarning, match=f"quack-kernels {OTHER[0]} "):
        _quack.check_pins(_stack(OTHER[0], PINS[1]))


@pytest.fixture
def fresh_modules():
    """``_quack._modules`` uncached for the test, and again after it (its later callers then
    import the real, pinned stack anew)."""
    _quack._modules.cache_clear()
    yield
    _quack._modules.cache_clear()


def test_the_quack_import_refuses_an_unpinned_quack(monkeypatch, fresh_modules):
    monkeypatch.delenv(_quack.ALLOW_UNPINNED, raising=False)
    monkeypatch.setattr(quack, "__version__", OTHER[0])
    with pytest.raises(_quack.UnpinnedStackError, match=f"quack-kernels {OTHER[0]} "):
        _quack._modules()


def test_the_quack_import_passes_the_pinned_stack(monkeypatch, fresh_modules):
    monkeypatch.delenv(_quack.ALLOW_UNPINNED, raising=False)
    assert _quack._modules()["quack"] is quack


def test_the_stack_description_says_whether_it_is_pinned(monkeypatch):
    from coda import env

    assert env.describe()["pinned"] is True
    monkeypatch.setattr(_quack, "versions", lambda: _stack(OTHER[0], PINS[1]))
    assert env.describe()["pinned"] is False


def test_python_m_coda_prints_the_stack():
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "coda"], capture_output=True, text=True, check=True, timeout=120
    )
    rows = dict(line.split(None, 1) for line in run.stdout.splitlines())
    assert rows["quack"] == _quack.QUACK_VERSION and rows["pinned"] == "True"
    assert "RuntimeWarning" not in run.stderr
    if not torch.cuda.is_available():  # the reference path, and why
        assert rows["kernel_path"] == "False"
        assert rows["why_not"] == "torch sees no CUDA device"
