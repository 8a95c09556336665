"""The training step as a user runs it: host cost per call, CUDA-graph replay, whole models.

- ``host``: microseconds per call at tiny shapes (M = 256, the GPU idle between calls), so the
  time is the host's: torch.mm, quack's raw GEMM call (the target: a coda call at most 1.5x
  it), every public op, and the modules' forward and forward+backward.
- ``graph``: ``DecoderLayer`` and ``LMHeadLoss`` forward+backward captured once with
  ``torch.cuda.graph`` and replayed, against the eager step (same run), d=1024 and d=2048.
- ``model``: a whole causal LM, embedding + layers + final norm + LM head + loss, one training
  step (forward+backward, and with the AdamW update), tokens/s, MFU (6 N T + attention
  FLOPs over the H200's dense bf16 peak, 989 TFLOP/s) and peak memory: coda (``coda.nn.CausalLM``;
  also as one CUDA graph, with per-layer activation checkpointing, and under ``torch.compile``)
  against the same model in plain PyTorch (``coda.reference.model.TorchLlama``) eager, under
  ``torch.compile``, and with Liger's ops, all in one run. Shapes: Llama-3.2-1B (16 layers,
  d=2048, 32/8 heads of 64, ffn 8192, V=128256, untied) at 4 x 4096 tokens, and the training
  demo's d=1024 model. With ``CODA_MODEL_AMP=1`` every peer instead holds fp32 parameters and
  runs its forward under bf16 autocast (``Autocast``), as a mixed-precision trainer does (HF's
  Trainer with ``bf16=True``): rows ``model/<shape>+amp/...``.
"""

from __future__ import annotations

import copy
import functools
import os
import time

import torch

import coda
import coda.nn as cnn
from benchmarks._common import (
    SKIPPED,
    PeakAlone,
    bench,
    bench_long,
    bf16_autocast,
    clocked,
    graphed,
    interleaved,
    kernel_table,
    liger_functional,
    mixed_precision,
    out_of_time,
    progress,
    row,
    selected,
    where_time_goes,
)
from benchmarks._switches import (
    storing_for_backward,
    without_direct_triton,
    without_loss_rows_kernels,
    without_plan_tapes,
    without_target_kernel,
)
from coda import _quack
from coda.kernels.config import DEFAULT
from coda.reference.model import TorchLlama

BF = torch.bfloat16
PEAK_TFLOPS = 989.0
# model steps with a per-kernel table (coda_compile: opt-in, beside coda's to compare)
PROFILED = ("coda", "torch_compile", "liger", "coda_compile")
# every model-step variant, in the order run (``CODA_MODEL_PEERS`` picks among them)
MODEL_PEERS = (
    "coda",
    "torch_compile",
    "liger",
    "torch_eager",
    "torch_compile_graphed",
    "coda_compile",
    "coda_compile_graphed",
    "coda_recompute",
    "coda_checkpointed",
    "coda_checkpointed_storing",
    "coda_torch_embedding",
)
# run when ``CODA_MODEL_PEERS`` names none: the others (torch eager, torch.compile's CUDA
# graphs, coda compiled with and without them, recomputing, checkpointed) are opt-in, since
# all of them with their AdamW states and pass 2's steps do not fit on one H200 at the 1B
# shape (run 66: out of memory at 132.9 GiB with the seven of then)
MODEL_DEFAULT_PEERS = ("coda", "torch_compile", "liger")


def model_peers() -> list[str]:
    """The model-step variants to run: ``CODA_MODEL_PEERS``'s, else the default ones."""
    return selected("CODA_MODEL_PEERS", MODEL_PEERS) or list(MODEL_DEFAULT_PEERS)


