"""Probe: Nsight Compute's hardware counters on kernels of a patched HF training step.

Two questions the step's timings cannot answer (NOTES.md, session 24):
- ``ncu_qk_norm``: what bounds Qwen3's one-warp QK-norm backward pass (~180 us per call in the
  step against ~84 us of traffic at 4.8 TB/s)? Its full Nsight Compute report (each
  section's summary: throughput, memory workload, occupancy, scheduler and warp-state
  statistics, launch shape and registers) for the first call of a step.
- ``ncu_traffic``: the steps run at the H200's power cap, where a step's time follows its
  energy; which kernels move the bytes? DRAM bytes read and written, L2 bytes and time of
  every kernel of one step of a 2-layer Llama-3.2-1B-shaped model (each layer's kernels are
  the same in all 16), for coda's patch and Liger's (``use_cache=False``), side by side.

Each suite starts ``ncu`` on a child of this module (``--child``) that builds the model, warms
it, and brackets the one profiled step with ``cudaProfilerStart/Stop``; ncu's CSV comes back
as rows. ncu serializes kernels and flushes the caches before each one (its defaults: every
kernel starts with a cold L2) and leaves the clocks alone (``--clock-control none``), so its
times are not the step's; the bytes are what each kernel asks of DRAM from a cold L2.
Suites of ``gpu_suite.py`` run only when named (``--only ncu_qk_norm,ncu_traffic``).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
import time

import torch

from benchmarks._common import Diagnostic

TRAFFIC_METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_bytes.sum",
)
TRAFFIC = ["--metrics", ",".join(TRAFFIC_METRICS), "--page", "raw"]
CHILDREN = {  # suite -> the child's arguments and ncu's
    "ncu_qk_norm": (
        ["--shape", "qwen3-0.6B", "--peer", "coda", "--layers", "2"],
        ["--set", "full", "-k", "regex:_dqk_norm_kernel", "-c", "1", "--page", "details"],
    ),
    **{
        f"ncu_traffic_{peer}": (
            ["--shape", "llama-3.2-1B", "--peer", peer, "--layers", "2"],
            TRAFFIC,
        )
        for peer in ("coda", "liger")
    },
}


def ncu_binary() -> str | None:
    """Nsight Compute's command line, from ``PATH`` (the H200 image has it there)."""
    return shutil.which("ncu")


def parse_csv(text: str) -> list[dict]:
    """ncu's CSV (``--csv``) as dicts: the header row gives the keys; only rows whose ``ID`` is
    a number are kept (not the raw page's units row, nor ncu's own ``==PROF==`` notes)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    return [r for r in rows if (r.get("ID") or "").isdigit()]


def _number(value: str):
    try:
        return float(value.replace(",", ""))
    except (AttributeError, ValueError):
        return value


def traffic_rows(rows: list[dict], peer: str) -> list[dict]:
    """One row per kernel name: calls and the sums of ``TRAFFIC_METRICS`` (ns, bytes) over the
    profiled step, largest DRAM traffic first, and one total row."""
    by_kernel: dict = {}
    for r in rows:
        k = by_kernel.setdefault(
            r["Kernel Name"][:120], {"calls": 0, **dict.fromkeys(TRAFFIC_METRICS, 0.0)}
        )
        k["calls"] += 1
        for m in TRAFFIC_METRICS:
            value = _number(r.get(m, ""))
            k[m] += value if isinstance(value, float) else 0.0
    out = [
        {
            "name": f"ncu_traffic/{peer}",
            "kernel": name,
            "calls": k["calls"],
            "us": k["gpu__time_duration.sum"] / 1e3,
            "dram_read_mb": k["dram__bytes_read.sum"] / 1e6,
            "dram_write_mb": k["dram__bytes_write.sum"] / 1e6,
            "l2_mb": k["lts__t_bytes.sum"] / 1e6,
        }
        for name, k in by_kernel.items()
    ]
    out.sort(key=lambda r: -(r["dram_read_mb"] + r["dram_write_mb"]))
    total = {
        key: sum(r[key] for r in out)
        for key in ("calls", "us", "dram_read_mb", "dram_write_mb", "l2_mb")
    }
    return [{"name": f"ncu_traffic/{peer}", "kernel": "total", **total}, *out]


def details_rows(rows: list[dict]) -> list[dict]:
    """The details page: (section, metric, unit, value) of the one profiled kernel."""
    return [
        {
            "name": "ncu_qk_norm/qwen3-0.6B",
            "kernel": r.get("Kernel Name", "")[:80],
            "section": r.get("Section Name", ""),
            "metric": r.get("Metric Name", ""),
            "unit": r.get("Metric Unit", ""),
            "value": _number(r.get("Metric Value", "")),
        }
        for r in rows
        if r.get("Metric Name")
    ]


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def profile(suite: str, timeout_s: float = 240) -> list[dict]:
    """Run ``suite``'s child under ncu; its rows (or one row saying why there are none)."""
    ncu = ncu_binary()
    if ncu is None:
        return [{"name": suite, "error": "ncu not found"}]
    child, opts = CHILDREN[suite]
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.split()
    cmd = [
        ncu,
        "--clock-control",
        "none",
        "--profile-from-start",
        "off",
        "--csv",
        "--print-kernel-base",
        "function",
        "--print-units",
        "base",  # bytes and ns, not ncu's per-value scaling
        *opts,
        sys.executable,
        "-m",
        "benchmarks.probe_ncu",
        "--child",
        *child,
    ]
    deadline = os.environ.get("CODA_SUITE_DEADLINE")  # gpu_suite's --budget-s
    if deadline is not None:
        timeout_s = max(1.0, min(timeout_s, float(deadline) - time.time()))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        stdout, stderr, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as cut:
        stdout, stderr, rc = _text(cut.stdout), _text(cut.stderr), f"cut at {timeout_s:.0f} s"
    rows = parse_csv(stdout)
    if not rows:
        return [
            {"name": suite, "error": f"no ncu rows (rc {rc})", "tail": (stdout + stderr)[-2000:]}
        ]
    peer = child[child.index("--peer") + 1]
    made = details_rows(rows) if "--set" in opts else traffic_rows(rows, peer)
    for r in made:
        r["ncu_version"] = version[-1] if version else "?"
    return made


def child(argv) -> None:
    """Build the model, warm two steps, profile the third (``cudaProfilerStart/Stop``)."""
    from benchmarks.bench_hf import LigerSwitch, training_step
    from benchmarks.hf_models import SHAPES

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", required=True)
    ap.add_argument("--peer", choices=("coda", "liger"), required=True)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    if args.peer == "coda":
        import coda.transformers as ct

        step = training_step(args.shape, ct.apply_coda, args.layers)
    else:  # the patch's process-wide rebinds are undone by ``patch``, put back by ``wrap``
        switch = LigerSwitch.of(SHAPES[args.shape][0])
        step = switch.wrap(training_step(args.shape, switch.patch, args.layers, use_cache=False))
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


class Suite(Diagnostic):
    """``ncu_qk_norm``, or ``ncu_traffic`` (coda's step and Liger's), as a gpu_suite entry."""

    def __init__(self, name: str):
        self.suite = name

    def run(self) -> list[dict]:
        if self.suite == "ncu_qk_norm":
            return profile("ncu_qk_norm")
        return profile("ncu_traffic_coda") + profile("ncu_traffic_liger")


SUITES = ("ncu_qk_norm", "ncu_traffic")

if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child(sys.argv[2:])
