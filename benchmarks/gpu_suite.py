"""One device call: every ``gpu`` test, then every benchmark, into one JSON record.

    source .bundle/gpu_env.sh .bundle && PYTHONPATH=$PWD:$PYTHONPATH \
        python benchmarks/gpu_suite.py --commit $(git rev-parse HEAD) --out $OUT

Writes ``benchmarks/results/<date>_<gpu>.json`` (and a copy plus logs under ``--out``): GPU
name, torch / cutlass-dsl / quack versions, git commit, the exact command, the test counts,
and for each shape the median ms, p20/p80, TFLOP/s and ratios against the peers. The record
is rewritten after each suite; ``--budget-s`` keeps later suites and variants from starting,
and a call ended by SIGTERM (``timeout`` set under the device's own limit) still writes it,
naming the part that was cut, with the rows that suite had reported (``_common.progress``).
A SIGTERM is acted on only between Python bytecodes of the main thread, so a suite blocked
in C++ (a backward pass waiting on Inductor's compile: run 134) never writes it; ``--limit-s``
arms a watchdog thread that writes the same record, with every thread's stack, and ends the
process at that limit wherever the main thread is.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.gpu_tests import run_tests  # noqa: E402
from benchmarks.provenance import source_digest  # noqa: E402 (a record's ``source_sha256``)

SELECTIONS = (  # environment variables that change what runs: named in the recorded command
    "CODA_BENCH_ROUNDS",
    "CODA_HF_SHAPES",
    "CODA_HF_PEERS",
    "CODA_HF_AMP",
    "CODA_HF_TOKENS",
    "CODA_LAYER_SHAPES",
    "CODA_LAYER_POST_NORMS",
    "CODA_LM_HEAD_SHAPES",
    "CODA_LM_HEAD_PEERS",
    "CODA_LM_HEAD_TARGETS",
    "CODA_LM_HEAD_SOFTCAP",
    "CODA_MODEL_SHAPES",
    "CODA_MODEL_PEERS",
    "CODA_MODEL_AMP",
    "CODA_TUNE_SHAPES",
    "CODA_TUNE_ONLY",
    "CODA_TUNE_WIDE",
    "CODA_ROW_PASS_SHAPES",
    "CODA_GEMM_KEYS",
    "CODA_GEMM_VARY",
    "CODA_ORIGIN_KERNELS",
    "CODA_ORIGIN_STEPS",
    "CODA_COMPILE_GRAPHS",
)


def suite_list(args) -> list:
    """(name, runner) of every benchmark suite, in run order ("tuning" only with --tune; the
    diagnostics only when ``--only`` names them); ``--only`` picks among these names, or
    "none" (the tests alone)."""
    from benchmarks import (
        bench_attention_layout,
        bench_attention_numerics,
        bench_embedding,
        bench_forward,
        bench_gemm_residual_rms,
        bench_hf,
        bench_layer,
        bench_layer_grad_numerics,
        bench_numerics,
        bench_train,
        probe_compile_graphs,
        probe_gemm_in_step,
        probe_graph_gaps,
        probe_head_norm,
        probe_hf_peak,
        probe_kernel_origin,
        probe_loss_rows,
        probe_ncu,
        probe_post_norm,
        probe_row_passes,
        probe_triton_launch,
        tune_configs,
    )

    return [
        # host-time suites first, in a process nothing heavy has run in yet: run 163 timed the
        # host cost after the layer and LM-head suites and read every row (torch.mm's too)
        # 1.3-2.2x what run 162 read in a fresh process
        ("host", StepPart("host")),
        (probe_triton_launch.SUITE, probe_triton_launch.Suite()),
        ("main_demo", Demo(["demos/main.py"])),
        ("numerics", bench_numerics),
        ("attention_numerics", bench_attention_numerics),
        ("attention_layout", bench_attention_layout),
        ("layer_grad_numerics", bench_layer_grad_numerics),
        *([("tuning", tune_configs)] if args.tune else []),
        ("gemm_residual_rms", bench_gemm_residual_rms),
        ("embedding", bench_embedding),
        ("forward", bench_forward),
        ("layer_forward", bench_layer),
        ("layer_train", bench_train.LayerOnly),
        ("lm_head_train", bench_train.LMHeadOnly),
        ("graph", StepPart("graph")),
        ("model", StepPart("model")),
        ("hf", bench_hf),
        ("train_demo", Demo(["demos/train.py", "--png", os.path.join(args.out, "train_loss.png")])),
        (
            "train_demo_graph",
            Demo(["demos/train.py", "--graph", "--png", os.path.join(args.out, "train_graph.png")]),
        ),
        (
            "train_demo_compiled",
            Demo(
                [
                    "demos/train.py",
                    "--compile",
                    "--png",
                    os.path.join(args.out, "train_compiled.png"),
                ]
            ),
        ),
        # diagnostics, run only when named: the row-pass probes, attention and GEMM configs
        # inside the step, hardware counters (ncu) on the step's kernels, who launches a kernel,
        # the LM head's final-norm pass at each launch shape, a graphed step's kernels and gaps,
        # which shapes torch.compile's own CUDA graphs capture over coda, an HF model's peak
        # memory step by step
        *[(name, probe_row_passes.Suite(name)) for name in probe_row_passes.PASSES],
        (bench_attention_layout.IN_STEP, bench_attention_layout.InStep()),
        (probe_gemm_in_step.SUITE, probe_gemm_in_step.Suite()),
        *[(name, probe_ncu.Suite(name)) for name in probe_ncu.SUITES],
        (probe_kernel_origin.SUITE, probe_kernel_origin.Suite()),
        (probe_head_norm.SUITE, probe_head_norm.Suite()),
        (probe_post_norm.SUITE, probe_post_norm.Suite()),
        (probe_loss_rows.SUITE, probe_loss_rows.Suite()),
        (probe_graph_gaps.SUITE, probe_graph_gaps.Suite()),
        (probe_compile_graphs.SUITE, probe_compile_graphs.Suite()),
        (probe_hf_peak.SUITE, probe_hf_peak.Suite()),
    ]


def chosen(suites: list, only: str) -> list:
    """The suites ``--only`` names, in run order; without ``--only`` every suite but the
    diagnostics (``_common.Diagnostic``: run only when named)."""
    from benchmarks._common import Diagnostic

    named = only.split(",")
    return [(n, m) for n, m in suites if n in named or (not only and not isinstance(m, Diagnostic))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, ".out")))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--tests", default="", help="pytest -k expression: run only these gpu tests")
    ap.add_argument("--workers", type=int, default=1, help="pytest-xdist workers for the tests")
    ap.add_argument("--tune", action="store_true", help="also sweep tile configs")
    ap.add_argument("--only", default="", help="comma-separated benchmark names to run")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="time budget of the whole call: the tests are cut at it and no benchmark starts "
        "after it (each is recorded as skipped), so a call under a hard limit keeps its results",
    )
    ap.add_argument(
        "--limit-s",
        type=float,
        default=None,
        help="hard limit of the whole call: at it a watchdog thread writes the record (the part "
        "running named as cut, with its rows so far and every thread's stack) and ends the "
        "process with status 124, even while the main thread is blocked outside Python",
    )
    args = ap.parse_args()
    suites = suite_list(args)
    known = [n for n, _ in suites]
    unknown = set(args.only.split(",")) - set(known) - {"", "none"}
    if unknown:  # before any test runs: a misspelt suite would cost a device call
        ap.error(
            f"--only: unknown {sorted(unknown)}; known: {', '.join(known)}, none"
            + ("" if args.tune else " (and tuning, with --tune)")
        )
    suites = chosen(suites, args.only)
    t_start = time.time()
    if args.budget_s is not None:  # long benchmarks skip their remaining variants past it
        os.environ["CODA_SUITE_DEADLINE"] = str(t_start + args.budget_s)
    os.makedirs(args.out, exist_ok=True)

    import torch

    from benchmarks._common import card
    from coda.env import describe

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": args.commit,
        "source_sha256": source_digest(),  # the tree that ran (``benchmarks/provenance.py``)
        "command": " ".join(  # the CODA_* selections (shapes, peers) are part of the command
            [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items()) if k in SELECTIONS]
            + ["python", shlex.join(a.replace(args.out, "$OUT") for a in sys.argv)]
        ),
        "env": describe(),
        "torch_cuda": torch.version.cuda,
        "card": card(),  # which card ran it: runs of one commit differ by a card's power
    }
    running = {"part": "setup" if args.skip_tests else "gpu tests", "since": time.time()}
    signal.signal(signal.SIGTERM, lambda signum, _: _cut(record, args.out, running, signum))
    if args.limit_s is not None:
        left = t_start + args.limit_s - time.time()
        watchdog = threading.Timer(left, _limit_reached, (record, args.out, running))
        watchdog.daemon = True
        watchdog.start()
    if not args.skip_tests:
        record["gpu_tests"] = run_tests(args.out, args.tests, args.budget_s, args.workers)
        print("gpu tests:", record["gpu_tests"]["summary"], flush=True)
        write_record(record, args.out)

    from benchmarks._common import PROGRESS, out_of_time
    from coda.kernels import tuned

    record["tuned_configs_source"] = tuned.SOURCE
    record["benchmarks"] = {}
    for name, mod in suites:
        t0 = time.time()
        running.update(part=name, since=t0)
        PROGRESS.clear()
        if out_of_time():  # CODA_SUITE_DEADLINE, set from --budget-s above
            record["benchmarks"][name] = {"skipped": f"time budget {args.budget_s:.0f} s spent"}
            write_record(record, args.out)
            continue
        # each suite starts from no compiled code, as in a process of its own: Inductor
        # autotunes a dynamic-shape kernel's launch once, at its first call's size, and keeps
        # it, so a suite's row kernels must not depend on which suite ran before (run 169:
        # the LM head's Inductor dW cast profiled at 2x run 163's after the host suite)
        torch._dynamo.reset()
        try:
            record["benchmarks"][name] = mod.run()
        except Exception as e:  # recorded, never hidden
            import traceback

            failed = {"error": repr(e), "trace": traceback.format_exc()}
            # the rows it had finished (run 293: an out-of-memory error lost a whole suite)
            record["benchmarks"][name] = {**failed, "rows_so_far": list(PROGRESS)}
        record.setdefault("suite_seconds", {})[name] = round(time.time() - t0, 1)
        print(f"{name}: {time.time() - t0:.0f}s", flush=True)
        write_record(record, args.out)  # after every suite: a run cut short keeps what it did

    print_table(record)


class StepPart:
    """One part of ``bench_step`` ("host", "graph" or "model") alone, as a suite entry."""

    def __init__(self, part):
        self.part = part

    def run(self):
        from benchmarks import bench_step

        return bench_step.run(parts=(self.part,))


class Demo:
    """A demo as a suite entry, run as a user runs it: its output becomes the record's rows."""

    def __init__(self, argv):
        self.argv = argv

    def run(self):
        cmd = [sys.executable, *self.argv]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        return [
            {
                "name": os.path.basename(self.argv[0]),
                "command": shlex.join(["python", *self.argv]),
                "returncode": proc.returncode,
                "stdout": lines[-20:],
                "stderr_lines": len(proc.stderr.splitlines()),
                "stderr_tail": proc.stderr.splitlines()[-5:],
            }
        ]