def _per_call_us(fn, n=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


HOST_ROUNDS = 15  # a round of the cheapest calls is ~3 ms: 15 cost seconds, not minutes


def _host_us(fns: dict, n: int) -> dict:
    """us per call of each of ``fns`` (``us``, the median round) with every round's figure
    (``rounds_us``) and their spread: ``interleaved`` rounds of ``_per_call_us`` over ``n``
    calls, each function once per round: host time drifts within a run (a collection, the
    CPU's clock, a neighbour on the host), and a same-run comparison must not depend on
    order. Run 169 read quack's raw call at 19.6 us against 13.5-14.5 in runs 164 and 168,
    from 5 rounds of 60 calls and with no round kept to tell why: the rounds are now kept,
    and more and longer (15 of 200 calls)."""

    def timer(fn):
        return {"ms": _per_call_us(fn, n) / 1e3}

    timed = interleaved(fns, rounds=HOST_ROUNDS, timer=timer)
    return {
        name: {
            "us": t["ms"] * 1e3,
            "rounds_us": [ms * 1e3 for ms in t["rounds_ms"]],
            "spread": t["spread"],
        }
        for name, t in timed.items()
    }


def host_profile(name: str, fn, calls: int = 200, top: int = 25, grad: bool = True) -> dict:
    """Where one call's host time goes: ``cProfile`` over ``calls`` calls of ``fn`` (kernels
    queued, not awaited), the ``top`` functions by their own time, in us per call."""
    import cProfile
    import pstats

    with torch.set_grad_enabled(grad):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, fn) -> (cc, nc, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return {
        "name": f"host_profile/{name}",
        "calls": calls,
        "top_own_us_per_call": [
            {
                "fn": f"{os.path.basename(k[0])}:{k[1]}({k[2]})",
                "own_us": v[2] / calls * 1e6,
                "cum_us": v[3] / calls * 1e6,
                "ncalls_per_call": v[1] / calls,
            }
            for k, v in rows
        ],
    }


def host_rows() -> list[dict]:
    M, d, f, V = 256, 256, 512, 1024
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*s, scale=1.0):
        return torch.randn(*s, device="cuda", dtype=BF, generator=g) * scale

    x, w, res, gamma = r(M, d), r(d, d, scale=d**-0.5), r(M, d), 1 + r(d, scale=0.1)
    w_il, w2, w_lm = r(d, 2 * f, scale=d**-0.5), r(d, 2 * f, scale=d**-0.5), r(d, V)
    H, Hkv, hd = 4, 2, 64
    w_qkv = r(d, (H + 2 * Hkv) * hd, scale=d**-0.5)
    pos = torch.arange(M, device="cuda")
    rstd = torch.rand(M, device="cuda") + 0.5
    t = torch.randint(0, V, (M,), device="cuda")
    raw, d_raw = _quack.identity_mod(), torch.empty(M, d, device="cuda", dtype=BF)
    layer = cnn.DecoderLayer(d, H, Hkv, f, device="cuda")
    head = cnn.LMHeadLoss(d, V, device="cuda")
    xl = r(1, M, d).requires_grad_(True)

    def layer_step():
        layer(xl).backward(xl)

    def head_step():
        head(xl, t.view(1, M)).backward()

    calls = {  # timed under no_grad
        "torch.mm": lambda: torch.mm(x, w),
        "quack raw GEMM": lambda: _quack.run_epi_gemm(
            raw, x, w, d_raw, None, {}, DEFAULT, replay=False
        ),
        "quack raw GEMM, coda's plan replay": lambda: _quack.run_epi_gemm(
            raw, x, w, d_raw, None, {}, DEFAULT
        ),
        "coda.gemm_residual_rms": lambda: coda.gemm_residual_rms(x, w, res, gamma),
        "coda.gemm_rmsnorm_gemm": lambda: coda.gemm_rmsnorm_gemm(x, w, res, gamma, w2),
        "coda.gemm_swiglu": lambda: coda.gemm_swiglu(x, w_il, rstd),
        "coda.gemm_rope": lambda: coda.gemm_rope(
            x, w_qkv, pos, head_dim=hd, n_heads=H, n_kv_heads=Hkv, rstd=rstd
        ),
        "coda.linear_cross_entropy": lambda: coda.linear_cross_entropy(x, w_lm, t, rstd=rstd),
        "DecoderLayer forward (no_grad)": lambda: layer(xl.detach()),
    }
    steps = {  # timed with gradients
        "DecoderLayer forward+backward": layer_step,
        "LMHeadLoss forward+backward": head_step,
    }
    # the calls with Triton kernels, also with each launched through Triton's own call
    # (``without_direct_triton``), timed in the same run
    for group, names in (
        (calls, ["coda.gemm_residual_rms", "coda.gemm_rmsnorm_gemm"]),
        (steps, list(steps)),
    ):
        for name in names:
            group[name + ", Triton's own launches"] = without_direct_triton(group[name])
    # the LM head's target rule as its torch form (eight launches), same run
    for group, name in (
        (calls, "coda.linear_cross_entropy"),
        (steps, "LMHeadLoss forward+backward"),
    ):
        group[name + ", torch-form target check"] = without_target_kernel(group[name])
        # and its loss weights and reduction as their torch forms (twelve launches), same run
        group[name + ", torch-form loss rows"] = without_loss_rows_kernels(group[name])
    # and the public ops without their plan tapes (every launch keyed), same run
    for name in [n for n in calls if n.startswith("coda.") and "," not in n]:
        calls[name + ", without plan tapes"] = without_plan_tapes(calls[name])
    rows, us = [], {}
    rows.append(host_profile("DecoderLayer forward+backward", layer_step))
    rows.append(host_profile("LMHeadLoss forward+backward", head_step))
    rows.append(host_profile("coda.gemm_swiglu", calls["coda.gemm_swiglu"], grad=False))
    for name in ("coda.gemm_residual_rms", "coda.gemm_rmsnorm_gemm"):  # 2 and 3 kernels a call
        rows.append(host_profile(name, calls[name], grad=False))
    with torch.no_grad():
        us.update(_host_us(calls, n=200))
    us.update(_host_us(steps, n=20))
    raw_us = us["quack raw GEMM"]["us"]
    for name, timed in us.items():
        v = timed["us"]
        grad = torch.enable_grad() if name in steps else torch.no_grad()
        with grad:
            fn = steps.get(name) or calls[name]
            kernels = sum(k["calls"] for k in kernel_table(fn, steps=2, top=1000))
        rows.append(
            {
                "name": f"host/{name}",
                "M": M,
                "us_per_call": v,
                "ratio_vs_quack_raw": v / raw_us,
                "kernels_per_call": kernels,
                "us_per_kernel": v / max(kernels, 1),
                "rounds_us": timed["rounds_us"],
                "spread": timed["spread"],
            }
        )
    return rows


