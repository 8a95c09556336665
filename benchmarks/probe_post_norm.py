"""Probe: the post-norm row passes (``coda.kernels.post_norm``: P1 forward, P2 backward) alone,
at each launch shape of ``LAUNCH_SHAPES``, on synthetic inputs of Gemma 2's and 3's widths and
of the layer benchmark's.

Session 73 profiled the layer benchmark's post-norm layer (``CODA_LAYER_POST_NORMS=1``) on an
H100 at d = 4096: P1 took 2.46 ms a call where its bytes need ~0.15 ms, because one token row
a program reduced its [1, T] partials as a block (slow, and slower with more warps); two rows a
program ran at bandwidth. This times each pass at every launch shape, checks every output
against the default launch's (bitwise for the passes' rows, relative error for dg), and
reports microseconds and the bandwidth for the bytes each must move. ``gpu_suite.py`` runs it
only when named (``--only post_norm_passes``).
"""

from __future__ import annotations

import torch

from benchmarks._common import Diagnostic, bench, out_of_time, progress

SUITE = "post_norm_passes"
M = 16384
WIDTHS = (1152, 2304, 4096, 8192, 16384)  # Gemma 3 1B, Gemma 2 2B, the layer benchmark's, wider
PARTIALS = 22  # y^2's partials a row (the d = 4096 layer's O projection: 192-column tiles)
LAUNCH_SHAPES = ((1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 8))  # (rows, warps)


def _inputs(d: int):
    g = torch.Generator(device="cuda").manual_seed(d)

    def rnd(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dt)

    y, x0, dx1 = rnd(M, d), rnd(M, d), rnd(M, d)
    sumsq = torch.rand(M, PARTIALS, generator=g, device="cuda") * d / PARTIALS
    return y, sumsq, x0, dx1, 1 + 0.1 * rnd(d, dt=torch.float32), rnd(d, dt=torch.float32)


def _same(out, ref) -> bool:
    return all(torch.equal(a, b) for a, b in zip(out, ref))


def run() -> list[dict]:
    from coda.kernels.post_norm import _p1_launch, _rows_launch
    from coda.kernels.post_norm import post_norm_bwd_triton as p2
    from coda.kernels.post_norm import post_norm_triton as p1

    rows = []
    for d in WIDTHS:
        y, sumsq, x0, dx1, g, g1 = _inputs(d)
        r = p1(y, sumsq, x0, g, 1e-6)[1]
        ref = {
            "p1": p1(y, sumsq, x0, g, 1e-6),
            "p1_next": p1(y, sumsq, x0, g, 1e-6, g1),
            "p2": p2(dx1, y, r, g),
        }
        calls = {
            "p1": (lambda s: p1(y, sumsq, x0, g, 1e-6, launch=s), 3, _p1_launch(d)),
            "p1_next": (lambda s: p1(y, sumsq, x0, g, 1e-6, g1, launch=s), 4, _p1_launch(d)),
            "p2": (lambda s: p2(dx1, y, r, g, launch=s), 3, _rows_launch(d)),
        }
        for name, (call, tensors, default) in calls.items():
            for shape in LAUNCH_SHAPES:
                if out_of_time():
                    return rows
                if shape[0] * d > 2 * 16384:  # registers: at most two 16384-wide rows
                    continue
                out = call(shape)
                if name == "p2":
                    err = float((out[1] - ref[name][1]).abs().max() / ref[name][1].abs().max())
                    same = bool(torch.equal(out[0], ref[name][0])) and err < 1e-5
                else:
                    same = _same(out, ref[name])
                us = bench(lambda s=shape: call(s))["ms"] * 1e3
                row = {"name": f"{SUITE}/{name}", "M": M, "d": d, "launch": list(shape)}
                row.update(default=shape == tuple(default), us=us, equal_default=same)
                row["tb_per_s"] = tensors * M * d * 2 / us * 1e-6  # bf16 rows read and written
                rows.append(progress(row))
    return rows


class Suite(Diagnostic):
    def run(self) -> list[dict]:
        return run()