def no_machine_paths(text: str, out_dir: str | None = None) -> str:
    """Records name GPU, versions, commit and command, never a folder of the machine: paths in
    captured tracebacks, warnings and stacks become repository-relative, "site-packages/..."
    or "stdlib/...", Inductor's generated code "torchinductor/...", and the output folder (a
    demo's plot) "$OUT"."""
    if out_dir:
        text = text.replace(os.path.abspath(out_dir), "$OUT")
    text = text.replace(ROOT + os.sep, "")
    text = re.sub(r"/[^\s\"']*/site-packages/", "site-packages/", text)
    text = re.sub(r"/[^\s\"']*/torchinductor_[^/\s\"']*/", "torchinductor/", text)
    return text.replace(sysconfig.get_paths()["stdlib"] + os.sep, "stdlib/")


def _cut(record, out_dir, running, signum):
    """SIGTERM (``timeout`` ending a device call): the record is written with what finished,
    and names the part that was running when the call was cut, with the rows it had reported
    (``_common.progress``; a suite returns the rest only when it ends), instead of the call
    leaving no record at all."""
    from benchmarks._common import PROGRESS

    _mark_cut(record, running, f"cut by signal {signum}", PROGRESS)
    write_record(record, out_dir)
    sys.exit(128 + signum)


