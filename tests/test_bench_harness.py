"""The benchmark harness's timeline arithmetic (``benchmarks/_common.py``), on made-up profiler
events: the idle time it reports is the time in which no kernel runs, overlapping kernels
count once, and the steady-state report leaves the first call out. The timings themselves
need the GPU; these rules do not."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks import _common


def _event(name, start, end):
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        device_time=end - start,
        device_type=SimpleNamespace(name="CUDA"),
    )


def test_gaps_count_the_time_no_kernel_runs():
    # b overlaps a and ends after it; the gap before c starts at b's end, not a's
    events = [_event("a", 0, 10), _event("b", 5, 12), _event("c", 20, 30), _event("d", 31, 40)]
    assert _common._gaps(events) == [(8, "b", "c"), (1, "c", "d")]
    # a long kernel covering a short one: no gap after the short one
    events = [_event("long", 0, 100), _event("short", 10, 20), _event("next", 100, 110)]
    assert _common._gaps(events) == []


def test_steady_idle_leaves_out_the_first_call(monkeypatch):
    calls = 3  # two kernels per call, 8 us each, 2 us apart; the first call starts late
    events = [_event("k0", 0, 8), _event("k1", 500, 508)]
    events += [_event(f"k{i}", 500 + (i - 1) * 10, 508 + (i - 1) * 10) for i in range(2, 6)]
    monkeypatch.setattr(_common, "_profiled_kernels", lambda fn, n: events)
    monkeypatch.setattr(_common.torch.cuda, "synchronize", lambda: None)
    report = _common.steady_idle(lambda: None, calls=calls)
    assert report["steady_calls"] == 2
    assert report["steady_idle_ms"] == pytest.approx(3 * 2 / 2 * 1e-3)  # 3 gaps of 2 us
    assert report["steady_kernel_ms"] == pytest.approx(4 * 8 / 2 * 1e-3)


def test_graph_gaps_chain_splits_idle_inside_and_between_calls(monkeypatch):
    from benchmarks import probe_graph_gaps

    # three calls of two kernels (8 us each); 2, 2 and 9 us idle inside them, 7 and 0 between
    starts = [0, 10, 25, 35, 43, 60]
    events = [_event(f"k{i % 2}", t, t + 8) for i, t in enumerate(starts)]
    monkeypatch.setattr(probe_graph_gaps, "_profiled_kernels", lambda fn, n: events)
    monkeypatch.setattr(probe_graph_gaps, "host_ms", lambda fn, reps: 0.25)
    report = probe_graph_gaps.chain(lambda: None, calls=3)
    assert report["kernels_per_call"] == 2
    assert report["idle_inside_us_per_call"] == pytest.approx(13 / 3)
    assert report["idle_between_us_per_call"] == pytest.approx(7 / 2)
    assert report["kernel_us_per_call"] == pytest.approx(16)
    assert report["span_us_per_call"] == pytest.approx(68 / 3)
    assert report["host_us_one_call_idle_gpu"] == pytest.approx(250)
    # a kernel count that is no multiple of the calls has no period to split by
    assert "error" in probe_graph_gaps.chain(lambda: None, calls=4)


def test_the_lm_head_s_extra_memory_is_the_peak_over_a_start_with_its_gradients_resident(
    monkeypatch,
):
    """``bench_train.extra_gib`` on a fake allocator: a training step that clears the
    gradients (G bytes), peaks at T transient bytes and leaves new gradients; the loss call
    measured after it accumulates into the resident gradients, so the figure is T + G (its
    new gradients are transient until added), issue 9's metric, not T - G (the figure before
    session 83, which cleared the gradients inside the measured step and then subtracted
    them)."""
    from benchmarks import bench_train

    G, T = 3 * 2**30, 5 * 2**30
    mem = {"now": 7 * 2**30, "peak": 0, "grads": False}

    def alloc(n):
        mem["now"] += n
        mem["peak"] = max(mem["peak"], mem["now"])

    class Loss:
        def backward(self):
            alloc(T)  # activations, chunks, accumulators
            alloc(G)  # the new gradients
            mem["now"] -= T
            if mem["grads"]:  # accumulated into the resident ones, then freed
                mem["now"] -= G
            mem["grads"] = True

    def step():
        if mem["grads"]:
            mem["now"] -= G
            mem["grads"] = False
        Loss().backward()

    monkeypatch.setattr(bench_train, "settled_allocated", lambda: mem["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: mem.update(peak=mem["now"]))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: mem["peak"])
    assert bench_train.extra_gib(step, Loss) == (T + G) / 2**30
    assert mem["grads"] and mem["now"] == 7 * 2**30 + G  # the gradients stay resident


def test_a_call_cut_by_sigterm_still_writes_its_record(monkeypatch, tmp_path):
    """``timeout`` ending a device call mid-suite: the record is written with the suites that
    finished, and names the one that was running as cut, with the rows it had reported
    (``_common.progress``), instead of the call leaving nothing; the exit status says a
    signal ended it."""
    import json
    import os
    import signal

    from benchmarks import gpu_suite

    class Done:
        @staticmethod
        def run():
            return [{"name": "done/row", "ms": 1.0}]

    class Cut:
        @staticmethod
        def run():
            _common.progress({"name": "cut/first", "ms": 2.0})
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("the handler ends the call before this line")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(gpu_suite, "ROOT", str(tmp_path))  # no record in the repository
    monkeypatch.setattr(gpu_suite, "suite_list", lambda args: [("done", Done), ("cut", Cut)])
    out = tmp_path / "out"
    monkeypatch.setattr("sys.argv", ["gpu_suite.py", "--skip-tests", "--out", str(out)])
    try:
        with pytest.raises(SystemExit) as stop:
            gpu_suite.main()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert stop.value.code == 128 + signal.SIGTERM
    (path,) = out.glob("*.json")
    benchmarks = json.loads(path.read_text())["benchmarks"]
    assert benchmarks["done"] == [{"name": "done/row", "ms": 1.0}]
    assert benchmarks["cut"]["cut"].startswith("cut by signal 15 after ")
    assert benchmarks["cut"]["rows_so_far"] == [{"name": "cut/first", "ms": 2.0}]


def test_a_suite_that_raises_keeps_its_finished_rows(monkeypatch, tmp_path, capsys):
    """A suite raising (run 293: out of GPU memory in its last shape) is recorded with its
    error and the rows it had reported, which the call's table prints, and the next suite
    still runs."""
    import json

    from benchmarks import gpu_suite

    class Fails:
        @staticmethod
        def run():
            _common.progress({"name": "fails/first", "ms": 2.0})
            raise MemoryError("out of memory")

    class After:
        @staticmethod
        def run():
            return [{"name": "after/row", "ms": 1.0}]

    monkeypatch.setattr(gpu_suite, "ROOT", str(tmp_path))  # no record in the repository
    monkeypatch.setattr(gpu_suite, "suite_list", lambda args: [("fails", Fails), ("after", After)])
    out = tmp_path / "out"
    monkeypatch.setattr("sys.argv", ["gpu_suite.py", "--skip-tests", "--out", str(out)])
    gpu_suite.main()
    (path,) = out.glob("*.json")
    benchmarks = json.loads(path.read_text())["benchmarks"]
    assert benchmarks["fails"]["error"] == "MemoryError('out of memory')"
    assert benchmarks["fails"]["rows_so_far"] == [{"name": "fails/first", "ms": 2.0}]
    assert benchmarks["after"] == [{"name": "after/row", "ms": 1.0}]
    table = capsys.readouterr().out
    assert "fails ERROR MemoryError('out of memory')" in table and "fails/first" in table


def test_hf_rounds_hold_one_variants_gradients_at_a_time(monkeypatch):
    """``bench_hf``'s timer drops a variant's gradients once it is timed, and when its step
    raises, so the interleaved rounds hold one model's gradients, not every variant's."""
    from benchmarks import bench_hf

    monkeypatch.setattr(bench_hf, "clocked", lambda timer: lambda fn: (fn(), {"ms": 1.0})[1])
    models = {n: torch.nn.Linear(3, 2) for n in "ab"}

    def step_of(model, fails=False):
        def step():
            model(torch.ones(1, 3)).sum().backward()
            assert all(p.grad is not None for p in model.parameters())
            if fails:
                raise RuntimeError("out of memory")

        return step

    steps = {"a": step_of(models["a"]), "b": step_of(models["b"], fails=True)}
    timer = bench_hf._one_held({steps[n]: models[n] for n in "ab"})
    assert timer(steps["a"]) == {"ms": 1.0}
    assert all(p.grad is None for p in models["a"].parameters())
    with pytest.raises(RuntimeError, match="out of memory"):
        timer(steps["b"])
    assert all(p.grad is None for p in models["b"].parameters())


def test_a_call_past_its_limit_writes_its_record_while_blocked(monkeypatch, tmp_path):
    """``--limit-s``: a suite blocked outside Python (here a wait on an event, as a backward
    pass waits on Inductor's compile) still gets its record at the limit, from the watchdog
    thread: the part named as cut, its rows so far and every thread's stack, then the exit
    with status 124 (stood in for here, so the test process lives)."""
    import json
    import threading

    from benchmarks import gpu_suite

    released, seen = threading.Event(), {}

    def exit_stand_in(code):
        (path,) = (tmp_path / "out").glob("*.json")
        seen.update(code=code, record=json.loads(path.read_text()))
        released.set()

    class Blocked:
        @staticmethod
        def run():
            _common.progress({"name": "blocked/first", "ms": 3.0})
            assert released.wait(timeout=60), "the watchdog never fired"
            return []

    monkeypatch.setattr(gpu_suite, "ROOT", str(tmp_path))
    monkeypatch.setattr(gpu_suite, "suite_list", lambda args: [("blocked", Blocked)])
    monkeypatch.setattr(gpu_suite, "_hard_exit", exit_stand_in)
    out = tmp_path / "out"
    argv = ["gpu_suite.py", "--skip-tests", "--out", str(out), "--limit-s", "2"]
    monkeypatch.setattr("sys.argv", argv)
    gpu_suite.main()
    assert seen["code"] == 124
    cut = seen["record"]["benchmarks"]["blocked"]
    assert cut["cut"].startswith("cut by --limit-s after ")
    assert cut["rows_so_far"] == [{"name": "blocked/first", "ms": 3.0}]
    blocked_frame = [ln for ln in cut["stacks"] if "test_bench_harness.py" in ln and "in run" in ln]
    assert blocked_frame, cut["stacks"]  # the main thread's stack, inside the blocked suite


def test_records_name_no_folder_of_the_machine(tmp_path):
    import os
    import sysconfig
    import tempfile

    from benchmarks import gpu_suite

    out = str(tmp_path / "out")
    text = f"python demos/train.py --png {out}/train.png; {gpu_suite.ROOT}/coda/ops.py:3"
    text += "; /usr/lib/python3/site-packages/torch/x.py"
    text += f"; {sysconfig.get_paths()['stdlib']}/threading.py"  # a thread's stack
    cache = os.path.join(tempfile.gettempdir(), "torchinductor_someone")  # Inductor's code
    text += f'; File "{cache}/gk/cgk.py", line 3'
    assert gpu_suite.no_machine_paths(text, out) == (
        "python demos/train.py --png $OUT/train.png; coda/ops.py:3; site-packages/torch/x.py"
        '; stdlib/threading.py; File "torchinductor/gk/cgk.py", line 3'
    )


def test_interleaved_rounds_rotate_and_take_the_median():
    order, clock = [], iter([5.0, 1.0, 9.0, 2.0, 6.0, 3.0, 7.0, 4.0, 8.0])

    def timer(fn):
        order.append(fn)
        return {"ms": next(clock), "p20_ms": 0.0, "p80_ms": 0.0}

    out = _common.interleaved({"a": "a", "b": "b", "c": "c"}, rounds=3, timer=timer)
    # each round starts one name later, stepping by 1, 2, 1: a b c | b a c | c a b
    assert order == ["a", "b", "c", "b", "a", "c", "c", "a", "b"]
    assert out["a"]["rounds_ms"] == [5.0, 6.0, 4.0] and out["a"]["ms"] == 5.0
    assert out["b"]["rounds_ms"] == [1.0, 2.0, 8.0] and out["b"]["ms"] == 2.0
    assert out["c"]["rounds_ms"] == [9.0, 3.0, 7.0] and out["c"]["ms"] == 7.0
    assert out["b"]["spread"] == pytest.approx((8.0 - 1.0) / 2.0)


@pytest.mark.parametrize("n", [2, 3, 4, 9, 15, 16])
def test_every_round_times_every_entry_once_each_after_another_neighbour(n):
    """``round_orders``: each round a permutation starting one entry later; an entry's
    predecessor differs between any two rounds while there are steps coprime to n (the LM
    head's 15 entries: 8 steps, so its 3 to 7 rounds give every entry 3 to 7 predecessors)."""
    rounds = 7
    orders = _common.round_orders(n, rounds)
    assert [o[0] for o in orders] == [r % n for r in range(rounds)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    distinct = min(sum(1 for s in range(1, n) if math.gcd(s, n) == 1), rounds)
    for j in range(n):  # (the round's first entry has none)
        before = [o[o.index(j) - 1] for o in orders[:distinct] if o.index(j) > 0]
        assert len(set(before)) == len(before), (n, j, before)


def test_probe_rows_keep_each_variants_rounds_clock_and_its_own_kernels(monkeypatch):
    profiled = []
    monkeypatch.setattr(
        _common, "kernel_table", lambda fn, steps, top: profiled.append(fn) or [{"top": top}]
    )
    timed = {
        "a": {"ms": 2.0, "rounds_ms": [2.0, 3.0], "sm_mhz": 1500.0, "p20_ms": 0.0},
        "b": {"ms": 1.0, "rounds_ms": [1.0, 1.5]},  # no clock where nvidia-smi gave none
    }
    out = _common.probe_rows({"a": "fa", "b": "fb"}, timed, top=3)
    assert profiled == ["fa", "fb"]
    assert out["a"] == {
        "ms": 2.0,
        "rounds_ms": [2.0, 3.0],
        "sm_mhz": 1500.0,
        "kernels": [{"top": 3}],
    }
    assert out["b"]["sm_mhz"] is None and out["b"]["rounds_ms"] == [1.0, 1.5]


def test_against_floor_sums_the_parts_and_reports_a_failing_variant():
    ms = {"gemm": 2.0, "attn": 1.0, "coda": 3.3, "peer": 3.6, None: 3.3}  # None: both parts

    def timer(fn):
        return {"ms": ms[fn()], "p20_ms": 0.0, "p80_ms": 0.0}

    def broken():
        raise RuntimeError("no kernel")

    rows = []
    parts = {"gemm": lambda: "gemm", "attn": lambda: "attn"}
    variants = {"coda": lambda: "coda", "broken": broken, "peer": lambda: "peer"}
    out = _common.against_floor("layer", {"d": 8}, parts, variants, rows, timer=timer)
    assert set(out) == {"coda", "peer"}
    assert out["coda"]["ratio_vs_floor"] == pytest.approx(1.1)
    assert out["peer"]["ratio_vs_floor"] == pytest.approx(1.2)
    assert out["coda"]["ratio_vs_floor_as_one_step"] == pytest.approx(1.0)
    names = [r["name"] for r in rows]
    assert names == [
        "layer/broken",
        "layer/floor_part/gemm",
        "layer/floor_part/attn",
        "layer/floor",
        "layer/floor_as_one_step",
    ]
    assert "no kernel" in rows[0]["error"] and rows[-2]["ms"] == pytest.approx(3.0)
    assert rows[-1]["ratio_vs_floor"] == pytest.approx(1.1)


def test_beside_floor_profiles_the_parts_and_their_one_step_around_the_step(monkeypatch):
    # each part alone reads 10 us before the step and 14 after (a clock that moved), the parts
    # as one step 20 and 16 (a step's own, lower clock); the step's kernels sum to 30 us:
    # each floor is the mean of its two readings, and both readings are kept
    ran, current = [], []
    readings = {"gemm": iter([6.0, 8.0]), "attn": iter([4.0, 6.0]), "one": iter([20, 16])}

    def table(fn, steps, top):
        current.clear()
        fn()
        ran.append(list(current))
        name = current[0] if len(current) == 1 else "one"
        if name == "step":
            return [
                {"kernel": "k1", "calls": 1, "us": 20.0},
                {"kernel": "k2", "calls": 2, "us": 10.0},
            ]
        return [{"kernel": name, "calls": 1, "us": float(next(readings[name]))}]

    monkeypatch.setattr(_common, "kernel_table", table)
    parts = {"gemm": lambda: current.append("gemm"), "attn": lambda: current.append("attn")}
    out = _common.beside_floor(parts, lambda: current.append("step"))
    one_step = ["gemm", "attn"]
    assert ran == [["gemm"], ["attn"], one_step, ["step"], one_step, ["gemm"], ["attn"]]
    assert out["floor_parts_us"] == {"gemm": 7.0, "attn": 5.0}
    assert out["floor_us_before_after"] == [10.0, 14.0]
    assert out["floor_step_us"] == 18.0 and out["floor_step_us_before_after"] == [20.0, 16.0]
    assert out["kernel_us"] == 30.0 and out["kernel_ratio_vs_floor"] == pytest.approx(2.5)
    assert out["kernel_ratio_vs_floor_step"] == pytest.approx(30 / 18)
    assert [k["kernel"] for k in out["kernels"]] == ["k1", "k2"]


def test_gpu_clock_medians_skip_unreadable_samples():
    clock = _common.GpuClock()
    clock.lines = ["1980, 650.5", "[N/A], [N/A]", "1830, 700.0", "1755, 699.0", "17"]
    assert clock.medians() == {"sm_mhz": 1830.0, "power_w": 699.0, "clock_samples": 3}
    clock.lines = []
    assert clock.medians() == {}


def test_card_names_the_gpu_that_ran_a_record(monkeypatch):
    """``card()``: the record's card from nvidia-smi's one line, numbers as numbers and
    unsupported fields left out; {} without nvidia-smi, on a failed call or a line of
    another shape (it never stops a record from being written)."""
    import subprocess

    line = "GPU-1234abcd-0000, 700.00, 1980, [N/A]\n"
    want = {"uuid": "GPU-1234abcd-0000", "power.limit": 700.0, "clocks.max.sm": 1980.0}
    assert _common.card_fields(line) == want
    assert _common.card_fields("GPU-1, 700.00") == {}
    calls = []

    def smi(cmd, **kw):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=line)

    monkeypatch.setattr(_common.shutil, "which", lambda name: "/bin/" + name)
    monkeypatch.setattr(_common.subprocess, "run", smi)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert _common.card() == want
    assert calls[0][1] == "--id=3" and "uuid,power.limit" in calls[0][2]

    def fails(cmd, **kw):
        raise subprocess.CalledProcessError(9, cmd)

    monkeypatch.setattr(_common.subprocess, "run", fails)
    assert _common.card() == {}
    monkeypatch.setattr(_common.shutil, "which", lambda name: None)
    assert _common.card() == {}


def test_source_digest_names_the_tree_by_its_content(tmp_path):
    """A record's ``source_sha256``: the same files give the same digest wherever they lie; a
    changed byte, a renamed file or a new source file changes it; caches and non-source
    files do not."""
    from benchmarks import gpu_suite

    def tree(root, files):
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return gpu_suite.source_digest(str(root))

    base = {"coda/a.py": "x = 1\n", "tests/t.py": "y = 2\n", "README.md": "r"}
    same = tree(tmp_path / "one", base)
    assert same == tree(tmp_path / "two", base) and len(same) == 16
    extra = {"coda/__pycache__/a.cpython.pyc": "", "coda/notes.txt": "n", "README.md": "s"}
    assert tree(tmp_path / "three", {**base, **extra}) == same
    edited = {**base, "coda/a.py": "x = 2\n"}
    renamed = {"coda/b.py": "x = 1\n", "tests/t.py": "y = 2\n"}
    added = {**base, "demos/d.py": ""}
    for i, files in enumerate((edited, renamed, added)):
        assert tree(tmp_path / f"changed{i}", files) != same
    assert gpu_suite.source_digest() == gpu_suite.source_digest()  # this checkout's


def test_host_timing_keeps_every_round_and_takes_the_median(monkeypatch):
    """``bench_step._host_us``: each function timed once per round, ``HOST_ROUNDS`` rounds;
    a row's figure is its median round (one slow round moves it not at all), and the record
    keeps every round and their spread."""
    from benchmarks import bench_step

    rounds = bench_step.HOST_ROUNDS
    fast = iter([10.0] * (rounds - 1) + [40.0])  # one slow stretch, in the last round
    slow = iter([20.0 + i for i in range(rounds)])
    monkeypatch.setattr(bench_step, "_per_call_us", lambda fn, n: fn())
    got = bench_step._host_us({"fast": lambda: next(fast), "slow": lambda: next(slow)}, n=3)
    assert got["fast"]["us"] == pytest.approx(10.0)
    assert got["fast"]["rounds_us"] == pytest.approx([10.0] * (rounds - 1) + [40.0])
    assert got["fast"]["spread"] == pytest.approx(3.0)
    assert got["slow"]["us"] == pytest.approx(20.0 + (rounds - 1) / 2)
    assert len(got["slow"]["rounds_us"]) == rounds


def test_a_step_part_that_raises_is_recorded_under_its_name(monkeypatch):
    """``bench_step.run``: a part that raises becomes one error row named for the part
    (``step/model``: run 342's read ``step/<lambda>``), with its traceback, and the parts after
    it still run."""
    from benchmarks import bench_step

    def out_of_memory(*_):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(bench_step, "liger_functional", lambda: None)
    monkeypatch.setattr(bench_step, "model_rows", out_of_memory)
    monkeypatch.setattr(bench_step, "host_rows", out_of_memory)
    monkeypatch.setattr(bench_step, "graph_rows", lambda: [{"name": "graph/x", "ms": 1.0}])
    got = bench_step.run(("model", "host", "graph"))
    assert [r["name"] for r in got] == ["step/model", "step/host", "graph/x"]
    assert "out of memory" in got[0]["error"] and "out_of_memory" in got[0]["trace"]


def test_records_energy_reads_each_row_against_its_floor():
    """``records_energy``'s three ratios, on a made-up record: a row twice the floor's time at
    half its clock did the floor's cycles; the forward suite's ``coda`` is the module's row."""
    from benchmarks import records_energy as re_

    def row(name, ms, mhz, w, d=2048, **kw):
        return {"name": f"s/{name}", "d": d, "ms": ms, "sm_mhz": mhz, "power_w": w, **kw}

    floor = row("floor_as_one_step", 10.0, 1600, 700, ratio_vs_floor=1.03)
    record = {
        "benchmarks": {
            "layer_train": [floor, row("coda", 20.0, 800, 350), row("floor", 9.0, 1500, 690)],
            "layer_forward": [
                floor,
                row("coda", 11.0, 1600, 700),
                row("coda_decoder_layer", 12.0, 1600, 700),
            ],
            "lm_head_train": [
                floor,
                row("coda", 11.0, 1500, 700),
                row("coda", 99.0, 1500, 700, targets="zipf"),  # another target draw: left out
                row("coda", 13.0, 1500, 700, d=4096),  # no floor at d=4096: left out
            ],
        }
    }
    got = {(s, n): r for s, _, n, r in re_.table(record, ("coda",))}
    assert set(got) == {
        ("layer_train", "coda"),
        ("layer_forward", "coda_decoder_layer"),
        ("lm_head_train", "coda"),
    }
    train = got[("layer_train", "coda")]
    assert train["time"] == pytest.approx(2.0)
    assert train["cycles"] == pytest.approx(1.0)
    assert train["energy"] == pytest.approx(1.0)
    assert got[("layer_forward", "coda_decoder_layer")]["time"] == pytest.approx(1.2)
    head = got[("lm_head_train", "coda")]
    assert head["cycles"] == pytest.approx(11.0 * 1500 / (10.0 * 1600))
    assert head["mhz"] == (1500, 1600)
    assert head["parts"] == 1.03  # the floor as one step over its parts, as recorded


@pytest.mark.parametrize("post_norms", [False, True], ids=["llama", "post_norms"])
def test_the_layer_benchmarks_hf_form_is_codas_layer(monkeypatch, post_norms):
    """``bench_train``'s HF-style peer layer (torch eager and torch.compile's), on weights read
    from a coda layer by ``_hf_params``, computes that layer (float64, its reference path):
    pre-norm, and with a norm after each sublayer (``CODA_LAYER_POST_NORMS``'s rows), so the
    peers time the same function as coda's rows."""
    import coda.nn as cnn
    from benchmarks import bench_layer, bench_train
    from coda.reference.rope import hf_cos_sin

    B, S = 2, 5  # (the benchmark's module-level token shape, small here)
    for module in (bench_layer, bench_train):
        monkeypatch.setattr(module, "B", B)
        monkeypatch.setattr(module, "S", S)
        monkeypatch.setattr(module, "M", B * S)
    torch.manual_seed(0)
    d, H, Hkv, f = 256, 2, 1, 96  # (head_dim: the benchmark's 128)
    layer = cnn.DecoderLayer(d, H, Hkv, f, dtype=torch.float64, post_norms=post_norms)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(B, S, d, dtype=torch.float64)
    cos, sin = hf_cos_sin(torch.arange(S), 128, dtype=torch.float64)
    got = bench_train._hf_layer(x.view(B * S, d), bench_train._hf_params(layer), cos, sin, H, Hkv)
    want = layer(x, rope_cos_sin=(cos[None], sin[None])).view(B * S, d)  # (the same tables)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-12


def test_records_energy_lists_every_record_with_its_card(monkeypatch, capsys):
    """``records_energy``'s table: every record ``benchmarks.records`` yields (loose or
    archived), in run order from ``first_run``, each row naming its card (by its UUID's end
    where the record keeps one); a record of no floor-relative suite gives no row."""
    from benchmarks import records_energy as re_

    def row(name, ms):
        return {"name": f"s/{name}", "d": 2048, "ms": ms, "sm_mhz": 1500, "power_w": 700}

    timed = {"benchmarks": {"layer_train": [row("floor_as_one_step", 10.0), row("coda", 11.0)]}}
    kept = [
        ("2026-12-06_h100_run12.json", {**timed, "commit": "b"}),
        ("2026-12-01_h200x2_fsdp2_run3.json", {"result": {}}),
        (
            "2026-12-04_h200_run5.json",
            {**timed, "commit": "a", "card": {"uuid": "GPU-0123456789ab"}},
        ),
        ("2026-12-04_h200_run1.json", {**timed, "commit": "old"}),
    ]
    monkeypatch.setattr(re_.records, "every", lambda: iter(kept))
    re_.main(["2", "--rows", "coda"])
    out = capsys.readouterr().out.splitlines()
    rows = [ln.split(" | ") for ln in out[2:]]
    assert [r[:3] for r in rows] == [["| 5", "h200 456789ab", "a"], ["| 12", "h100", "b"]]
    assert rows[0][6:10] == ["1.100", "1500 / 1500", "1.100", "1.100"]
