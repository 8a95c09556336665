"""The benchmarks' selections (``CODA_*`` environment variables, ``_common.selected``): each
names its choices from a fixed set and refuses another, named; a selection that names none
runs the suite's defaults; every variable a run reads is named in its record's command. No
GPU: these rules decide what a device call runs before it starts."""

from __future__ import annotations

import pytest

from benchmarks import _common


def test_selected_names_are_checked(monkeypatch):
    monkeypatch.delenv("CODA_X", raising=False)
    assert _common.selected("CODA_X", ["a", "b"]) == []  # none listed: all
    monkeypatch.setenv("CODA_X", "b,a,")
    assert _common.selected("CODA_X", ["a", "b"]) == ["b", "a"]
    monkeypatch.setenv("CODA_X", "a,llama-1B")  # a wrong key names itself and the known ones
    with pytest.raises(ValueError, match=r"CODA_X: unknown \['llama-1B'\]; known: \['a', 'b'\]"):
        _common.selected("CODA_X", ["a", "b"])


def test_the_hf_step_takes_its_shape_s_tokens_unless_the_run_names_them(monkeypatch):
    from benchmarks import hf_models

    monkeypatch.delenv("CODA_HF_TOKENS", raising=False)
    assert hf_models.batch_of("llama-3.2-1B") == (4, 4096)
    assert hf_models.batch_of("qwen3-30B-A3B-8L") == (2, 4096)  # its own, fewer
    monkeypatch.setenv("CODA_HF_TOKENS", "4x4096")
    assert hf_models.batch_of("qwen3-30B-A3B-8L") == (4, 4096)
    for wrong in ("4096", "4x", "0x4096", "4x-1"):
        monkeypatch.setenv("CODA_HF_TOKENS", wrong)
        with pytest.raises(ValueError, match="CODA_HF_TOKENS: .* is not BATCHxSEQ"):
            hf_models.batch_of("llama-3.2-1B")


def test_the_model_step_runs_the_default_peers_unless_some_are_named(monkeypatch):
    from benchmarks import bench_step

    monkeypatch.delenv("CODA_MODEL_PEERS", raising=False)
    assert bench_step.model_peers() == ["coda", "torch_compile", "liger"]  # fit one H200
    assert set(bench_step.MODEL_DEFAULT_PEERS) < set(bench_step.MODEL_PEERS)
    monkeypatch.setenv("CODA_MODEL_PEERS", "torch_eager,coda_checkpointed")
    assert bench_step.model_peers() == ["torch_eager", "coda_checkpointed"]
    monkeypatch.setenv("CODA_MODEL_PEERS", "coda,jax")
    with pytest.raises(ValueError, match="jax"):
        bench_step.model_peers()


def test_the_lm_head_runs_every_default_variant_unless_some_are_named(monkeypatch):
    from benchmarks import bench_train

    monkeypatch.delenv("CODA_LM_HEAD_PEERS", raising=False)
    every = [n for n in bench_train.LM_HEAD_VARIANTS if n not in bench_train.LM_HEAD_ON_REQUEST]
    assert bench_train.lm_head_variants() == every and "coda_e512m" not in every
    monkeypatch.setenv("CODA_LM_HEAD_PEERS", "torch_compile,quack_chunked_lce,coda_e512m")
    # coda's default always, in the table's order; one on request when named
    want = ["coda", "coda_e512m", "torch_compile", "quack_chunked_lce"]
    assert bench_train.lm_head_variants() == want
    monkeypatch.setenv("CODA_LM_HEAD_PEERS", "coda,flce")
    with pytest.raises(ValueError, match="flce"):
        bench_train.lm_head_variants()


def test_suite_and_layer_selections_are_checked(monkeypatch, capsys):
    """``gpu_suite --only`` refuses an unknown suite before any test or benchmark runs (the old
    "train" suite among them: it is "layer_train" now, the LM head its own suite), and
    ``CODA_LAYER_SHAPES`` picks the layer bench's widths."""
    from benchmarks import bench_train, gpu_suite

    monkeypatch.setattr("sys.argv", ["gpu_suite.py", "--skip-tests", "--only", "hf,train"])
    with pytest.raises(SystemExit) as stop:
        gpu_suite.main()
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--only: unknown ['train']; known: host, triton_launch, main_demo" in err
    monkeypatch.setenv("CODA_LAYER_SHAPES", "d4096")
    assert bench_train.layer_widths() == [4096]
    monkeypatch.delenv("CODA_LAYER_SHAPES")
    assert bench_train.layer_widths() == [2048, 4096]


def test_every_selection_variable_is_named_in_the_recorded_command():
    """A benchmark that reads a ``CODA_*`` variable to choose shapes, peers or configs must
    have it in ``gpu_suite.SELECTIONS``, which writes it into the record's command: else a
    record would not say what ran (``--budget-s``'s deadline is the suite's own, from its
    command line)."""
    import pathlib
    import re

    from benchmarks import gpu_suite

    read = set()
    for path in pathlib.Path(gpu_suite.__file__).parent.glob("*.py"):
        text = path.read_text()
        pattern = r'(?:selected|environ\.get|mixed_precision)\(\s*"(CODA_[A-Z_]+)"'
        read |= set(re.findall(pattern, text))
    assert {"CODA_LM_HEAD_PEERS", "CODA_HF_AMP"} <= read  # the scan finds what it looks for
    assert read - {"CODA_SUITE_DEADLINE"} <= set(gpu_suite.SELECTIONS), sorted(
        read - set(gpu_suite.SELECTIONS)
    )


def test_lm_head_targets_selection(monkeypatch):
    """``CODA_LM_HEAD_TARGETS``: uniform unless one known distribution is named."""
    from benchmarks import bench_train

    monkeypatch.delenv("CODA_LM_HEAD_TARGETS", raising=False)
    assert bench_train.lm_head_targets() == "uniform"
    monkeypatch.setenv("CODA_LM_HEAD_TARGETS", "zipf")
    assert bench_train.lm_head_targets() == "zipf"
    for bad in ("zipf,uniform", "normal"):
        monkeypatch.setenv("CODA_LM_HEAD_TARGETS", bad)
        with pytest.raises(ValueError, match="CODA_LM_HEAD_TARGETS"):
            bench_train.lm_head_targets()


def test_lm_head_softcap_selection(monkeypatch):
    """``CODA_LM_HEAD_SOFTCAP``: no cap unless a number is given; with one, only the variants
    that take a cap run."""
    from benchmarks import bench_train

    monkeypatch.delenv("CODA_LM_HEAD_SOFTCAP", raising=False)
    assert bench_train.lm_head_softcap() is None
    monkeypatch.setenv("CODA_LM_HEAD_SOFTCAP", "30")
    assert bench_train.lm_head_softcap() == 30.0
    assert set(bench_train.SOFTCAP_VARIANTS) <= set(bench_train.LM_HEAD_VARIANTS)
    monkeypatch.setenv("CODA_LM_HEAD_SOFTCAP", "thirty")
    with pytest.raises(ValueError):
        bench_train.lm_head_softcap()