def _mark_cut(record, running, how, rows, **more):
    part, seconds = running["part"], time.time() - running["since"]
    cut = f"{how} after {seconds:.0f} s of this part"
    if "benchmarks" in record:  # a benchmark suite was running
        record["benchmarks"][part] = {"cut": cut, "rows_so_far": list(rows), **more}
    else:
        record["cut"] = f"{part}: {cut}"
        record.update(more)


def _stacks() -> list[str]:
    """Every thread's Python stack (``faulthandler``'s text), runs of a repeated frame folded
    into one line with its count."""
    import faulthandler

    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        lines = [ln.rstrip() for ln in f if ln.strip()]
    folded: list[str] = []
    for ln in lines:
        if folded and folded[-1].split(" [x")[0] == ln:
            head, _, n = folded[-1].partition(" [x")
            folded[-1] = f"{head} [x{int(n.rstrip(']') or 1) + 1}]"
        else:
            folded.append(ln)
    return folded


def _hard_exit(code: int) -> None:
    os._exit(code)


def _limit_reached(record, out_dir, running):
    """``--limit-s`` spent (the watchdog thread): the record as ``_cut`` writes it, plus every
    thread's stack, then the process ends (status 124, as ``timeout``'s) wherever its main
    thread is."""
    from benchmarks._common import PROGRESS

    _mark_cut(record, running, "cut by --limit-s", PROGRESS, stacks=_stacks())
    write_record(record, out_dir)
    print("gpu_suite: --limit-s reached; record written", flush=True)
    _hard_exit(124)


