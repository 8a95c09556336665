"""How long a process's first training step takes with coda's kernels, cold and warm.

The first call of each kernel configuration builds it: CuTe DSL traces and compiles the
quack-mainloop GEMMs with coda's epilogues, Triton compiles the row kernels. Both keep what
they build on disk (quack's ``.o`` cache, ``QUACK_CACHE_DIR``, whose key covers quack's and
coda's sources; Triton's, ``TRITON_CACHE_DIR``), so a restarted job should load instead of
compile. This probe times the first step (forward + backward of ``coda.nn.CausalLM``), then
the second, in one process, and says how many files the two caches hold after it; run it
twice with the same cache folders to see a cold start beside a warm one.

    QUACK_CACHE_DIR=D/q TRITON_CACHE_DIR=D/t python benchmarks/probe_first_step.py  (CUDA)
"""

from __future__ import annotations

import json
import os
import time


def count_files(path: str | None) -> int | None:
    if not path or not os.path.isdir(path):
        return None
    return sum(len(files) for _, _, files in os.walk(path))


def main():
    t_import = time.perf_counter()
    import torch

    import coda.nn as cnn

    imported = time.perf_counter() - t_import
    cfg = dict(vocab=8192, d=1024, n_layers=4, n_heads=8, n_kv_heads=4, ffn=2816, head_dim=128)
    torch.manual_seed(0)
    model = cnn.CausalLM(**cfg, device="cuda")
    tok = torch.randint(0, cfg["vocab"], (8, 1024), device="cuda")

    def step() -> float:
        t0 = time.perf_counter()
        model(tok, tok).backward()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    first, second = step(), step()
    print(
        json.dumps(
            {
                "config": cfg,
                "import_s": round(imported, 2),
                "first_step_s": round(first, 2),
                "second_step_s": round(second, 4),
                "quack_cache_files": count_files(os.environ.get("QUACK_CACHE_DIR")),
                "triton_cache_files": count_files(os.environ.get("TRITON_CACHE_DIR")),
            }
        )
    )


if __name__ == "__main__":
    main()
