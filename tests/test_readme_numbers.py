"""The README's measured table says what its records say: each row below is read from the
README, each of its figures from the record the README names for it, and they must agree to
the digits printed. A session that re-times a row updates the record it names here with it;
a figure typed by hand that no record holds fails."""

from __future__ import annotations

import pathlib
import re

import pytest

from benchmarks import records

ROOT = pathlib.Path(__file__).resolve().parent.parent
COLUMNS = ("coda", "torch.compile", "Liger", "quack", "eager")


def _entry(record: str, suite: str, name: str, d: int | None = None) -> dict:
    rows = records.load(record)["benchmarks"][suite]
    rows = rows["rows_so_far"] if isinstance(rows, dict) else rows  # (a suite cut at its limit)
    hits = [r for r in rows if r["name"] == name and (d is None or r.get("d") == d)]
    assert len(hits) == 1, (record, name, d, len(hits))
    return hits[0]


def _ratio(v):
    return f"{v:.3f}"


def _k(v):
    return f"{v / 1000:.1f}k"


def _suite_row(record, suite, d, names, key="ratio_vs_floor", fmt=_ratio):
    """{column: printed figure} of one suite's rows at one d."""
    return {col: fmt(_entry(record, suite, n, d)[key]) for col, n in names.items()}


R252, R254, R255, R256, R257, R258, R259, R260, R261 = (
    f"2026-12-04_h200_run{n}.json" for n in (252, 254, 255, 256, 257, 258, 259, 260, 261)
)
R266, R267, R271, R273 = (
    f"2026-12-04_h200_run{n}.json" for n in (266, 267, 271, 273)
)  # mixed precision
R293 = "2026-12-05_h200_run293.json"  # the soft-capped LM head (CE-S as "coda_scaled_exp")
R296 = "2026-12-05_h200_run296.json"  # Gemma-3-1B's loss alone, beside Liger's patch
R297 = "2026-12-05_h100_run297.json"  # on an H100: Gemma-3-1B's loss alone, the stack compiled
# session 89: the layer at d=2048 (355) and d=4096 (354), the LM head at d=4096 (353) and 2048 (354)
R353, R354, R355 = (f"2026-12-06_h200_run{n}.json" for n in (353, 354, 355))
R340 = "2026-12-06_h100_run340.json"  # on an H100: Llama-3.2-1B and Qwen3-0.6B patched
R306 = "2026-12-05_h100_run306.json"  # on an H100: Gemma-3-1B with coda's layers
R29 = "2026-12-01_h200x2_fsdp2_run29.json"  # FSDP2 on two H200s: fsdp_step.py's own record
LAYER = {"coda": "coda", "torch.compile": "torch_compile", "Liger": "liger", "eager": "torch_eager"}
FWD = {**LAYER, "coda": "coda_decoder_layer"}
HEAD = {
    "coda": "coda", "torch.compile": "torch_compile", "Liger": "liger", "quack": "quack_chunked_lce"
}  # fmt: skip
B1 = "model/llama-1B/{}/step+adamw"


def _extra_gib(row) -> float:
    """An LM-head row's extra memory as issue 9 defines it (``bench_train.extra_gib``): the
    record's own figure since session 83; before, the recorded ``extra_peak_gib`` read the
    gradients' size (x, the weight and the norm's gain, all bf16) twice too low."""
    if "extra_gib" in row:
        return row["extra_gib"]
    grads = 2 * (row["V"] * row["d"] + row["M"] * row["d"] + row["d"])
    return row["extra_peak_gib"] + 2 * grads / 2**30


def _named(prefix, names):
    return {c: f"{prefix}/{n}" for c, n in names.items()}