def graph_rows() -> list[dict]:
    rows = []
    for d, H, Hkv, f, B, S in ((1024, 8, 4, 2816, 8, 1024), (2048, 16, 8, 5632, 4, 4096)):
        layer = cnn.DecoderLayer(d, H, Hkv, f, device="cuda")
        x = torch.randn(B, S, d, device="cuda", dtype=BF, requires_grad=True)
        dy = torch.randn_like(x)

        def step():
            for p in (*layer.parameters(), x):
                p.grad = None
            layer(x).backward(dy)

        eager = bench(step)
        try:
            replay = graphed(step)
            t_graphed = bench(replay)
        except Exception as e:
            rows.append({"name": "graph/DecoderLayer", "d": d, "error": repr(e)[:300]})
            continue
        shape = {"d": d, "M": B * S}
        rows.append(row("graph/DecoderLayer/eager", shape, eager, 0.0))
        rows.append(
            row(
                "graph/DecoderLayer/graphed",
                shape,
                t_graphed,
                0.0,
                speedup=eager["ms"] / t_graphed["ms"],
            )
        )
    return rows


def _liger_ops(liger) -> dict:
    """Liger's functional kernels in ``TorchLlama``'s op slots."""
    return {
        "rms_norm": lambda h, g, eps: liger.liger_rms_norm(h, g, eps, in_place=False),
        "rope": liger.liger_rope,
        "swiglu": liger.liger_swiglu,
        "linear_ce": liger.liger_fused_linear_cross_entropy,
    }


def graphed_train_step(model, tokens, targets, lr=1e-4):
    """The whole training step (forward, backward, AdamW) through ``coda.nn.GraphedStep``,
    warmed up and captured here; returns the call a user's loop makes on this batch (the
    inputs copied into the graph's buffers, the replay, the loss returned), a
    ``functools.partial`` whose ``.func`` is the ``GraphedStep``."""
    lr = torch.tensor(lr, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True, capturable=True)
    step = cnn.GraphedStep(model, opt)
    for _ in range(step.warmup + 1):  # the eager calls, then the capture's
        step(tokens, targets)
    return functools.partial(step, tokens, targets)


def _model_flops(cfg, tokens) -> float:
    d, L, f, V, H, hd, S = (cfg[k] for k in ("d", "layers", "ffn", "vocab", "heads", "hd", "seq"))
    n_kv = cfg["kv_heads"]
    params = L * (d * (H + 2 * n_kv) * hd + H * hd * d + 3 * d * f) + d * V
    attn = L * 4 * S * H * hd * tokens / 2  # causal: half the score matrix, fwd
    return 6 * params * tokens + 3 * attn


# the model suite's shapes (``CODA_MODEL_SHAPES`` picks): Llama-3.2-1B and the demo's d=1024
MODEL_SHAPES = {
    "llama-1B": dict(
        vocab=128256,
        d=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        hd=64,
        ffn=8192,
        batch=4,
        seq=4096,
    ),
    "demo-d1024": dict(
        vocab=8192, d=1024, layers=4, heads=8, kv_heads=4, hd=128, ffn=2816, batch=8, seq=1024
    ),
}