_WRITING = threading.Lock()  # the main thread and the watchdog both write the record


def write_record(record, out_dir):
    gpu = record["env"].get("gpu", "nogpu").split()[-1].lower()
    fname = f"{record['date'][:10]}_{gpu}.json"
    with _WRITING:
        # compact: every GPU call carries the working tree, which is kept under 4 MB
        text = no_machine_paths(json.dumps(record, separators=(",", ":")), out_dir)
        for d in (os.path.join(ROOT, "benchmarks", "results"), out_dir):
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, fname), "w") as f:
                f.write(text)


def print_table(record):
    keys = (
        "M",
        "K",
        "N",
        "d",
        "seed",
        "ms",
        "tflops",
        "ratio_vs_quack_raw_tflops",
        "ratio_vs_cublas_tflops",
        "speedup_of_coda",
        "ratio_vs_floor",
        "ratio",
        "raw_ms",
        "kernel_ms",
        "cublas_ms",
        "us_per_call",
        "us_per_launch",
        "ratio_vs_quack_raw",
        "ratio_vs_triton",
        "kernels_per_call",
        "speedup",
        "tokens_per_s",
        "mfu",
        "peak_gib",
        "speedup_vs_torch_compile",
        "speedup_vs_best_peer",
        "extra_gib",
        "activation_gib",
        "returncode",
        "err_dq",
        "err_dk",
        "ratio_dW_q",
        "ratio_dW_k",
        "err_coda_dq",
        "err_torch_dq",
        "error",
    )
    for name, rows in record["benchmarks"].items():
        if isinstance(rows, dict):  # an error or a skip, recorded as such, and what it finished
            how = next(k for k in ("error", "cut", "skipped") if k in rows)
            print(name, how.upper(), rows[how])
            rows = rows.get("rows_so_far", [])
        for r in rows:
            vals = " ".join(f"{k}={_fmt(r[k])}" for k in keys if r.get(k) is not None)
            print(f"{r['name']:40s} {vals}{_fmt_config(r.get('config'))}")


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _fmt_config(c):
    if not isinstance(c, dict) or "tile_m" not in c:
        return ""
    kind = "pp" if c["pingpong"] else "coop"
    return f" cfg={c['tile_m']}x{c['tile_n']}/c{c['cluster_m']}x{c['cluster_n']}/{kind}"


if __name__ == "__main__":
    main()
