"""Probe: the host time of one launch of a coda Triton kernel, three ways in one process.

A layer step launches seven Triton kernels and the LM head's call more; each launch's host
time read ~65 us under cProfile in run 157, most of it outside the kernel's C launcher. Three
launchers of the same kernel (``row_stat_triton``'s, the A1 statistic every residual op
runs), timed in interleaved rounds on an idle GPU:

- ``triton``: Triton's own ``kernel[grid](...)`` (binds and specializes every argument);
- ``direct, session 16``: coda's launcher as session 16 built it (a key of one tuple per
  argument built by a function call each, and Triton's runner looking the device and the
  stream up through two Python calls), kept here as the measurement's code;
- ``direct``: ``coda.kernels._triton.Kernel`` now (the key in one comprehension, the stream
  read in one C call and handed to the runner).

``gpu_suite.py`` runs it only when named (``--only triton_launch``).
"""

from __future__ import annotations

import torch

from benchmarks._common import Diagnostic, interleaved
from benchmarks.bench_step import _per_call_us
from coda.kernels import _triton
from coda.kernels import norm_rows as nr

SUITE = "triton_launch"


def _spec16(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.device, a.data_ptr() % 16 == 0)
    return (type(a), a)


class Session16(_triton.Kernel):
    """The launcher of session 16 (commit b71b2d3 to session 36), for the same-run A/B."""

    @staticmethod
    def key(args, named) -> tuple:
        return (*map(_spec16, args), *map(_spec16, named.values()), *named)

    def launch(self, grid, args, named):
        key = self.key(args, named)
        hit = self.compiled.get(key)
        if hit is not None:
            compiled, tail = hit
            grid = (*grid, 1, 1)[:3]
            return compiled[grid](*args, *(named[p] for p in tail))
        compiled = self.jit[grid](*args, **named)
        self.compiled[key] = (compiled, self.params[len(args) :])
        return compiled


def _launchers(partials, out, M, T, d):
    named = dict(MODE=nr.RSTD, BM=128, BT=8, ACC=_triton.acc_type(partials), num_warps=4)
    args = (partials, partials, out, M, T, partials.stride(0), d, 1e-5)
    grid = (-(-M // 128),)
    now, old = _triton.Kernel(nr._row_stat_kernel), Session16(nr._row_stat_kernel)
    return {
        "triton": lambda: now.jit[grid](*args, **named),
        "direct, session 16": lambda: old[grid](*args, **named),
        "direct": lambda: now[grid](*args, **named),
    }


def run(rounds: int = 7) -> list[dict]:
    """Each launcher's us per launch: ``interleaved`` rounds of ``_per_call_us`` (the host
    suite's timer: 200 launches queued on an idle GPU, then one synchronize)."""
    M, T, d = 256, 8, 2048
    partials = torch.rand(M, T, device="cuda") + 0.5
    out = torch.empty(M, device="cuda")
    fns = _launchers(partials, out, M, T, d)
    want = None
    for name, fn in fns.items():  # each compiled and keyed; every way the same result
        out.zero_()  # (rstd > 0: a launcher that wrote nothing fails the check)
        fn(), fn()
        torch.cuda.synchronize()
        got = out.clone()
        want = got if want is None else want
        assert torch.equal(got, want), name
    timed = interleaved(fns, rounds, timer=lambda fn: {"ms": _per_call_us(fn, 200) / 1e3})
    base = timed["triton"]["ms"]
    return [
        {
            "name": f"{SUITE}/{name}",
            "kernel": "_row_stat_kernel",
            "M": M,
            "us_per_launch": t["ms"] * 1e3,
            "rounds_us": [ms * 1e3 for ms in t["rounds_ms"]],
            "ratio_vs_triton": t["ms"] / base,
        }
        for name, t in timed.items()
    ]


class Suite(Diagnostic):
    def run(self) -> list[dict]:
        return run()
