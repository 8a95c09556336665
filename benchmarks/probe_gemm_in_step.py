"""Probe: a GEMM's tile config timed inside an HF model's training step, at the power cap.

``tuned.TUNED`` was chosen by ``tune_configs.py`` timing each GEMM alone, on an idle GPU near
boost clock. The patched HF steps run at the H200's power cap (~690 W; NOTES.md, session 24),
where a kernel's time follows the clock the whole step settles at, so a config that moves
fewer bytes (the raster swizzle's L2 reuse, a wider tile's fewer shared-memory reads) can win
in the step though it ties alone. For each GEMM key of ``KEYS`` this installs each candidate of
``candidates`` in ``TUNED`` (restored after), profiles the patched Llama-3.2-1B step and
times it: the quack kernels' milliseconds per step (only the installed key's kernels should
move), the step's milliseconds, and the GPU clock and power over the timed step.

A ``gpu_suite.py`` suite run only when named (``--only gemm_in_step``); ``CODA_GEMM_KEYS``
("swiglu,dswiglu") picks among ``KEYS``, ``CODA_GEMM_VARY`` ("swizzle" or "tile") what varies.
"""

from __future__ import annotations

import dataclasses
import os

from benchmarks._common import (
    Diagnostic,
    bench_long,
    clocked,
    kernel_table,
    out_of_time,
    progress,
    restored,
    selected,
)
from benchmarks.bench_hf import training_step
from benchmarks.hf_models import BATCH, SEQ
from coda.kernels.config import GemmConfig

SUITE = "gemm_in_step"
SHAPE = "llama-3.2-1B"
# name -> the key of ``tuned.TUNED`` (``tuned.key``) at the Llama-1B step (16384 tokens):
# its epilogue GEMMs by time in run 100's profile
KEYS = {
    "norm_bwd": ("norm_bwd", 16384, 2048),  # gate/up dgrad + norm backward (B6)
    "swiglu": ("swiglu", 2048, 16384),  # gate/up + SwiGLU (F4)
    "dswiglu": ("dswiglu", 2048, 8192),  # down dgrad + dSwiGLU (B4)
    "down": ("residual", 8192, 2048),  # down projection + residual
    "wgrad": ("wgrad", 2048, 16384),  # gate/up weight gradient (B7): (kernel, d, N)
    "lm_head": ("lm_head", 2048, 128256),  # CE-S's logits GEMM (its tile_n must divide V)
}
SWIZZLES = (1, 2, 4, 8)
# cooperative tiles cuBLAS runs in the same step (Liger's rows, run 109's ncu table), each
# wider per warpgroup instruction than the ping-pong 128 x 192 (fewer shared-memory bytes per
# multiply-add); a tile a key's epilogue cannot take is recorded with quack's error
TILES = (
    GemmConfig(128, 256, 2, 1, False),
    GemmConfig(128, 256, 1, 2, False),
    GemmConfig(256, 128, 2, 1, False),
    GemmConfig(256, 192, 2, 1, False),
)
VARIED = ("swizzle", "tile")  # CODA_GEMM_VARY: what ``candidates`` varies (default: tile)


def current(key):
    """The config the step runs at ``key`` today (its tuned entry, else the default)."""
    from coda.kernels.tuned import config_for

    kernel, k, n = key
    return config_for(kernel, BATCH * SEQ, k, n)


def candidates(key, vary: str = "tile") -> list:
    """The key's current config first, then: at each raster swizzle of ``SWIZZLES``
    (``vary="swizzle"``; run 110: none won), or each tile of ``TILES`` not already current."""
    now = current(key)
    if vary == "swizzle":
        others = [s for s in SWIZZLES if s != now.max_swizzle_size]
        return [now] + [dataclasses.replace(now, max_swizzle_size=s) for s in others]
    return [now] + [t for t in TILES if t != now]


def _row(name, cfg, now, step) -> dict:
    kernels = kernel_table(step, steps=2, top=100_000)
    timed = clocked(bench_long)(step)
    quack = [k for k in kernels if "quack" in k["kernel"]]
    return {
        "name": f"{SUITE}/{SHAPE}/{name}",
        "config": dataclasses.asdict(cfg),
        "current": cfg == now,
        "quack_ms": sum(k["us"] for k in quack) / 1e3,
        "kernel_ms": sum(k["us"] for k in kernels) / 1e3,
        "step_ms": timed["ms"],
        **{k: timed[k] for k in ("sm_mhz", "power_w") if k in timed},
        "quack_kernels": [
            {"kernel": k["kernel"][:90], "calls": k["calls"], "us": k["us"]} for k in quack[:12]
        ],
    }


def run() -> list[dict]:
    import coda.transformers as ct
    from coda.kernels import tuned

    vary = os.environ.get("CODA_GEMM_VARY", "tile")
    if vary not in VARIED:  # before the model is built
        raise ValueError(f"CODA_GEMM_VARY: one of {VARIED}, got {vary!r}")
    step = training_step(SHAPE, ct.apply_coda)
    rows = []
    for name in selected("CODA_GEMM_KEYS", KEYS) or KEYS:
        key = KEYS[name]
        now = current(key)
        with restored(tuned.TUNED, key):
            for cfg in candidates(key, vary):
                if out_of_time():
                    return rows
                tuned.TUNED[key] = cfg
                try:
                    rows.append(progress(_row(name, cfg, now, step)))
                except Exception as e:  # a tile this epilogue cannot take
                    rows.append(
                        {
                            "name": f"{SUITE}/{SHAPE}/{name}",
                            "config": dataclasses.asdict(cfg),
                            "error": repr(e)[:300],
                        }
                    )
    return rows


class Suite(Diagnostic):
    """``SUITE`` as a ``gpu_suite.py`` entry."""

    def run(self) -> list[dict]:
        return run()
