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


def results(code: str, *args: str):
    """Run ``code`` (which prints one JSON value last) with the interpreter on, ``args`` its
    ``sys.argv[1:]``; that value."""
    return results_side_by_side(code, [list(args)])[0]


def results_side_by_side(code: str, parts: list[list[str]]) -> list:
    """``results(code, *args)`` for each ``args`` of ``parts``, the children running at once:
    a long interpreter run split in parts takes the machine's other cores (the suite itself
    runs on one)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=ROOT,
            env=ENV,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for args in parts
    ]
    outs = [proc.communicate() for proc in procs]
    for proc, (_, err) in zip(procs, outs):
        assert proc.returncode == 0, err[-3000:]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]


def counted(module, name: str) -> list:
    """For a child script: replace ``module.name`` with a wrapper that appends 1 to the returned
    list on each call, then calls it (how a test sees which path a dispatcher took)."""
    calls: list = []
    original = getattr(module, name)
    setattr(module, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls
