"""Shared benchmark machinery: timing by the rules of ../shared/gpu/README.md and one row format.

Timing: ``triton.testing.do_bench`` (CUDA events), warm-up first, median with p20/p80, random
inputs (never zeros) larger than L2 at the benchmark shapes, every peer timed in the same
process right next to the others. Rows are plain dicts; ``gpu_suite.py`` writes them to JSON.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import statistics
import subprocess
import time
import warnings

import torch


class Diagnostic:
    """A ``gpu_suite.py`` entry run only when ``--only`` names it (a probe inside an HF step),
    never by a run of every suite. Subclasses give ``run() -> list[dict]``."""


@contextlib.contextmanager
def restored(table: dict, key):
    """Within ``with``: ``table[key]`` may be set at will (a probe installing a tuned entry in
    turn); on exit it is as before, absent if it was."""
    had, before = key in table, table.get(key)
    try:
        yield
    finally:
        if had:
            table[key] = before
        else:
            table.pop(key, None)


def out_of_time() -> bool:
    """True once the GPU suite's time budget is spent (``gpu_suite.py --budget-s`` sets
    ``CODA_SUITE_DEADLINE``, seconds since the epoch): long benchmarks check it between
    variants and record the rest as skipped, so a device call under a hard limit keeps what
    it measured."""
    deadline = os.environ.get("CODA_SUITE_DEADLINE")
    return deadline is not None and time.time() > float(deadline)


SKIPPED = {"skipped": "time budget spent"}

# What the running suite has finished so far, for a call cut short: ``gpu_suite.py``'s SIGTERM
# record keeps these rows (a suite returns its rows only when it ends). Suites that take
# minutes report rows here as they make them (``progress``); ``gpu_suite`` empties it per suite.
PROGRESS: list = []


def progress(row: dict) -> dict:
    """``row``, also kept in ``PROGRESS`` until its suite ends."""
    PROGRESS.append(row)
    return row


def selected(var: str, known) -> list[str]:
    """The names listed in the environment variable ``var`` (comma-separated; none listed:
    an empty list, meaning all), each checked against ``known``: a benchmark's choice of
    shapes or peers (``gpu_suite.SELECTIONS`` writes them into the record's command)."""
    chosen = [c for c in os.environ.get(var, "").split(",") if c]
    unknown = set(chosen) - set(known)
    if unknown:
        raise ValueError(f"{var}: unknown {sorted(unknown)}; known: {sorted(known)}")
    return chosen


def mixed_precision(var: str) -> bool:
    """``var`` set to 1: a model suite's peers hold fp32 parameters and run their forward
    under bf16 autocast (``bf16_autocast``), as a mixed-precision trainer (HF's Trainer with
    ``bf16=True``) runs a model; 0 or unset: bf16 parameters. Anything else raises."""
    value = os.environ.get(var, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{var}: must be 0 or 1, got {value!r}")
    return value == "1"


def bf16_autocast(device_type: str, enabled: bool = True):
    """The forward's autocast region of a mixed-precision step: bf16 on ``device_type``, the
    weight-cast cache off, as PyTorch advises for CUDA graph capture (each weight is read
    once a forward, so the cache would save nothing); the backward runs outside it. With
    ``enabled`` False, a region without autocast (a bf16 model's step)."""
    return torch.autocast(device_type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=False)


TOKEN_DISTRIBUTIONS = ("uniform", "zipf")


def token_ids(dist: str, vocab: int, n: int, gen=None) -> torch.Tensor:
    """``n`` token ids in [0, vocab) on the GPU: uniform (``torch.randint``), or Zipf-
    distributed (s = 1.1 over the vocabulary by rank, as text's token counts roughly are; the
    most frequent id then ~13-16 % of all), in a random order."""
    if dist == "uniform":
        return torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    rank = torch.arange(1, vocab + 1, device="cuda", dtype=torch.float64)
    p = rank.pow(-1.1)
    return torch.multinomial(p / p.sum(), n, replacement=True, generator=gen)


def own_bytes(module) -> int:
    """Bytes of ``module``'s parameters and buffers (each storage once)."""
    seen = {}
    for t in [*module.parameters(), *module.buffers()]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def settled_allocated() -> int:
    """Bytes allocated on the GPU once unreachable tensors are collected and queued work is
    done: the reading a memory figure subtracts, so that garbage of an earlier model freed
    inside the measured block cannot lower its figure (run 268, ``PeakAlone``)."""
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


class PeakAlone:
    """A step's peak memory as if its model were the only one on the GPU: the peak allocated
    inside the block, less what was resident on entry and is not the model's own weights
    (other peers' models, kept for interleaved timing). Its gradients, optimizer state and
    activations count; ``gib`` holds the figure after the block.

    The figure holds only if what was resident on entry stays resident: unreachable tensors
    of an earlier model, freed by a garbage collection inside the block, would lower the
    peak below entry + step and read as the step's saving (run 268: torch.compile's Qwen3
    step at 20.67 GiB after the Llama shape's variants, 54.22 alone in run 269). So entry
    collects first, and a block that ends with more than ``SLACK`` less allocated than it
    began raises (a bounded cache turning over a small table stays under it)."""

    SLACK = 16 * 2**20

    def __init__(self, module):
        self.own = own_bytes(module)

    def __enter__(self):
        self.before = settled_allocated()
        torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, exc_type, *exc):
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.gib = (peak - self.before + self.own) / 2**30
        freed = self.before - torch.cuda.memory_allocated()
        if exc_type is None and freed > self.SLACK:
            raise RuntimeError(
                f"PeakAlone: {freed / 2**30:.2f} GiB resident on entry was freed inside the "
                "block, so its peak understates the step's"
            )


def bench(fn, warmup_ms: int = 50, rep_ms: int = 300, min_reps: int = 15) -> dict:
    """Median and p20/p80 milliseconds of ``fn()`` over ``rep_ms`` of calls, and at least
    ``min_reps`` calls: a 80 ms call would otherwise get 3 samples, whose median moved by
    7 % between two runs of one commit (runs 24-25)."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    rep = max(rep_ms, min_reps * start.elapsed_time(end))
    med, p20, p80 = triton.testing.do_bench(
        fn, warmup=warmup_ms, rep=rep, quantiles=[0.5, 0.2, 0.8]
    )
    return {"ms": med, "p20_ms": p20, "p80_ms": p80, "reps_ms": rep}


def bench_long(fn) -> dict:
    """``bench`` for a whole training step (hundreds of ms): a longer warm-up and window."""
    return bench(fn, warmup_ms=100, rep_ms=1500)


def smi_id() -> str:
    """The GPU torch calls device 0, as ``nvidia-smi --id`` names it: the first of
    ``CUDA_VISIBLE_DEVICES`` (an index or a UUID), else 0."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"


class GpuClock:
    """The GPU's SM clock (MHz) and power draw (W) sampled by ``nvidia-smi`` every 20 ms while
    the block runs (read only: the card's settings are never touched); ``medians()`` after
    it, {} where nvidia-smi is missing or gave nothing. Why: a step timed under sustained
    load may run at a lower clock than its parts timed alone (power), which a ratio to the
    floor would otherwise read as kernel time."""

    def __enter__(self):
        self.proc, self.lines = None, []
        if shutil.which("nvidia-smi") and torch.cuda.is_available():
            query = ["--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={smi_id()}", *query, "-lms", "20"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            self.lines = self.proc.communicate()[0].splitlines()

    def medians(self) -> dict:
        samples = []
        for line in self.lines:
            try:
                clock, power = (float(v) for v in line.split(","))
            except ValueError:  # "[N/A]" or a cut line
                continue
            samples.append((clock, power))
        if not samples:
            return {}
        return {
            "sm_mhz": statistics.median(s[0] for s in samples),
            "power_w": statistics.median(s[1] for s in samples),
            "clock_samples": len(samples),
        }


CARD_FIELDS = ("uuid", "power.limit", "clocks.max.sm", "temperature.gpu")


def card() -> dict:
    """Which GPU ran a record and its power limit, maximum SM clock and temperature at the
    start, read once from ``nvidia-smi`` (read only); {} where it is missing or gave nothing.
    Why: two records of one commit on one GPU model may differ by a card's power and
    thermals, and without its identity a record cannot say whether two runs shared a card."""
    if not shutil.which("nvidia-smi"):
        return {}
    query = f"--query-gpu={','.join(CARD_FIELDS)}"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={smi_id()}", query, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    return card_fields(out)


def card_fields(line: str) -> dict:
    """``nvidia-smi``'s one CSV line for ``CARD_FIELDS`` -> {field: value}; numbers as
    floats, "[N/A]" entries left out."""
    values = [v.strip() for v in line.strip().split(",")]
    if len(values) != len(CARD_FIELDS):
        return {}
    fields = {}
    for name, value in zip(CARD_FIELDS, values):
        if value.startswith("["):  # "[N/A]", "[Not Supported]"
            continue
        try:
            fields[name] = float(value)
        except ValueError:
            fields[name] = value
    return fields


def clocked(timer):
    """``timer`` with the GPU clock and power sampled while it runs (``GpuClock``): their
    medians join its timing."""

    def run(fn):
        with GpuClock() as clock:
            t = timer(fn)
        return {**t, **clock.medians()}

    return run


# interleaved rounds of ``interleaved``; ``CODA_BENCH_ROUNDS`` asks for more (a closer A/B)
ROUNDS = int(os.environ.get("CODA_BENCH_ROUNDS", "3"))


def round_orders(n: int, rounds: int) -> list[list[int]]:
    """The order of ``n`` entries in each of ``rounds`` rounds: round r starts at entry
    r mod n and walks the list in steps of s_r, the r-th step coprime to n (1, then the next
    ones: for n = 5, steps 1, 2, 3, 4), so every entry has another predecessor in each round
    while steps last. A rotation alone (step 1 every round) kept each entry's neighbour: the
    LM head's ``coda`` always ran right after ``floor_as_one_step`` and read slower than
    ``coda_e2g``, the same code at d = 2048, timed right after it, in runs 239, 250, 272, 322
    and 336 (by 0.5 to 2.8 %; faster in the first interleaved run, session 10)."""
    steps = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    return [[(r + i * steps[r % len(steps)]) % n for i in range(n)] for r in range(rounds)]


def interleaved(fns: dict, rounds: int = ROUNDS, timer=None) -> dict:
    """Every function of ``fns`` timed ``rounds`` times, each round in ``round_orders``'
    order (each round starts one name later and steps through the names by another stride, so
    no function always follows the same neighbour or runs first): a clock or power state of
    the GPU that drifts during a run, or a heavy predecessor's, then touches every variant
    alike instead of whichever was timed at the time.

    Returns, per name, the median of its round medians (``ms``), those medians
    (``rounds_ms``), their spread ((max - min) / median) and the p20/p80 of the round nearest
    the median, with the GPU clock and power of that round (``clocked``). ``timer``:
    ``clocked(bench)`` unless given (the CPU tests pass a fake)."""
    timer = timer or clocked(bench)
    names = list(fns)
    got: dict = {n: [] for n in names}
    for order in round_orders(len(names), rounds):
        for i in order:
            got[names[i]].append(timer(fns[names[i]]))
    out = {}
    for n, ts in got.items():
        ms = [t["ms"] for t in ts]
        med = statistics.median(ms)
        mid = min(ts, key=lambda t: abs(t["ms"] - med))
        out[n] = {
            **mid,
            "ms": med,
            "rounds_ms": ms,
            "spread": (max(ms) - min(ms)) / med,
        }
    return out


def probe_rows(fns: dict, timed: dict, top: int = 4) -> dict:
    """A probe's A/B, per variant: the median of ``interleaved``'s rounds, the rounds, the
    clock of the median round, and the variant's kernels (profiled, the ``top`` longest)."""
    return {
        name: {
            "ms": t["ms"],
            "rounds_ms": t["rounds_ms"],
            "sm_mhz": t.get("sm_mhz"),
            "kernels": kernel_table(fns[name], steps=5, top=top),
        }
        for name, t in timed.items()
    }


def in_order(fns: dict):
    """One function that calls every function of ``fns`` in turn: a floor's parts timed as
    one step."""

    def run():
        for fn in fns.values():
            fn()

    return run


def against_floor(
    prefix: str, shape: dict, parts: dict, variants: dict, rows: list, timer=None
) -> dict:
    """A floor's parts (the plain GEMMs and attention) and every variant timed round-robin
    (``interleaved``): a GPU clock that drifts during the run touches the floor and each
    variant alike. A variant that raises on its first call gets an error row. Appends the
    parts' rows and the floor's (their sum) to ``rows``; returns each variant that ran, as its
    timing with ``ratio_vs_floor``. ``timer``: as ``interleaved``'s.

    The parts are also timed run back to back as one step (``floor_as_one_step``, its row
    appended too, and each variant's ``ratio_vs_floor_as_one_step``): at the H200's power
    cap each part timed alone runs at its own clock (attention and the small GEMMs near
    boost, the large GEMMs lower; run 47), a whole step at one sustained clock, so the
    sequence is the floor at a layer step's own duty cycle."""
    runnable = {}
    for name, fn in variants.items():
        try:
            fn()
            runnable[name] = fn
        except Exception as e:
            rows.append({"name": f"{prefix}/{name}", **shape, "error": repr(e)[:300]})

    fns = {**{"floor/" + k: fn for k, fn in parts.items()}, "floor/as_one_step": in_order(parts)}
    timed = interleaved({**fns, **runnable}, timer=timer)
    floor = sum(timed["floor/" + k]["ms"] for k in parts)
    for name in parts:
        rows.append(row(f"{prefix}/floor_part/{name}", shape, timed["floor/" + name], 0.0))
    rows.append({"name": f"{prefix}/floor", **shape, "ms": floor})
    one = timed["floor/as_one_step"]
    rows.append(
        row(f"{prefix}/floor_as_one_step", shape, one, 0.0, ratio_vs_floor=one["ms"] / floor)
    )
    return {
        n: {
            **timed[n],
            "ratio_vs_floor": timed[n]["ms"] / floor,
            "ratio_vs_floor_as_one_step": timed[n]["ms"] / one["ms"],
        }
        for n in runnable
    }


def host_ms(fn, reps: int = 7) -> float:
    """Host milliseconds of one call of ``fn`` started on an idle GPU (median of ``reps``): the
    time until it returns, kernels queued but not awaited. A call that synchronizes inside
    shows its GPU time here; one that does not, the Python, dispatch and launch cost alone."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def graphed(fn, warmup: int = 3):
    """``fn`` (a whole forward+backward) captured once as a CUDA graph; returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def row(name: str, shape: dict, timing: dict, flops: float, **extra) -> dict:
    return {
        "name": name,
        **shape,
        **timing,
        "tflops": flops / (timing["ms"] * 1e-3) / 1e12 if flops else None,
        **extra,
    }


def liger_functional():
    """Liger's functional ops (a peer), or None where liger-kernel is not installed."""
    try:
        import liger_kernel.transformers.functional as liger
    except Exception:
        liger = None
    return liger


def kernel_table(fn, steps: int = 3, top: int = 40) -> list[dict]:
    """CUDA kernels of one call of ``fn`` (profiled over ``steps`` calls after a warm-up):
    each kernel's name, launches per call and microseconds per call, largest first."""
    table: dict = {}
    for e in _profiled_kernels(fn, steps):
        t = table.setdefault(e.name, [0, 0.0])
        t[0] += 1
        t[1] += e.device_time
    rows = [
        {"kernel": name[:160], "calls": n / steps, "us": us / steps}
        for name, (n, us) in table.items()
    ]
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def beside_floor(parts: dict, fn, steps: int = 3) -> dict:
    """``fn``'s kernel table beside the floor's kernel time, profiled in one short pass: each
    floor part alone, the parts run back to back as one step (``in_order``), ``fn``, then the
    one step and the parts again (each figure the mean of its two readings, whose spread says
    how far the clock moved between them).

    Two floors, because a part profiled alone for a few milliseconds runs nearer boost than
    a step at the power cap does (run 48: up to 13 % under its sustained time; runs 238 and
    251 at d=4096: the parts alone 26.3-26.9 ms against a 31 ms step). ``floor_parts_us``
    says where the floor's time goes; ``floor_step_us``, the same kernels run back to back
    at a step's duty cycle, as ``fn``'s are, is the like-for-like total, and
    ``kernel_ratio_vs_floor_step`` the ratio to read for how ``fn``'s kernel time compares."""

    def part_us():
        return {n: sum(k["us"] for k in kernel_table(p, steps, 100_000)) for n, p in parts.items()}

    def step_us():
        return sum(k["us"] for k in kernel_table(in_order(parts), steps, 100_000))

    before, step_before = part_us(), step_us()
    kernels = kernel_table(fn, steps, 100_000)
    step_after, after = step_us(), part_us()
    parts_us = {n: (before[n] + after[n]) / 2 for n in parts}
    floor_us = sum(parts_us.values())
    floor_step_us = (step_before + step_after) / 2
    kernel_us = sum(k["us"] for k in kernels)
    return {
        "floor_parts_us": parts_us,
        "floor_us": floor_us,
        "floor_us_before_after": [sum(before.values()), sum(after.values())],
        "floor_step_us": floor_step_us,
        "floor_step_us_before_after": [step_before, step_after],
        "kernel_us": kernel_us,
        "kernel_ratio_vs_floor": kernel_us / floor_us,
        "kernel_ratio_vs_floor_step": kernel_us / floor_step_us,
        "kernels": kernels[:40],
    }


KERNEL_GROUPS = (  # (group, substrings of a CUDA kernel's name, lower case), first match wins
    ("attention", ("flash", "fmha", "sdpa", "attn", "attention")),
    ("gemm", ("quack", "gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("optimizer", ("multi_tensor", "adam")),
)


def kernel_group(name: str) -> str:
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"  # the memory-bound rest: row kernels, copies, casts, fills


def where_time_goes(fn, top: int = 25) -> dict:
    """One call's CUDA kernels: milliseconds per group (GEMMs, attention, optimizer, the rest),
    the ``top`` kernels, and the GPU's idle time inside the call (``idle_report``)."""
    kernels = kernel_table(fn, steps=2, top=100_000)
    groups: dict = {}
    for k in kernels:
        g = groups.setdefault(kernel_group(k["kernel"]), {"ms": 0.0, "launches": 0.0})
        g["ms"] += k["us"] * 1e-3
        g["launches"] += k["calls"]
    idle = idle_report(fn)
    return {
        "kernel_ms": sum(k["us"] * 1e-3 for k in kernels),
        "idle_ms": idle["idle_us"] * 1e-3,
        "host_syncs": idle["host_syncs"],
        "groups": groups,
        "kernels": kernels[:top],
    }


def _profiled_kernels(fn, calls: int):
    """The CUDA events of ``calls`` back-to-back calls of ``fn`` (after a warm-up), in start
    order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0),
        key=lambda e: e.time_range.start,
    )


def _gaps(ev) -> list:
    """(us, kernel before, kernel after) for every stretch in which no kernel of the
    start-ordered events ``ev`` runs, largest first."""
    gaps, busy_end = [], None
    for a, b in zip(ev, ev[1:]):
        busy_end = max(busy_end or a.time_range.end, a.time_range.end)
        gap = b.time_range.start - busy_end
        if gap > 0:
            gaps.append((gap, a.name[:60], b.name[:60]))
    return sorted(gaps, reverse=True)


def idle_report(fn, top: int = 5) -> dict:
    """Where the GPU waits inside one call of ``fn``: every host synchronization it makes
    (``torch.cuda.set_sync_debug_mode``, with the Python line that made it), and the idle time
    between its kernels (profiler timeline, after a warm-up: the sum of the gaps in which no
    kernel runs, between the first kernel's start and the last one's end), with the largest
    gaps named by the kernel before and after them."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [
        f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno} {str(w.message)[:80]}"
        for w in caught
        if "called a synchronizing CUDA operation" in str(w.message)
    ]
    ev = _profiled_kernels(fn, 1)
    gaps = _gaps(ev)
    span = (ev[-1].time_range.end - ev[0].time_range.start) if ev else 0.0
    return {
        "host_syncs": len(syncs),
        "sync_sites": sorted(set(syncs))[:10],
        "span_us": span,
        "idle_us": sum(g for g, *_ in gaps),
        "largest_gaps": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:top]],
    }


def steady_idle(fn, calls: int = 6, top: int = 5) -> dict:
    """The GPU's idle time per call when ``fn`` runs back to back, as a benchmark loop and a
    training loop run it (no synchronization between calls, so a host that keeps ahead hides
    its own time): ``calls`` calls profiled after a warm-up, the first one left out (it starts
    on an idle GPU, ``idle_report``'s case). Also the GPU span and kernel time per call, and
    the largest gaps named by the kernels around them."""
    fn()  # a second warm-up call: ``_profiled_kernels`` makes the first
    ev = _profiled_kernels(fn, calls)
    ev = ev[len(ev) // calls :]  # calls 2 .. n
    gaps = _gaps(ev)
    n = calls - 1
    return {
        "steady_calls": n,
        "steady_span_ms": (ev[-1].time_range.end - ev[0].time_range.start) / n * 1e-3 if ev else 0,
        "steady_kernel_ms": sum(e.device_time for e in ev) / n * 1e-3,
        "steady_idle_ms": sum(g for g, *_ in gaps) / n * 1e-3,
        "steady_largest_gaps": [{"us": g, "after": a, "before": b} for g, a, b in gaps[:top]],
    }