def build_model(cfg: dict, dtype=BF, device="cuda"):
    """coda's ``CausalLM`` of a ``MODEL_SHAPES`` entry, seeded (every peer starts from its
    weights)."""
    torch.manual_seed(0)
    return cnn.CausalLM(
        cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["ffn"],
        head_dim=cfg["hd"], device=device, dtype=dtype,
    )  # fmt: skip


class Autocast(torch.nn.Module):
    """``model`` called under bf16 autocast on its parameters' device (``bf16_autocast``):
    fp32 master weights, bf16 compute, the optimizer on the fp32 parameters, the backward
    outside the region. A module, so that ``GraphedStep`` and the optimizer take it as the
    model."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        with bf16_autocast(next(self.model.parameters()).device.type):
            return self.model(*args, **kwargs)


class Storing(torch.nn.Module):
    """``model`` whose forward stores what a backward would read also in a non-reentrant
    checkpoint's first pass (``_switches.storing_for_backward``): the checkpointed step as
    before session 64. A module, as ``Autocast``, for the optimizer and the peak."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return storing_for_backward(lambda: self.model(*args, **kwargs))()


def _torch_embedding(model) -> None:
    """``model``'s ``coda.nn.Embedding`` made torch's ``nn.Embedding`` in place (the inverse of
    ``coda.nn.Embedding.adopt``: the same module and weight, tied where the model ties them):
    the step before session 29."""
    model.embed.__class__ = torch.nn.Embedding