def expected() -> dict:
    """README row (its first cell's start) -> {column: figure as printed, first number}."""
    model = {c: B1.format(n) for c, n in HEAD.items() if c != "quack"}

    def layer(suite, prefix, names, d, record):
        return _suite_row(record, suite, d, _named(prefix, names))

    def head(d, record, key="ratio_vs_floor", fmt=_ratio):
        return _suite_row(record, "lm_head_train", d, _named("lm_head_train", HEAD), key, fmt)

    def capped(d, key="ratio_vs_floor", fmt=_ratio):  # CE-S's capped program, "auto"'s now
        names = {**LAYER, "coda": "coda_scaled_exp"}
        return _suite_row(R293, "lm_head_train", d, _named("lm_head_train", names), key, fmt)

    def extra(d, record, names=HEAD):
        rows = {
            c: _entry(record, "lm_head_train", f"lm_head_train/{n}", d) for c, n in names.items()
        }
        return {c: f"{_extra_gib(r):.2f}" for c, r in rows.items()}

    def step(key, fmt, names=model, record=R252):
        return _suite_row(record, "model", None, names, key, fmt)

    def hf(shape, record):  # Liger's faster row: with or without the cache
        def tps(n):
            return _entry(record, "hf", f"hf/{shape}/{n}")["tokens_per_s"]

        liger = max(tps(n) for n in ("hf_liger", "hf_liger_no_cache"))
        cols = {"coda": "hf_coda", "torch.compile": "hf_torch_compile", "eager": "hf"}
        return {**{c: _k(tps(n)) for c, n in cols.items()}, "Liger": _k(liger)}

    def h100(shape):  # run 340: no unpatched row; Liger's faster row
        def tps(n):
            return _entry(R340, "hf", f"hf/{shape}/{n}")["tokens_per_s"]

        liger = max(tps(n) for n in ("hf_liger", "hf_liger_no_cache"))
        return {
            "coda": _k(tps("hf_coda")),
            "torch.compile": _k(tps("hf_torch_compile")),
            "Liger": _k(liger),
        }

    def demo(record, names, kind="step+adamw", key="tokens_per_s", fmt=lambda v: f"{v / 1e3:.0f}k"):
        names = {c: f"model/demo-d1024/{n}/{kind}" for c, n in names.items()}
        return _suite_row(record, "model", None, names, key, fmt)

    tc = {"torch.compile": "torch_compile"}
    tcb = {"torch.compile": B1.format("torch_compile")}
    fsdp = records.load(R29)["result"]
    fsdp_cols = {"coda": "coda", "torch.compile": "torch_compile", "eager": "torch_eager"}
    return {
        "layer fwd+bwd, d=2048": layer("layer_train", "layer_train", LAYER, 2048, R355),
        "layer fwd+bwd, d=4096": layer("layer_train", "layer_train", LAYER, 4096, R354),
        "layer forward (`DecoderLayer`": layer("layer_forward", "layer_fwd", FWD, 2048, R355),
        "layer forward, d=4096": layer("layer_forward", "layer_fwd", FWD, 4096, R354),
        "LM head + CE fwd+bwd (`LMHeadLoss`), d=2048": head(2048, R354),
        "... the same with Zipf-distributed targets": head(2048, R257),
        "LM head + CE fwd+bwd, d=4096": head(4096, R353),
        "LM head + CE fwd+bwd, d=8192": head(8192, R256),
        "... LM head extra GiB at d=4096": extra(4096, R353),
        "Gemma 2's soft-capped LM head + CE fwd+bwd": capped(2048),
        "... d=4096, V=128256 (run 293)": capped(4096),
        "... extra GiB at d=4096": extra(4096, R293, {**LAYER, "coda": "coda_scaled_exp"}),
        "1B-shaped model step + AdamW": step("tokens_per_s", _k),
        "... joules per step": step("joules_per_step", lambda v: f"{v:.1f}"),
        "... as one CUDA graph": step("tokens_per_s", _k, {"coda": B1.format("coda_graphed")}),
        "... peak GiB, each alone": step("peak_gib", lambda v: f"{v:.1f}"),
        "... coda under `torch.compile`": step(
            "tokens_per_s", _k, {"coda": B1.format("coda_compile"), **tcb}, R258
        ),
        "... coda with per-layer checkpointing": step(
            "tokens_per_s", _k, {"coda": B1.format("coda_checkpointed"), **tcb}, R259
        ),
        "... mixed precision: every peer": step(
            "tokens_per_s",
            _k,
            {c: n.replace("llama-1B", "llama-1B+amp") for c, n in model.items()},
            R266,
        ),
        "d=1024 model step + AdamW": demo(
            R255, {"coda": "coda", **tc, "Liger": "liger"}, "kernels", "kernel_ms", "{:.2f}".format
        ),
        "... tokens/s, coda through `GraphedStep`": demo(R255, {"coda": "coda_graphed", **tc}),
        "... tokens/s as CUDA graphs": demo(
            R255, {"coda": "coda_graphed", "torch.compile": "torch_compile_graphed"}
        ),
        "... coda and the plain model both under": demo(
            R260, {"coda": "coda_compile_graphed", "torch.compile": "torch_compile_graphed"}
        ),
        "... mixed precision (fp32 parameters": _suite_row(
            R267,
            "model",
            None,
            {
                "coda": "model/demo-d1024+amp/coda_graphed/step+adamw",
                "torch.compile": "model/demo-d1024+amp/torch_compile/step+adamw",
            },
            "tokens_per_s",
            lambda v: f"{v / 1e3:.0f}k",
        ),  # fmt: skip
        "... eager steps": demo(
            R255, {"coda": "coda", **tc, "Liger": "liger", "eager": "torch_eager"}
        ),
        "HF Llama-3.2-1B": hf("llama-3.2-1B", R254),
        "HF Qwen3-0.6B": hf("qwen3-0.6B", R261),
        "... HF Llama-3.2-1B, fp32 weights": hf("llama-3.2-1B+amp", R271),
        "... HF Qwen3-0.6B, fp32 weights": hf("qwen3-0.6B+amp", R273),
        "... HF Gemma-3-1B, the loss alone": {
            c: _k(_entry(R296, "hf", f"hf/gemma-3-1B/{n}")["tokens_per_s"])
            for c, n in {"coda": "hf_coda", "Liger": "hf_liger", "eager": "hf"}.items()
        },
        "... HF Gemma-3-1B on an H100, the loss alone": {
            c: _k(_entry(R297, "hf", f"hf/gemma-3-1B/{n}")["tokens_per_s"])
            for c, n in {"coda": "hf_coda_compiled", "Liger": "hf_liger"}.items()
        },
        "... HF Gemma-3-1B on an H100 with coda's layers": {
            c: _k(_entry(R306, "hf", f"hf/gemma-3-1B/{n}")["tokens_per_s"])
            for c, n in {"coda": "hf_coda", "Liger": "hf_liger"}.items()
        },
        "... HF Llama-3.2-1B on an H100": h100("llama-3.2-1B"),
        "... HF Qwen3-0.6B on an H100": h100("qwen3-0.6B"),
        "FSDP2, 2 H200s": {c: _k(fsdp[n]["tokens_per_s_per_rank"]) for c, n in fsdp_cols.items()},
    }


