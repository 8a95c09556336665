"""The benchmark probes' own logic (``benchmarks/probe_*.py``, ``tune_configs``), on the CPU:
each computes what it claims to, names real kernels and passes, and puts back whatever it
patches. The probes' timings need the GPU; these rules do not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import _common


def test_the_deferred_dw_probe_computes_what_the_reduce_add_and_cast_compute():
    """``tune_configs``' probe for the LM head's last dW chunk (its program through the tile
    interpreter, float64) equals today's reduce-adding dW GEMM followed by the cast with g, so
    its H200 timing compares two ways of computing one thing."""
    from benchmarks import tune_configs as tc
    from coda.kernels import ce_scaled_exp as cse
    from coda.kernels.config import GemmConfig

    g = torch.Generator().manual_seed(0)
    rows, d, V = 256, 96, 384  # the strips' 64-row blocks over V, whole 128-row tiles of rows
    f64 = torch.float64
    e = torch.rand(rows, V, dtype=f64, generator=g)
    xs = torch.randn(rows, d, dtype=f64, generator=g)
    u = torch.exp2(-torch.randint(0, 4, (V // cse.STRIP, rows), generator=g).to(f64))
    dw_t = torch.randn(V, d, dtype=f64, generator=g)
    like = torch.empty(V, d, dtype=f64).t()
    expected = (dw_t + (u.repeat_interleave(cse.STRIP, 0) * e.t()) @ xs) * 0.37
    probe, current = tc.dw_final_pair(
        cse, e, xs, u, dw_t, torch.tensor(0.37, dtype=f64), like, GemmConfig(128, 64, 2, 1, False)
    )
    assert torch.allclose(probe, expected, rtol=1e-12, atol=1e-12)
    assert torch.allclose(current, expected, rtol=1e-12, atol=1e-12)


def test_the_logits_sweep_compares_one_lse_across_tiles():
    """``tune_configs.ce_logits_lse``: CE-S's GEMM1 through the tile interpreter (float64)
    gives the same lse at 128-, 192- and 256-wide tiles, torch's logsumexp of the scaled
    logits: the sweep's tiles compute one thing, and its ``lse_diff`` column measures only
    rounding on the GPU."""
    from benchmarks import tune_configs as tc
    from coda.kernels import ce_scaled_exp as cse
    from coda.kernels.config import GemmConfig

    g = torch.Generator().manual_seed(1)
    rows, d, V = 256, 40, 768
    a = torch.randn(rows, d, dtype=torch.float64, generator=g)
    w = torch.randn(d, V, dtype=torch.float64, generator=g)
    r = torch.rand(rows, dtype=torch.float64, generator=g) + 0.5
    t = torch.randint(0, V, (rows,), generator=g)
    expected = torch.logsumexp((a @ w) * r[:, None], dim=1)
    for tile_n, pingpong in ((128, True), (192, True), (256, False)):
        lse = tc.ce_logits_lse(cse, a, w, r, t, GemmConfig(128, tile_n, 2, 1, pingpong))
        assert torch.allclose(lse, expected, rtol=1e-12, atol=1e-12), tile_n


def test_the_dx_stat_probe_times_two_forms_of_one_thing():
    """``probe_dx_stat``'s two forms (dX without the epilogue's statistic then a pass over G,
    and dX with it) give the same G and S (float64, the tile interpreter), and S is the
    statistic's definition, so the H200 A/B compares two ways of computing one thing."""
    from benchmarks import probe_dx_stat as probe
    from coda.kernels import ce_scaled_exp as cse

    g = torch.Generator().manual_seed(1)
    C, d, V = 256, 200, 384  # d = 200: a ragged last column tile of the dX GEMM
    f64 = torch.float64
    o = {
        "e": torch.rand(C, V, dtype=f64, generator=g),
        "w": torch.randn(d, V, dtype=f64, generator=g),
        "u": torch.exp2(-torch.randint(0, 4, (V // cse.STRIP, C), generator=g).to(f64)),
        "c": torch.rand(C, dtype=f64, generator=g),
        "a": torch.randn(C, d, dtype=f64, generator=g),
        "rstd": torch.rand(C, dtype=f64, generator=g) + 0.5,
        "coef": torch.randn(C, dtype=f64, generator=g),
        "y_logit": torch.randn(C, dtype=f64, generator=g),
    }
    G0, G1 = torch.empty(C, d, dtype=f64), torch.empty(C, d, dtype=f64)
    S0, S1 = probe.before(o, G0), probe.after(o, G1)
    G = o["c"][:, None] * ((o["u"].repeat_interleave(cse.STRIP, 0).t() * o["e"]) @ o["w"].t())
    S = ((G * o["a"]).sum(-1) + o["coef"] * o["y_logit"] / o["rstd"]) / o["rstd"]
    assert torch.allclose(G0, G, rtol=1e-12, atol=1e-12) and torch.equal(G0, G1)
    assert torch.allclose(S0, S, rtol=1e-11, atol=1e-11)
    assert torch.allclose(S1, S, rtol=1e-11, atol=1e-11)


def test_the_residual_add_probe_times_three_forms_of_one_output():
    """``probe_residual_add``'s variants (coda's residual GEMM with and without the statistic,
    and cuBLAS's addmm) give one output, x1 + s @ W_d (float64: the tile interpreter)."""
    from benchmarks import probe_residual_add as probe
    from coda.kernels.config import GemmConfig

    g = torch.Generator().manual_seed(2)
    f64 = torch.float64
    o = {
        "s": torch.randn(200, 72, dtype=f64, generator=g),
        "w": torch.randn(72, 136, dtype=f64, generator=g),  # N = 136: a ragged N-tile
        "x1": torch.randn(200, 136, dtype=f64, generator=g),
    }
    outs = {n: fn() for n, fn in probe.variants(o, GemmConfig(64, 64, 1, 1, False)).items()}
    expected = o["x1"] + o["s"] @ o["w"]
    assert set(outs) == {"sumsq", "add", "cublas"} and torch.equal(outs["sumsq"], outs["add"])
    for out in outs.values():
        assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_the_row_pass_probe_records_the_first_call_and_puts_everything_back():
    """``probe_row_passes._Recorded``: the pass's first call's arguments and attention's input
    strides are kept, later calls pass through, and both names are restored on leaving."""
    import torch.nn.functional as F

    from benchmarks import probe_row_passes as prp

    name = prp.PASSES["drope_pass"][1]
    sdpa = F.scaled_dot_product_attention
    calls = []
    fake = SimpleNamespace(**{name: lambda *a, **kw: calls.append((a, kw)) or len(calls)})
    q = torch.randn(1, 6, 2, 4).transpose(1, 2)  # (B, heads, S, hd) views of a packed buffer
    with prp._Recorded(fake, name) as rec:
        assert getattr(fake, name)(1, 2, shape=None) == 1 and getattr(fake, name)(3) == 2
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q.contiguous(), q, q)
    assert rec.args == ((1, 2), {"shape": None}) and len(calls) == 2
    assert rec.attention["q_in_stride"] == list(q.stride()) and rec.attention["sdpa_kwargs"] == [
        "is_causal"
    ]
    assert F.scaled_dot_product_attention is sdpa and getattr(fake, name) is rec.inner


def test_the_row_pass_probe_names_real_passes():
    """Each probed pass names a function of ``row_passes`` taking ``head_dim`` (how the probe
    finds its ``TUNED`` key), a tuned kernel name and a step the benchmarks build: an HF shape,
    or a layer width the layer benchmark runs."""
    import inspect

    from benchmarks import bench_hf, bench_layer, probe_row_passes
    from coda.kernels import row_passes

    widths = {f"{probe_row_passes.LAYER}{d}" for d in bench_layer.LAYER_WIDTHS}
    for shape, fn, tuned, kernel in probe_row_passes.PASSES.values():
        assert "head_dim" in inspect.signature(getattr(row_passes, fn)).parameters
        assert any(name == tuned for name, _ in row_passes.TUNED)
        assert shape in bench_hf.SHAPES or shape in widths
        assert callable(getattr(row_passes, kernel))


def test_a_run_of_every_suite_leaves_the_diagnostics_out():
    from benchmarks import gpu_suite

    probe, attention = _common.Diagnostic(), _common.Diagnostic()
    suites = [("hf", 1), ("qk_norm_pass", probe), ("host", 4), ("attention_in_step", attention)]
    assert gpu_suite.chosen(suites, "") == [("hf", 1), ("host", 4)]
    assert gpu_suite.chosen(suites, "host,qk_norm_pass") == [("qk_norm_pass", probe), ("host", 4)]
    assert gpu_suite.chosen(suites, "attention_in_step") == [("attention_in_step", attention)]
    assert gpu_suite.chosen(suites, "none") == []
    every = gpu_suite.suite_list(SimpleNamespace(tune=False, out="."))
    diagnostics = {name for name, m in every if isinstance(m, _common.Diagnostic)}
    assert diagnostics == {
        "qk_norm_pass",
        "drope_pass",
        "drope_pass_layer",
        "attention_in_step",
        "gemm_in_step",
        "ncu_qk_norm",
        "ncu_traffic",
        "kernel_origin",
        "head_norm_pass",
        "loss_rows",
        "graph_gaps",
        "compile_graphs",
        "triton_launch",
        "hf_peak",
        "post_norm_passes",
    }


def test_the_gemm_probe_varies_one_thing_of_a_key_the_step_looks_up():
    """Each key of ``probe_gemm_in_step.KEYS`` is a GEMM the Llama-1B layer runs (a
    ``config_for`` kernel at its ``tuned.key`` of the 1B shape), and its candidates start with its
    current config: then that config at each other swizzle (the probe's rows differ from
    today's step in that one field), or each other tile of ``TILES``."""
    import dataclasses

    from benchmarks import probe_gemm_in_step as probe
    from benchmarks.bench_hf import SHAPES
    from coda.kernels import tuned

    shape = SHAPES[probe.SHAPE][1]
    d, f, tokens = shape["hidden_size"], shape["intermediate_size"], probe.BATCH * probe.SEQ
    layer_gemms = {  # (M, K, N) of each GEMM in the layer's kernel sequence with an epilogue
        "swiglu": (tokens, d, 2 * f),  # gate/up
        "residual": (tokens, f, d),  # down projection
        "dswiglu": (tokens, d, f),  # the down projection's dgrad
        "norm_bwd": (tokens, 2 * f, d),  # the gate/up dgrad
        "wgrad": (d, tokens, 2 * f),  # the gate/up weight gradient
        "lm_head": (tokens, d, shape["vocab_size"]),  # the LM head's logits
    }
    for kernel, k, n in probe.KEYS.values():
        assert kernel in tuned.KERNELS, kernel
        assert tuned.key(kernel, *layer_gemms[kernel]) == (kernel, k, n), (kernel, k, n)
        now = probe.current((kernel, k, n))
        got = probe.candidates((kernel, k, n), "swizzle")
        assert got[0] == now and len(set(got)) == len(probe.SWIZZLES)
        for cfg in got:
            assert dataclasses.replace(cfg, max_swizzle_size=now.max_swizzle_size) == now
        tiles = probe.candidates((kernel, k, n), "tile")
        assert tiles[0] == now and set(tiles[1:]) == set(probe.TILES) - {now}


def test_a_probe_leaves_the_table_it_installs_into_as_it_found_it():
    table = {"kept": 1}
    with _common.restored(table, "kept"), _common.restored(table, "new"):
        table["kept"], table["new"] = 2, 3
    assert table == {"kept": 1}
    with pytest.raises(RuntimeError), _common.restored(table, "kept"):
        table["kept"] = 5
        raise RuntimeError("a probe cut short")
    assert table == {"kept": 1}


def test_the_ncu_probe_reads_its_csv_pages():
    """ncu's CSV as the probe reads it: its ``==PROF==`` notes and the raw page's units row
    dropped, each kernel's calls and metrics summed (bytes and ns: ``--print-units base``),
    the total first; the details page as (section, metric, unit, value) rows."""
    from benchmarks import probe_ncu

    metrics = probe_ncu.TRAFFIC_METRICS
    head = ["ID", "Kernel Name", *metrics]
    raw = "\n".join(
        [
            "==PROF== Connected to process 1",
            ",".join(f'"{h}"' for h in head),
            ",".join(['""', '""', '"ns"', '"byte"', '"byte"', '"byte"']),
            '"0","gemm","1000","2,000,000","1000000","5000000"',
            '"1","norm","500","100","50","200"',
            '"2","gemm","3000","4000000","0","1000000"',
            "==PROF== Disconnected from process 1",
        ]
    )
    rows = probe_ncu.traffic_rows(probe_ncu.parse_csv(raw), "coda")
    total, first, second = rows
    assert (first["kernel"], first["calls"], first["us"]) == ("gemm", 2, 4.0)
    assert (first["dram_read_mb"], first["dram_write_mb"], first["l2_mb"]) == (6.0, 1.0, 6.0)
    assert second["kernel"] == "norm" and second["dram_read_mb"] == 1e-4
    assert total["kernel"] == "total" and total["calls"] == 3 and total["us"] == 4.5
    details = "\n".join(
        [
            '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"',
            '"0","_dqk_norm_kernel","Occupancy","Achieved Occupancy","%","41.5"',
            '"0","_dqk_norm_kernel","WarpStateStats","","",""',
        ]
    )
    (only,) = probe_ncu.details_rows(probe_ncu.parse_csv(details))
    assert (only["section"], only["metric"], only["value"]) == (
        "Occupancy",
        "Achieved Occupancy",
        41.5,
    )
    assert probe_ncu.parse_csv("==PROF== nothing profiled") == []


def test_the_origin_probe_names_each_matching_kernels_callers():
    """``probe_kernel_origin.origins``: kernels matched by name and summed per (kernel, op,
    shapes, callers), torch's own Python frames left out of the callers, largest first."""
    from benchmarks import probe_kernel_origin as pko

    def event(name, parent=None, kernels=(), shapes=()):
        kernels = [SimpleNamespace(name=k, duration=us) for k, us in kernels]
        return SimpleNamespace(name=name, cpu_parent=parent, kernels=kernels, input_shapes=shapes)

    frame = event("coda/transformers.py(418): forward")
    inner = event("site-packages/torch/autograd/graph.py(966): _engine_run_backward", frame)
    node = event("SliceBackward0", inner)
    zeros = event("aten::zeros", node)
    fills = [event("aten::fill_", zeros, [("FillFunctor<bf16>", 24.0)], [[8, 4]]) for _ in "ab"]
    gemm = event("aten::mm", frame, [("sm90_gemm", 500.0)])
    other = event("aten::zero_", frame, [("zero_kernel", 5.0)], [[2]])
    backward = event("MLPBackward", None, [("_col_sums_kernel", 4.0), ("_row_stat_kernel", 2.0)])
    found = [frame, inner, node, zeros, *fills, gemm, other, backward]
    rows = pko.origins(found, "fill|zero|^_", steps=2)
    assert [r["op"] for r in rows] == ["aten::fill_", "aten::zero_", "MLPBackward", "MLPBackward"]
    first = rows[0]
    assert (first["launches"], first["us"], first["kernel"]) == (1.0, 24.0, "FillFunctor<bf16>")
    assert [r["kernel"] for r in rows[2:]] == ["_col_sums_kernel", "_row_stat_kernel"]
    assert first["callers"] == ["aten::zeros", "SliceBackward0", frame.name]
    assert rows[1]["callers"] == [frame.name]


def test_the_cpu_host_probe_times_the_kernel_branch_and_puts_everything_back():
    """``probe_host_cpu``: with quack stood in, ``coda.gemm_swiglu`` on CPU tensors takes the
    kernel path through ``launch``'s GPU branch: the stub sees exactly one launch per call of
    each of the six pieces that launch (the op, the switch, the kernel function, ``launch``,
    ``run_epi_gemm``, ``coda.gemm_rope``: one kernel a call; warm-up and five rounds each) and
    of the second of each op's two first calls (the first plans through quack's frontend,
    stubbed whole), so the probe times that branch,
    not the interpreter; afterwards the reference path, the interpreter and
    quack are as they were."""
    import warnings

    import coda
    import coda.env
    from benchmarks import probe_host_cpu as probe
    from coda import _quack, ops
    from coda.kernels import _launch

    before = (coda.env.kernel_support, _launch.INTERPRET_OFF_GPU)
    calls = 50
    assert probe.pieces(calls)["launches seen"] == 2 + 6 * (calls + 5 * calls)
    assert (coda.env.kernel_support, _launch.INTERPRET_OFF_GPU) == before
    assert not ops._CHECKED and not _quack._PLANS  # no token plan left behind
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", coda.CodaReferencePathWarning)
        coda.gemm_swiglu(x, torch.randn(8, 16, dtype=torch.bfloat16))
    assert coda.last_path("gemm_swiglu")[0] == "reference"


def test_a_sweep_enters_a_winner_only_beyond_the_rounds_spread():
    """``tune_configs.verdict``: the fastest tile replaces the entry only where each of its
    rounds beat each of the entry's (run 221's 1B gate/up: 0.0002 ms of overlap, kept; run
    222's d=2048 dSwiGLU, entered); the entry's own win, or an entry not swept, keeps it."""
    from benchmarks import tune_configs as tc
    from coda.kernels.config import GemmConfig

    a, b, c = (GemmConfig(128, 192, 2, 1, True), GemmConfig(128, 192, 1, 2, True),
               GemmConfig(128, 128, 1, 2, True))  # fmt: skip
    overlapping = {a: [1.6282, 1.6207, 1.6214], b: [1.638, 1.6448, 1.628]}
    assert tc.verdict(overlapping, b) == {"best": a, "entry": b, "advice": "keep"}
    beyond = {a: [0.7235, 0.7228, 0.7186], c: [0.7094, 0.7078, 0.7136]}
    assert tc.verdict(beyond, a)["advice"] == "enter" and tc.verdict(beyond, a)["best"] == c
    assert tc.verdict(beyond, c) == {"best": c, "entry": c, "advice": "keep"}
    assert tc.verdict(beyond, b)["advice"] == "unswept"


def test_a_wide_sweep_times_every_tile_the_table_serves():
    """Every tile ``tuned`` serves a layer GEMM (its entries, the kernels' defaults, quack's
    default) is among the candidates a wide sweep times, so the sweep's verdict compares the
    entry in the same run and never reads "unswept" for a tile in use."""
    from benchmarks import tune_configs as tc
    from coda.kernels import tuned
    from coda.kernels.config import DEFAULT

    swept = set(tc.CANDIDATES + tc.WIDE)
    served = {(k, c) for k, c in tuned.TUNED.items() if k[0] in tc.KERNEL_OF.values()}
    served |= {((k,), c) for k, c in tuned.DEFAULTS.items()} | {(("quack",), DEFAULT)}
    assert {(k, c) for k, c in served if c not in swept} == set()
    kernels = {"rope", "residual", "swiglu", "dswiglu", "norm_bwd", "wgrad"}
    assert {k[0] for k, _ in served} >= kernels  # the table was read


def test_a_narrow_sweep_times_the_tables_entry_too():
    """``tune_configs.candidates``: without ``CODA_TUNE_WIDE`` the entry the table serves is
    timed beside the candidates (first, once) when it is not one of them, so a default sweep's
    verdict is never "unswept" (run 324, an H100: four of eleven d = 2048 GEMMs were)."""
    from benchmarks import tune_configs as tc
    from coda.kernels import tuned

    outside = tuned.TUNED[("residual", 5632, 2048)]  # the d=2048 down projection's 128 x 256
    assert outside not in tc.CANDIDATES
    got = tc.candidates("down_proj_d2048", outside)
    assert got == [outside, *tc.CANDIDATES]
    inside = tc.CANDIDATES[1]
    assert tc.candidates("o_proj_d2048", inside) == tc.CANDIDATES
    assert tc.candidates("wgrad_qkv_d2048", inside) == tc.CANDIDATES + tc.SPLIT_K
    assert tc.candidates("o_proj_d2048", tc.WIDE[0], wide=True) == tc.CANDIDATES + tc.WIDE


def test_a_swept_kernels_row_keeps_its_rounds_spread_and_clock():
    """``tune_configs.kernel_timing``: a tile's row carries the median of its round-robin
    rounds, the rounds, their spread and the clock (None where nvidia-smi gave none)."""
    from benchmarks import _common
    from benchmarks import tune_configs as tc

    clock = iter([3.0, 1.0, 2.0, 4.0, 5.0, 1.5])

    def timer(fn):
        return {"ms": next(clock), "sm_mhz": 1500.0 if fn == "a" else None}

    timed = _common.interleaved({"a": "a", "b": "b"}, rounds=3, timer=timer)
    # rounds: a b | b a | a b
    assert tc.kernel_timing(timed["a"]) == {
        "kernel_ms": 4.0, "rounds_ms": [3.0, 4.0, 5.0], "spread": 0.5, "sm_mhz": 1500.0
    }  # fmt: skip
    assert tc.kernel_timing(timed["b"])["rounds_ms"] == [1.0, 2.0, 1.5]
    assert tc.kernel_timing(timed["b"])["sm_mhz"] is None


@pytest.mark.compile
def test_the_expert_gemms_compile_on_quack_s_varlen_mainloop():
    """``probe_experts_varlen``: F4's SwiGLU program over gathered slot rows, ``scale_rows``
    with a routing weight per slot and B4's dSwiGLU program (the pre-activations as C)
    compile for sm_90a on quack's varlen GEMM (the groundwork of NOTES.md's experts design;
    the probe raises where quack's compile step is not reached)."""
    from benchmarks import probe_experts_varlen

    compiles = probe_experts_varlen.compile_expert_gemms()
    assert set(compiles) == {
        "gate/up + SwiGLU, gathered varlen",
        "down + routing-weight row scale, varlen",
        "down dgrad + dSwiGLU, gathered varlen",
    }
    assert all(n in (0, 1) for n in compiles.values())
