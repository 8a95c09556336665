"""Train a Hugging Face ``LlamaForCausalLM`` as is and patched by ``coda.transformers.apply_coda``,
from the same initial weights on the same batches; print tokens/s and losses of both.

    python demos/hf_finetune.py                # H200: 4 layers, d=1024, 200 steps (kernels)
    python demos/hf_finetune.py --steps 20     # CPU: a tiny model, coda's reference path

Needs transformers (``pip install -e ".[hf]"``). The model is built here from a config (random
init, no download); the data is the training demo's synthetic Markov chain (``demos/train.py``),
so the loss has a known floor (ln 4). Both models call ``model(input_ids, labels=input_ids)``
exactly as a user's training loop does: the patched one returns the loss from coda's LM head
without materializing the logits.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings

import torch
from train import add_step_args, check_step_args, markov_batches  # demos/train.py

import coda
import coda.nn
import coda.transformers as ct


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Train an HF Llama unpatched and patched by coda.transformers.apply_coda "
        "from the same weights and batches; print tokens/s and losses."
    )
    add_step_args(ap, 200, 20)
    ap.add_argument(
        "--method",
        default="auto",
        choices=coda.nn.LM_HEAD_METHODS,
        help="coda's LM-head loss program (default auto: scaled_exp when vocab %% 128 == 0)",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    check_step_args(ap, args)
    return args


def train(model, batches, steps, warmup, label, progress):
    """AdamW over ``batches``; returns (losses, tokens/s over the steps after ``warmup``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    losses, t0, tokens = [], None, 0
    bar = None
    if progress:
        from tqdm import tqdm  # a dependency of transformers

        bar = tqdm(total=steps, desc=label, leave=False)
    for step, (x, _) in enumerate(batches):
        if step == warmup:
            if x.is_cuda:
                torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
        loss = model(input_ids=x, labels=x, use_cache=False).loss  # no KV cache to fill
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        tokens += x.numel()
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    losses = [float(v) for v in losses]  # one synchronization, at the end
    speed = tokens / (time.perf_counter() - t0) if t0 is not None else None
    return losses, speed


def main(argv=None):
    args = parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    if gpu:
        shape = dict(
            vocab_size=8192,
            hidden_size=1024,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=2816,
        )
        batch, seq, steps = 8, 1024, args.steps or 200
    else:
        shape = dict(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=192,
        )
        batch, seq, steps = 4, 64, args.steps or 20
    config = LlamaConfig(**shape, max_position_embeddings=seq, attn_implementation="sdpa")
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).to(device, dtype)
    patched = ct.apply_coda(copy.deepcopy(plain), method=args.method)
    print(f"model: {shape}, batch {batch} x {seq}, {steps} steps, {device}, {dtype}")
    print(
        "coda path:", "kernel (SM90)" if gpu else "reference (CPU: checks the math, not the speed)"
    )
    data = dict(vocab=shape["vocab_size"], batch=batch, seq=seq, steps=steps, device=device)
    batches = list(markov_batches(**data))  # once, for both models, before any clock starts
    last = min(10, steps)
    losses, speed = {}, {}
    for name, model in (("unpatched", plain), ("coda", patched)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", coda.CodaReferencePathWarning)  # said above
            losses[name], speed[name] = train(
                model, batches, steps, args.warmup, name, not args.no_progress
            )
        rate = f"{speed[name]:,.0f} tokens/s" if speed[name] else "not timed (steps <= warmup)"
        mean = sum(losses[name][-last:]) / last
        print(f"{name:10s} final loss {mean:.4f} (mean of last {last})  {rate}")
    print(
        f"loss floor of the data: ln 4 = {math.log(4):.4f}; start: ln V = "
        f"{math.log(shape['vocab_size']):.2f}"
    )
    diff = max(abs(a - b) for a, b in zip(losses["coda"], losses["unpatched"]))
    ratio = f"{speed['coda'] / speed['unpatched']:.3f}" if speed["coda"] else "n/a"
    print(f"tokens/s coda / unpatched = {ratio}; max |loss difference| over the run = {diff:.4f}")
    if not gpu:
        print("(CPU: both models run plain torch math; tokens/s here says nothing about coda)")


if __name__ == "__main__":
    main()
