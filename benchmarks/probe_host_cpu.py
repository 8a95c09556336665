"""Where a single-GEMM op's host time goes, on a machine without a GPU.

``coda.gemm_swiglu`` called on small CPU tensors with the kernel path forced and quack
stood in for (``stood_in``: plan building returns a token plan, the launch counts itself and
returns), so what is timed is exactly coda's own host work on the GPU branch: the op's
checks memo, its plan tape, the custom-op switch, the kernel function, ``launch``, the
epilogue arguments and ``run_epi_gemm``'s taped replay. Each layer of the call is then timed
alone (``pieces``), nested, so the differences say what each layer adds. On the H200's host
the same work takes ~2.5-3x these microseconds (session 35: 25.6 us of a 40.5 us call there
against ~10 here); the ratios between the pieces are what carry over.

    python benchmarks/probe_host_cpu.py [calls]
"""

from __future__ import annotations

import contextlib
import sys
import time
from unittest import mock

import torch

BF = torch.bfloat16
M, D, F = 256, 256, 512  # the host benchmark's tiny shape (``bench_step.host_rows``)


@contextlib.contextmanager
def stood_in():
    """The kernel path on CPU tensors with quack's frontend and launch stubbed; yields the
    list each stubbed launch appends to. Restores everything it patched and empties the
    checks memo and plan table it filled (they hold token plans) on the way out."""
    import coda.env
    from coda import _quack, ops
    from coda.kernels import _launch

    host = _quack._modules()["host"]
    from quack.epilogue.frontend import EpiMod

    launches: list = []
    patches = [
        (coda.env, "kernel_support", lambda device, dtype=None: (True, "stood in")),
        (_launch, "INTERPRET_OFF_GPU", False),
        (EpiMod, "gemm", lambda self, *args, **kwargs: object()),  # a token plan
        (host, "run_gemm_epi_plan", lambda plan, A, B, D, C, epi: launches.append(plan)),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        stack.callback(ops._CHECKED.clear)  # run first on the way out, and now:
        stack.callback(_quack._PLANS.clear)
        ops._CHECKED.clear()
        _quack._PLANS.clear()
        yield launches


def _us(fn, calls: int) -> float:
    """Best of five rounds of ``calls`` calls, us per call."""
    for _ in range(min(calls, 200)):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def _recorded_plain(op: str) -> tuple:
    """The plain arguments ``op`` filed its one verdict under (``ops._checked``'s key holds
    them, then their types), read back rather than spelled here: the probe's checks-memo
    row then follows the op's signature as it grows."""
    from coda import ops

    [typed] = [key[1] for key in ops._CHECKED if key[0] == op]
    return typed[: len(typed) // 2]


def pieces(calls: int = 20000) -> dict:
    """us per call of ``coda.gemm_swiglu`` and of each layer inside it, timed alone, in call
    order (each row includes the rows below it that it calls); then ``coda.gemm_rope`` and
    its table lookups."""
    import coda
    from coda import _quack, ops
    from coda.kernels import gemm_rope as rp
    from coda.kernels import gemm_swiglu as sw
    from coda.kernels import library as lib
    from coda.kernels._launch import launch
    from coda.kernels.tuned import config_for
    from coda.primitives.lowering import epi_args, lower

    g = torch.Generator().manual_seed(0)
    x, w_il = torch.randn(M, D, generator=g).to(BF), torch.randn(D, 2 * F, generator=g).to(BF)
    rstd = torch.rand(M, generator=g) + 0.5
    s = torch.empty(M, F, dtype=BF)
    config = config_for("swiglu", M, D, 2 * F)
    named = {"x": x, "w_il": w_il, "rstd": rstd}
    with stood_in() as launches, torch.no_grad():
        for _ in range(2):  # the first call checks and records the plan tape
            coda.gemm_swiglu(x, w_il, rstd)
        plain = _recorded_plain("gemm_swiglu")
        tape = ops._checked("gemm_swiglu", None, plain, named)[1]
        assert coda.last_path("gemm_swiglu")[0] == "kernel" and tape.state == "replay"
        mod, args = lower(sw.swiglu_only), {"rstd": rstd, "s": s}

        def taped(fn):
            def run():
                with tape:
                    fn()

            return run

        out = {
            "coda.gemm_swiglu": lambda: coda.gemm_swiglu(x, w_il, rstd),
            "its checks memo (ops._checked, a hit)": lambda: ops._checked(
                "gemm_swiglu", None, plain, named, ("x", "w_il")
            ),
            "the custom-op switch and below (library.gemm_swiglu_only, taped)": taped(
                lambda: lib.gemm_swiglu_only(x, w_il, rstd, config)
            ),
            "the kernel function (allocates s) and below, taped": taped(
                lambda: sw.gemm_swiglu_kernel(x, w_il, rstd, False, config)
            ),
            "launch and below, taped": taped(
                lambda: launch(
                    sw.swiglu_only,
                    x,
                    w_il,
                    config=config,
                    operands={"rstd": rstd},
                    outputs={"s": s},
                )
            ),
            "the epilogue arguments (lowering.epi_args)": lambda: epi_args(
                sw.swiglu_only, {"rstd": rstd}, {"s": s}
            ),
            "run_epi_gemm's taped replay (the stub's launch)": taped(
                lambda: _quack.run_epi_gemm(mod, x, w_il, None, None, args, config)
            ),
            "entering and leaving the plan tape": taped(lambda: None),
            "the output's allocation (new_empty)": lambda: x.new_empty(M, F),
        }
        # a second op beside it: ``gemm_rope`` (one kernel a call), whose frequency table is
        # kept with its verdict (since session 57; the lookup it saves timed alone below);
        # its int64 positions are loaded as they are (since session 39), the positions' rows
        # lookup timed alone for a dtype that is cast once
        H, Hkv, hd = 4, 2, 64  # the host benchmark's heads (``bench_step.host_rows``)
        w_qkv = torch.randn(D, (H + 2 * Hkv) * hd, generator=g).to(BF)
        pos = torch.arange(M)

        def rope():
            return coda.gemm_rope(x, w_qkv, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=rstd)

        for _ in range(2):  # checks and records its plan tape, as above
            rope()
        out["coda.gemm_rope"] = rope
        pos16 = pos.to(torch.int16)
        out["(int16 positions: their rows, gemm_rope.position_rows, a hit)"] = lambda: (
            rp.position_rows(pos16, 1, x.device)
        )
        out["(its frequency table, gemm_rope.cached_freq_table, a hit)"] = lambda: (
            rp.cached_freq_table(hd, H + Hkv, Hkv, 10000.0, x.device)
        )
        timed = {name: _us(fn, calls) for name, fn in out.items()}
        timed["launches seen"] = len(launches)
    return timed


if __name__ == "__main__":
    for name, us in pieces(int(sys.argv[1]) if len(sys.argv) > 1 else 20000).items():
        print(f"{name:68s} {us:8.2f}" if isinstance(us, float) else f"{name:68s} {us:8d}")
