"""Benchmark: the token embedding's backward, dE[t_m] += dx_m, as ``coda.nn.Embedding`` runs it
(one stable sort of the ids, then ``scatter_rows_triton``: runs of equal ids summed in fp32 in
chunks of 16 sorted rows and then piece by piece, no atomics) against torch's
(``embedding_dense_backward``: sort, segment sums, ``compute_grad_weight`` and
``sum_and_scatter``) and torch.compile's.

Two id distributions (``_common.token_ids``): uniform, and Zipf (s = 1.1 over the vocabulary,
as text's token counts roughly are). The second is the hard case for a scatter that sums each
run of equal ids in one program: the most frequent id then owns a run of thousands of rows
(run 127: 1.25 ms against 0.29 uniform, before the scatter was split in two passes).

Rows: ``backward/*`` the backward alone (the module's gradient call at its shape),
``step/*`` what a user calls, ``emb(ids)`` and its ``.backward(dy)``. Variants are timed
round-robin (``interleaved``); ``host_ms`` is each call's host time on an idle GPU (a call
whose host time nears its GPU time is timed as host-bound).

    python -m benchmarks.bench_embedding     # prints rows (needs an SM90 GPU)
"""

from __future__ import annotations

import torch

from benchmarks._common import TOKEN_DISTRIBUTIONS, host_ms, interleaved, row, token_ids
from coda import nn as cnn
from coda.kernels.embedding import embedding_backward

# (name, vocab, d, tokens): Llama-3.2-1B's embedding at 4 x 4096 tokens; the d=1024 demo model
SHAPES = [("llama-1B", 128256, 2048, 16384), ("demo-d1024", 8192, 1024, 8192)]


def run() -> list[dict]:
    rows = []
    for name, V, d, M in SHAPES:
        for dist in TOKEN_DISTRIBUTIONS:
            gen = torch.Generator(device="cuda").manual_seed(0)
            ids = token_ids(dist, V, M, gen)
            dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            torch_emb = torch.nn.Embedding(V, d, device="cuda", dtype=torch.bfloat16)
            coda_emb = cnn.Embedding(V, d, _weight=torch_emb.weight)
            compiled = torch.compile(torch_emb)

            def step(module):
                def call():
                    module.weight.grad = None
                    module(ids).backward(dy)

                return call

            fns = {
                "backward/torch": lambda: torch.ops.aten.embedding_dense_backward(
                    dy, ids, V, -1, False
                ),
                "backward/coda": lambda: embedding_backward(ids, dy, V),
                "step/torch_eager": step(torch_emb),
                "step/torch_compile": step(compiled),
                "step/coda": step(coda_emb),
            }
            timings = interleaved(fns)
            top = torch.bincount(ids, minlength=V).max().item()
            shape = {"model": name, "vocab": V, "d": d, "tokens": M, "ids": dist, "top_count": top}
            for variant, t in timings.items():
                part = variant.split("/")[0]
                peer = timings[f"{part}/torch" if part == "backward" else "step/torch_eager"]
                rows.append(
                    row(
                        f"embedding/{name}/{dist}/{variant}",
                        shape,
                        t,
                        0.0,
                        speedup_vs_torch=peer["ms"] / t["ms"],
                        host_ms=host_ms(fns[variant]),
                    )
                )
    return rows


if __name__ == "__main__":
    for r in run():
        print(f"{r['name']:50s} {r['ms'] * 1e3:9.1f} us  x{r['speedup_vs_torch']:.3f} vs torch")