def _readme_rows() -> dict:
    """Each table row of README's "Measured" section: first cell -> {column: first number}."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Measured") :]
    end = section.find("\n## ", 3)  # the next section, if one follows
    section = section if end < 0 else section[:end]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 1 + len(COLUMNS) and not set(cells[1]) <= set("-"):
            numbers = [re.search(r"-?[\d,]+(?:\.\d+)?k?", c) for c in cells[1:]]
            rows[cells[0]] = {
                col: m.group().replace(",", "") for col, m in zip(COLUMNS, numbers) if m
            }
    return rows


@pytest.mark.parametrize("row", list(expected()))
def test_readme_figure_is_its_records(row):
    readme = _readme_rows()
    match = [cells for first, cells in readme.items() if first.startswith(row)]
    assert len(match) == 1, f"README has {len(match)} rows starting {row!r}"
    want = expected()[row]
    got = {col: match[0].get(col) for col in want}
    assert got == want


def test_the_reader_sees_the_table():
    """The parser finds the table's rows and puts each figure in its column (a reader that
    found nothing, or shifted a column, would let rows pass or fail for nothing)."""
    rows = _readme_rows()
    assert len(rows) >= 15
    layer = next(c for first, c in rows.items() if first.startswith("layer fwd+bwd, d=2048"))
    assert sorted(layer) == sorted(["coda", "torch.compile", "Liger", "eager"])
    head = next(c for first, c in rows.items() if first.startswith("LM head + CE fwd+bwd, d=4096"))
    assert sorted(head) == sorted(["coda", "torch.compile", "Liger", "quack"])