def model_rows(liger) -> list[dict]:
    configs = MODEL_SHAPES
    chosen = selected("CODA_MODEL_SHAPES", configs)
    only_peers = model_peers()
    amp = mixed_precision("CODA_MODEL_AMP")
    rows = []
    for shape_name, cfg in configs.items():
        if chosen and shape_name not in chosen:
            continue
        name = shape_name + ("+amp" if amp else "")
        tokens_n = cfg["batch"] * cfg["seq"]
        coda_model = build_model(cfg, torch.float32 if amp else BF)

        def coda_copy(edit):
            model = copy.deepcopy(coda_model)
            edit(model)
            return model

        # coda's default first, then the peers, then coda's variants (``MODEL_PEERS``'s
        # order): a run cut by its time budget still has the same-run comparison. Only the
        # selected ones are built.
        makers = {
            "coda": lambda: coda_model,
            "torch_compile": lambda: torch.compile(TorchLlama.of(coda_model)),
            "liger": lambda: TorchLlama.of(coda_model, ops=_liger_ops(liger)),
            "torch_eager": lambda: TorchLlama.of(coda_model),
            # torch.compile's own CUDA graphs (cudagraph trees): the graphed peer of
            # ``coda_graphed`` (its optimizer step stays eager, one fused launch)
            "torch_compile_graphed": lambda: torch.compile(
                TorchLlama.of(coda_model), mode="reduce-overhead"
            ),
            "coda_compile": lambda: torch.compile(copy.deepcopy(coda_model)),
            # coda under torch.compile's own CUDA graphs, a user's one-line route to graphs:
            # its capture fails at 4096+ tokens in a fresh process (runs 145-147, the LM head;
            # NOTES session 33); its AdamW step stays eager, as the peer's above
            "coda_compile_graphed": lambda: torch.compile(
                copy.deepcopy(coda_model), mode="reduce-overhead"
            ),
            # the four-GEMM LM head, least memory
            "coda_recompute": lambda: coda_copy(lambda m: setattr(m.head, "method", "recompute")),
            # activation checkpointing per layer (issue 11)
            "coda_checkpointed": lambda: coda_copy(lambda m: setattr(m, "checkpoint", True)),
            # the same as it ran before session 64 (its first forward storing u)
            "coda_checkpointed_storing": lambda: Storing(
                coda_copy(lambda m: setattr(m, "checkpoint", True))
            ),
            # the embedding's backward as torch's (``nn.Embedding``, the same weight) in place
            # of coda's sorted scatter: the step before session 29
            "coda_torch_embedding": lambda: coda_copy(_torch_embedding),
        }
        peers = {
            k: Autocast(make()) if amp else make()
            for k, make in makers.items()
            if k in only_peers and (k != "liger" or liger is not None)
        }
        tok = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device="cuda")
        tgt = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device="cuda")
        flops = _model_flops(cfg, tokens_n)

        def model_row(label, t, peak, name=name, cfg=cfg, tokens_n=tokens_n, flops=flops):
            seconds = t["ms"] * 1e-3
            shape = {"tokens": tokens_n, "d": cfg["d"], "layers": cfg["layers"]}
            return row(
                f"model/{name}/{label}",
                shape,
                t,
                flops,
                tokens_per_s=tokens_n / seconds,
                mfu=flops / seconds / (PEAK_TFLOPS * 1e12),
                peak_gib=peak,
                # at the power cap a step's speed is its energy: the GPU's median draw over
                # the timed round, times the step (None where nvidia-smi gave nothing)
                joules_per_step=t["power_w"] * seconds if "power_w" in t else None,
            )

        # pass 1, one peer at a time: its peak memory as if alone (``PeakAlone``: the other
        # peers' weights stay resident for pass 2 and are not counted) and its kernel table
        fns, peaks = {}, {}
        for peer, model in peers.items():
            if out_of_time():
                rows.append({"name": f"model/{name}/{peer}", **SKIPPED})
                continue
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

            def fwd_bwd(model=model):
                # gradients set to None first, as a training step has them: called back to
                # back without it (the kernel table's profiled calls, before session 26),
                # every call added its gradients into the last call's, one add per parameter
                model.zero_grad(set_to_none=True)
                model(tok, tgt).backward()

            def full(model=model, opt=opt):
                model(tok, tgt).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            t0 = time.perf_counter()
            try:
                with PeakAlone(model) as mem:
                    for _ in range(5):
                        full()
                peaks[peer] = mem.gib
            except Exception as e:
                rows.append(progress({"name": f"model/{name}/{peer}", "error": repr(e)[:300]}))
                continue
            # the first five steps' wall time holds any compile (torch.compile's, the kernels'
            # first build), reported as it happens: a call cut later keeps it
            first = {"name": f"model/{name}/{peer}/first_5_steps", "s": time.perf_counter() - t0}
            print(f"model/{name}/{peer}: first 5 steps {first['s']:.0f} s", flush=True)
            rows.append(progress({**first, "peak_gib": peaks[peer]}))
            fns[f"{peer}/step+adamw"], fns[f"{peer}/fwd+bwd"] = full, fwd_bwd
            if peer in PROFILED and not out_of_time():
                try:  # where the forward+backward's time goes, beside the peers' (issue 8)
                    rows.append(
                        {"name": f"model/{name}/{peer}/kernels", **where_time_goes(fwd_bwd)}
                    )
                except Exception as e:
                    rows.append({"name": f"model/{name}/{peer}/kernels", "error": repr(e)[:300]})
            model.zero_grad(set_to_none=True)  # nothing of this peer's step stays resident
            opt.state.clear()  # while the next one is measured; pass 2 keeps the optimizer
            model = opt = None
        # coda as one CUDA graph, captured after pass 1 (its memory pool stays resident)
        if "coda/step+adamw" in fns and not out_of_time():
            try:  # its peak over warm-up, capture and replay: the pool holds the capture's
                with PeakAlone(peers["coda"]) as mem:
                    replay = graphed_train_step(peers["coda"], tok, tgt)
                    for _ in range(2):
                        replay()
                peaks["coda_graphed"] = mem.gib
                fns["coda_graphed/step+adamw"] = replay
            except Exception as e:
                rows.append({"name": f"model/{name}/coda_graphed", "error": repr(e)[:300]})
            replay = None
        # pass 2: every peer's step timed in interleaved rounds (``_common.interleaved``)
        if fns and not out_of_time():
            try:  # (out of memory with every peer resident, on an 80 GB card: run 342)
                timed = interleaved(fns, timer=clocked(bench_long))
            except Exception as e:  # recorded beside pass 1's rows, which stay
                timed = {}
                rows.append(progress({"name": f"model/{name}/timed", "error": repr(e)[:300]}))
            for label, t in timed.items():
                rows.append(progress(model_row(label, t, peaks[label.split("/")[0]])))
        fns = timed = None
        peers = None
        torch.cuda.empty_cache()
        mine = [r for r in rows if r["name"].startswith(f"model/{name}/") and "ms" in r]
        for what in ("step+adamw", "fwd+bwd"):
            ref = [r for r in mine if r["name"] == f"model/{name}/torch_compile/{what}"]
            for r in mine:
                if ref and r["name"].endswith(what):
                    r["speedup_vs_torch_compile"] = ref[0]["ms"] / r["ms"]
    return rows


def run(parts=("host", "graph", "model")) -> list[dict]:
    out = []
    table = {
        "host": host_rows,
        "graph": graph_rows,
        "model": lambda: model_rows(liger_functional()),
    }
    for part in parts:
        try:
            out += table[part]()
        except Exception as e:  # recorded, never hidden
            import traceback

            out.append(
                {
                    "name": f"step/{part}",
                    "error": repr(e),
                    "trace": traceback.format_exc()[-2000:],
                }
            )
    return out
