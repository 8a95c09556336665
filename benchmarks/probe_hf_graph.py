"""Probe: where a patched HF model's captured step departs from its eager step, bit for bit.

Run 73: through ``coda.nn.GraphedStep`` a tiny patched Llama/Qwen3 (SDPA's math backend) gave
the eager loop's losses bitwise through the captured step and 1e-6 off after it, where coda's
own ``CausalLM`` stays bitwise. This probe holds the weights fixed (no optimizer) and compares,
per parameter, the gradient of one eager forward+backward with the gradient the captured
forward+backward gives on its first and second replay of the same batch; it also records how
each SDPA call was made (an explicit mask or ``is_causal``) eagerly and under the capture.

    python benchmarks/probe_hf_graph.py [--out DIR]   (CUDA; writes DIR/probe_hf_graph.json)
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import coda.transformers as ct
from benchmarks.hf_models import build

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    vocab_size=1024,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)


def _model(family: str):
    return ct.apply_coda(build(family, TINY, "cuda", torch.bfloat16))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def probe(family: str, backend) -> dict:
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        capturing = torch.cuda.is_current_stream_capturing()
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        calls.append((capturing, mask is None, bool(kwargs.get("is_causal", False))))
        return sdpa(*args, **kwargs)

    ids = torch.randint(0, 1024, (4, 256), generator=torch.Generator().manual_seed(3)).cuda()
    a = _model(family)
    b = copy.deepcopy(a)

    def step(model, x):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        return loss.detach()

    F.scaled_dot_product_attention = recording
    try:
        with sdpa_kernel(backend):
            want_loss = step(a, ids)
            want = _grads(a)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(b, ids)
            torch.cuda.current_stream().wait_stream(side)
            buf = ids.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                loss = step(b, buf)
            replays = []
            for _ in range(2):
                graph.replay()
                torch.cuda.synchronize()
                got = {n: p.grad for n, p in b.named_parameters() if p.grad is not None}
                differ = {
                    n: float((got[n].float() - want[n].float()).abs().max())
                    for n in want
                    if not torch.equal(got[n], want[n])
                }
                replays.append({"loss_equal": bool(torch.equal(loss, want_loss)), "differ": differ})
    finally:
        F.scaled_dot_product_attention = sdpa
    modes = sorted({f"capturing={c} mask_none={m} is_causal={k}" for c, m, k in calls})
    return {
        "family": family,
        "backend": backend.name,
        "params": len(want),
        "sdpa_calls": modes,
        "replays": replays,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    rows = []
    for family in ("llama", "qwen3"):
        for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
            try:
                row = probe(family, backend)
            except RuntimeError as e:  # a backend this shape or GPU does not run
                row = {"family": family, "backend": backend.name, "error": str(e)[:300]}
            print(json.dumps(row))
            rows.append(row)
    with open(os.path.join(args.out, "probe_hf_graph.json"), "w") as f:
        json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
