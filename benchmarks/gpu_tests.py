"""The ``gpu`` tests of one device call (``gpu_suite.py`` runs them before its benchmarks):
pytest under a time budget, counted from its junit report or, for a run cut at the budget,
from its streamed ``-v`` lines; with several workers, the tests that ran out of the GPU's
memory beside the others run again alone (``rerun_alone``), reported beside the counts."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# a finished test in pytest's -v stream; under xdist: "[gw0] [ 50%] PASSED tests/...::name"
RESULT_LINE = re.compile(
    r"^(?:(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)"
    r"|\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) (tests/\S+::\S+))",
    re.M,
)


# a -v line's outcome -> the record's count it adds to
OUTCOME = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}


def _finished(text: str):
    """(test id, outcome) for each finished test in a -v log, with or without xdist."""
    for m in RESULT_LINE.finditer(text):
        yield (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))


def run_tests(
    out_dir: str, select: str = "", budget_s: float | None = None, workers: int = 1
) -> dict:
    """Run the whole test suite on the GPU host; count what ran, by marker.

    ``budget_s``: stop pytest after that many seconds and count what had finished from its
    streamed ``-v`` lines (a device call has a hard time limit; a cut run keeps its results).
    With ``workers`` > 1, the failures out of the GPU's memory run again alone in what is left
    of the budget (``rerun_alone``: the record's ``rerun_alone``, the counts unchanged)."""
    xml = os.path.join(out_dir, "pytest_gpu.xml")
    log = os.path.join(out_dir, "pytest_gpu.log")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-v",  # one line per finished test: a cut run is still counted
        "-m",
        "gpu",
        *(["-k", select] if select else []),
        *(["-n", str(workers)] if workers > 1 else []),
        f"--junitxml={xml}",
        "-p",
        "no:cacheprovider",
    ]
    reports = {
        "fuzz": os.path.join(out_dir, "fuzz.json"),
        "determinism": os.path.join(out_dir, "determinism.json"),
    }
    env = {
        **os.environ,
        "CODA_FUZZ_REPORT": reports["fuzz"],
        "CODA_DETERMINISM_REPORT": reports["determinism"],
    }
    t0 = time.time()
    returncode, timed_out, text = _pytest(cmd, xml, log, env, budget_s)
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failures = []
    test_seconds = {}  # from the junit report: what each test cost the call
    if timed_out or not os.path.exists(xml):  # what finished before the cut
        for test, outcome in _finished(text.replace("\r", "")):
            counts[OUTCOME[outcome]] += 1
            if outcome in ("FAILED", "ERROR"):
                failures.append(test)
    else:
        for case in ET.parse(xml).getroot().iter("testcase"):
            kids = {c.tag for c in case}
            name = f"{case.get('classname')}::{case.get('name')}"
            test_seconds[name] = round(float(case.get("time", 0)), 1)
            if "failure" in kids:
                counts["failed"] += 1
                failures.append(name)
            elif "error" in kids:
                counts["errors"] += 1
                failures.append(name)
            elif "skipped" in kids:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    tail = text.strip().splitlines()[-1:] or [""]
    if timed_out:
        tail = [f"cut after {budget_s:.0f} s: {counts} finished"]
    alone = {}
    if workers > 1 and failures and not timed_out and os.path.exists(xml):  # (its report)
        left = None if budget_s is None else budget_s - (time.time() - t0)
        alone = rerun_alone(_out_of_memory(xml), out_dir, env, left)
    if alone:
        won = sum(o == "passed" for o in alone["outcomes"].values())
        tail[0] += (
            f"; {len(alone['outcomes'])} out of the GPU's memory beside the other workers,"
            f" run alone: {won} passed"
        )
    seconds = round(time.time() - t0, 1)
    return {
        "command": _shown(cmd, out_dir),
        "returncode": returncode,
        "timed_out": timed_out,
        **counts,
        "test_seconds": test_seconds,
        "failures": failures,
        "rerun_alone": alone or None,
        "summary": tail[0],
        "seconds": seconds,
        **{k: json.load(open(p)) if os.path.exists(p) else None for k, p in reports.items()},
    }


def _shown(cmd: list, out_dir: str) -> str:
    """A pytest command as the record shows it: no machine paths."""
    return shlex.join(a.replace(out_dir, "$OUT") for a in ["python", *cmd[1:]])


def _pytest(cmd: list, xml: str, log: str, env: dict, budget_s: float | None):
    """Run one pytest command into ``log`` and ``xml``, cut at ``budget_s``: (return code,
    whether it was cut, the log's text)."""
    if os.path.exists(xml):
        os.remove(xml)  # a previous run's report must not stand in for this one
    timed_out = False
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
    with open(log) as f:
        return proc.returncode, timed_out, f.read()


# what a test that ran out of the GPU's memory reports (torch's error, or the driver's)
OUT_OF_MEMORY = ("OutOfMemoryError", "out of memory")


def _node_id(classname: str, name: str) -> str | None:
    """A junit test case's pytest node id (``tests.test_x`` or ``tests.test_x.TestC`` and a
    name: ``tests/test_x.py[::TestC]::name``), or None where no module file matches."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.exists(os.path.join(ROOT, path)):
            return "::".join([path, *parts[i:], name])
    return None


def _out_of_memory(xml: str) -> list[str]:
    """The node ids of the tests that a junit report says failed, or errored, out of the
    GPU's memory."""
    import xml.etree.ElementTree as ET

    ids = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        for kid in case:
            said = (kid.get("message") or "") + (kid.text or "")
            if kid.tag in ("failure", "error") and any(s in said for s in OUT_OF_MEMORY):
                node = _node_id(case.get("classname", ""), case.get("name", ""))
                ids += [node] if node else []
                break
    return ids


def rerun_alone(nodes: list[str], out_dir: str, env: dict, budget_s: float | None) -> dict:
    """Run ``nodes`` again one after another, the GPU to themselves: with several workers an
    80 GB card can run out of memory beside the others (runs 327, 338), a failure of the
    call, not of the test. Returns {} (nothing to run, or under a minute of ``budget_s``
    left), else the command and each test's outcome; the parallel run's counts stand as
    they are."""
    if not nodes or (budget_s is not None and budget_s < 60):
        return {}
    xml = os.path.join(out_dir, "pytest_gpu_alone.xml")
    log = os.path.join(out_dir, "pytest_gpu_alone.log")
    cmd = [sys.executable, "-m", "pytest", *nodes, "-v", f"--junitxml={xml}"]
    cmd += ["-p", "no:cacheprovider"]
    _, timed_out, text = _pytest(cmd, xml, log, env, budget_s)
    outcomes = {n: "not run" for n in nodes}
    for test, outcome in _finished(text.replace("\r", "")):
        outcomes[test] = OUTCOME[outcome]
    return {"command": _shown(cmd, out_dir), "timed_out": timed_out, "outcomes": outcomes}
