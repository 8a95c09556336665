"""Probe: the LM head's row weights and loss reduction (``coda.kernels.loss_rows``, one
program each) at candidate launch shapes, beside their torch forms (five and seven launches).

Run 202 timed the first shape (2048 rows a step, 8 warps) inside the LM head at 17.6 us
(weights) and 11.6 us (loss) for M = 16384: one program walking its rows in dependent steps
is latency-bound, so the candidates differ in how many rows a step holds in flight
(``MAX_BLOCK``) and how many a thread loads (``ROWS_PER_THREAD``). Each is timed as a CUDA
graph of one call (GPU time alone, no host gaps) and, for the torch forms, eagerly too (what
an eager call's GPU sees), every output checked against the torch form.
``gpu_suite.py`` runs it only when named (``--only loss_rows``).
"""

from __future__ import annotations

import torch

from benchmarks._common import Diagnostic, bench, out_of_time, progress

SUITE = "loss_rows"
SIZES = (4096, 16384, 65536, 262144)
CANDIDATES = ((2048, 8), (4096, 16), (8192, 16), (16384, 16), (16384, 32), (32768, 32))


def _graphed(fn):
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run() -> list[dict]:
    from coda.kernels import loss_rows
    from coda.primitives import aux

    rows = []
    for M in SIZES:
        g = torch.Generator(device="cuda").manual_seed(M)
        t = torch.randint(0, 32768, (M,), generator=g, device="cuda")
        t[::7] = -100
        lse = torch.randn(M, generator=g, device="cuda") + 10
        y = torch.randn(M, generator=g, device="cuda")
        calls = {
            "weights": (
                lambda: aux.ce_row_weights(t, -100, "mean"),
                lambda: loss_rows.ce_row_weights(t, -100, "mean"),
            ),
            "loss": (
                lambda: aux.ce_loss_from_stats(lse, y, t, -100, "mean"),
                lambda: loss_rows.ce_loss_from_stats(lse, y, t, -100, "mean"),
            ),
        }
        for what, (torch_form, kernel_form) in calls.items():
            if out_of_time():
                return rows
            ref = torch_form()
            base = {"name": f"{SUITE}/{what}", "M": M}
            rows.append(
                progress(
                    {
                        **base,
                        "launch": "torch_form",
                        "us": bench(_graphed(torch_form))["ms"] * 1e3,
                        "eager_us": bench(torch_form)["ms"] * 1e3,
                    }
                )
            )
            default = (loss_rows.MAX_BLOCK, loss_rows.ROWS_PER_THREAD)
            for block, per_thread in CANDIDATES:
                loss_rows.MAX_BLOCK, loss_rows.ROWS_PER_THREAD = block, per_thread
                try:
                    got = kernel_form()
                    err = float(((got - ref).abs().max() / ref.abs().max()).nan_to_num())
                    us = bench(_graphed(kernel_form))["ms"] * 1e3
                    shape = list(loss_rows.launch_shape(M))  # (BLOCK, num_warps) it ran
                finally:
                    loss_rows.MAX_BLOCK, loss_rows.ROWS_PER_THREAD = default
                rows.append(
                    progress(
                        {
                            **base,
                            "launch": [block, per_thread],
                            "block_warps": shape,
                            "default": (block, per_thread) == default,
                            "us": us,
                            "err_vs_torch_form": err,
                        }
                    )
                )
    return rows


class Suite(Diagnostic):
    def run(self) -> list[dict]:
        return run()
