"""Triton's interpreter in a child process, for the tests of coda's hand-written Triton kernels:
the interpreter is chosen when triton is imported (``TRITON_INTERPRET=1``), so a test that
runs kernels on CPU tensors runs them in a fresh Python with it switched on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}


def run(args: list[str]) -> subprocess.CompletedProcess:
    """``python <args>`` from the repository root with the interpreter on."""
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True
    )


def results(code: str):
    """Run ``code`` (which prints one JSON value last) with the interpreter on; that value."""
    proc = run(["-c", code])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def counted(module, name: str) -> list:
    """For a child script: replace ``module.name`` with a wrapper that appends 1 to the returned
    list on each call, then calls it (how a test sees which path a dispatcher took)."""
    calls: list = []
    original = getattr(module, name)
    setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls
