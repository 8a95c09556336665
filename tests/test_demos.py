"""The demos run as a user runs them (CPU: the reference path) and print their checks."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    # keep what PYTHONPATH already holds (on the GPU host: the dependency bundle)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_main_demo_runs_and_passes():
    out = run("demos/main.py", "--tokens", "96", "--d", "64")
    assert "path=reference" in out and "PASS" in out


def test_train_demo_runs(tmp_path):
    out = run("demos/train.py", "--steps", "8", "--png", str(tmp_path / "loss.png"))
    assert "coda     final loss" in out and "pytorch  final loss" in out
    # same initial weights and batches: on the CPU both run fp32 torch math
    diff = float(out.split("max |loss difference| over the run = ")[1].split()[0])
    assert diff < 1e-3


def test_train_demo_graph_flag_runs_the_same_steps(tmp_path):
    out = run("demos/train.py", "--steps", "6", "--graph", "--png", str(tmp_path / "loss.png"))
    assert "graphed" in out and "coda     final loss" in out  # CPU: GraphedStep runs eagerly
    diff = float(out.split("max |loss difference| over the run = ")[1].split()[0])
    assert diff < 1e-3


def test_train_demo_compile_flag_runs_the_same_steps(tmp_path):
    out = run("demos/train.py", "--steps", "6", "--compile", "--png", str(tmp_path / "loss.png"))
    assert "compiled" in out and "coda     final loss" in out  # CPU: traced by aot_eager
    diff = float(out.split("max |loss difference| over the run = ")[1].split()[0])
    assert diff < 1e-3


def test_hf_finetune_demo_runs():
    out = run("demos/hf_finetune.py", "--steps", "6", "--no-progress")
    assert "unpatched  final loss" in out and "coda       final loss" in out
    # same initial weights and batches; on the CPU coda's patch runs its fp32 reference path
    diff = float(out.split("max |loss difference| over the run = ")[1].split()[0])
    assert diff < 1e-3


@pytest.mark.gpu
def test_gpu_hf_finetune_curves_match():
    """H200: 200 training steps of a small HF Llama, unpatched and patched by coda, same
    weights and batches (bf16): the final losses (mean of the last 10 steps) agree within 2 %
    and both learned (well below the starting ln V)."""
    out = run("demos/hf_finetune.py", "--steps", "200", "--no-progress")
    final = {
        name: float(out.split(f"{name} final loss ")[1].split()[0])
        for name in ("unpatched ", "coda      ")
    }
    a, b = final["unpatched "], final["coda      "]
    assert abs(a - b) <= 0.02 * a, final
    assert max(a, b) < 0.5 * float(out.split("start: ln V = ")[1].split()[0]), final
