"""How long ``torch.compile`` of a kernel-path ``coda.nn.CausalLM`` takes at a given shape, and
where it spends that time (issue 11).

Run 134's 1B model suite: coda's eager first five steps 44 s, torch.compile's plain model 28 s,
then ``torch.compile(coda_model)`` did not finish its first five steps in 400 s. This probe
compiles one model per configuration given on the command line (``layers:d:vocab:embedding``,
``embedding`` one of ``coda`` or ``torch``), after an eager step has built the kernels, and
prints the first compiled step's wall time; every ``--dump-s`` seconds Python's stacks go to
stdout (``faulthandler``), so a call cut by its limit still shows where the compile was.

    python benchmarks/probe_compile_time.py 2:2048:128256:coda 2:2048:128256:torch
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time

import torch

import coda.nn as cnn
from benchmarks.bench_step import _torch_embedding


def one(layers: int, d: int, vocab: int, embedding: str, tokens=(4, 4096)) -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    heads = d // 64
    model = cnn.CausalLM(vocab, d, layers, heads, max(1, heads // 4), 4 * d, device="cuda")
    if embedding == "torch":
        _torch_embedding(model)
    tok = torch.randint(0, vocab, tokens, device="cuda")

    def step(run):
        model.zero_grad(set_to_none=True)
        run(tok, tok).backward()
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    step(model)
    eager_first = time.perf_counter() - t0
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    step(compiled)
    compiled_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(compiled)
    compiled_second = time.perf_counter() - t0
    return {
        "layers": layers,
        "d": d,
        "vocab": vocab,
        "embedding": embedding,
        "eager_first_s": round(eager_first, 1),
        "compiled_first_s": round(compiled_first, 1),
        "compiled_second_s": round(compiled_second, 3),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+", help="layers:d:vocab:embedding (coda or torch)")
    p.add_argument("--dump-s", type=float, default=60.0)
    args = p.parse_args()
    faulthandler.dump_traceback_later(args.dump_s, repeat=True, file=sys.stdout)
    for c in args.configs:
        layers, d, vocab, emb = c.split(":")
        print(one(int(layers), int(d), int(vocab), emb), flush=True)


if __name__ == "__main__":
    main()
