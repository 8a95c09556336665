"""Train a small Llama-style model with coda layers and, from the same initial weights and the
same batches, with plain PyTorch; print final losses and tokens/s, overlay the loss curves.

    python demos/train.py                 # H200: 4 layers, d=1024, 300 steps (kernel path)
    python demos/train.py --graph         # ... each model's step as one CUDA graph
    python demos/train.py --compile       # ... each model under torch.compile's CUDA graphs
    python demos/train.py --steps 30      # CPU: a tiny model through the reference path

At d=1024 an eager step is bound by the host, which enqueues every kernel from Python;
``--graph`` trains both models through ``coda.nn.GraphedStep`` (the same steps on the same
batches, replayed from one CUDA graph each), which times their kernels instead, and
``--compile`` the way most users would: each model under
``torch.compile(mode="reduce-overhead")`` (Inductor fuses the plain model and the glue
around coda's ops, and records CUDA graphs; the optimizer step stays eager). On the CPU
``--compile`` traces with ``backend="aot_eager"``: it checks the trace, not the speed.

The coda model is ``coda.nn.CausalLM``; the PyTorch one is ``coda.reference.model.TorchLlama``
built from its HF state dict. The plot goes to ``--out`` (default ``out/``, git-ignored).

The data is synthetic and made here: sequences from a fixed random first-order Markov chain
over the vocabulary (each token has a few likely successors), so the loss has a known floor
well below log(V) and both models must learn the same table.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings

import torch

import coda
import coda.nn as cnn
from coda.reference.model import TorchLlama


def markov_batches(vocab, batch, seq, steps, device, seed=0, branch=4):
    """Token batches from a fixed random Markov chain: each token has ``branch`` successors."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branch), generator=g)
    for _ in range(steps):
        tok = torch.empty(batch, seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        pick = torch.randint(0, branch, (batch, seq), generator=g)
        for j in range(seq):
            tok[:, j + 1] = succ[tok[:, j], pick[:, j]]
        yield tok[:, :-1].to(device), tok[:, 1:].to(device)


def train(model, batches, steps, lr, warmup_steps, graph=False, compiled=False):
    """AdamW for ``steps`` batches. Tokens/s is timed over the steps after the first
    ``warmup_steps`` (compiles and warm-up excluded); None when no step is left to time.
    ``graph`` (a CUDA model): each step through ``coda.nn.GraphedStep``, the same math.
    ``compiled``: the model under ``torch.compile`` (``--compile``), the optimizer eager."""
    on_gpu = next(model.parameters()).is_cuda
    captured = graph and on_gpu
    if captured:  # a graph reads the lr from the device, so the schedule reaches it
        lr = torch.tensor(lr, device="cuda")
    opt = torch.optim.AdamW(
        model.parameters(), lr, (0.9, 0.95), weight_decay=0.0,
        fused=captured or None, capturable=captured,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    run = cnn.GraphedStep(model, opt) if graph else None
    forward = model
    if compiled:  # its CUDA graphs on the GPU; on the CPU the trace alone (no C++ compile)
        forward = torch.compile(
            model, **({"mode": "reduce-overhead"} if on_gpu else {"backend": "aot_eager"})
        )
    losses, t_start, tokens = [], None, 0
    for step, (x, y) in enumerate(batches):
        if step == warmup_steps:
            if x.is_cuda:
                torch.cuda.synchronize()
            t_start, tokens = time.perf_counter(), 0
        if run is not None:
            loss = run(x, y)
        else:
            if compiled and on_gpu:  # a new step: the graphs' last outputs may be reused
                torch.compiler.cudagraph_mark_step_begin()
            loss = forward(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sched.step()
        # no per-step host sync; a copy, as a graph's next replay overwrites its output
        losses.append(loss.detach().clone())
        tokens += x.numel()
    losses = [float(v) for v in losses]  # synchronizes
    speed = tokens / (time.perf_counter() - t_start) if t_start is not None else None
    return losses, speed


def add_step_args(ap, gpu_steps: int, cpu_steps: int) -> None:
    """--steps and --warmup, shared by the training demos."""
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps, >= 1 (default {gpu_steps} on a GPU, {cpu_steps} on a CPU)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="steps left out of the tokens/s timing (compiles, warm-up); default 5",
    )


def check_step_args(ap, args) -> None:
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.warmup < 0:
        ap.error(f"--warmup must be >= 0, got {args.warmup}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description="Train a small Llama-style model with coda layers and with plain PyTorch "
        "from the same weights and batches; print losses and tokens/s, plot the curves."
    )
    add_step_args(ap, 300, 30)
    ap.add_argument(
        "--out",
        default="out",
        help="folder for the loss plot train_loss.png (created; default out/)",
    )
    ap.add_argument("--png", default=None, help="exact path of the loss plot (overrides --out)")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="train each model through coda.nn.GraphedStep: its step as one CUDA graph "
        "(on a GPU; the CPU runs the same steps eagerly)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help='train each model under torch.compile(mode="reduce-overhead") (on a GPU; the '
        'CPU traces with backend="aot_eager")',
    )
    args = ap.parse_args(argv)
    check_step_args(ap, args)
    if args.graph and args.compile:
        ap.error("--graph and --compile are two ways to the same CUDA graphs: pick one")
    return args


def main(argv=None):
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    if gpu:
        cfg = dict(vocab=8192, d=1024, layers=4, heads=8, kv_heads=4, ffn=2816, batch=8, seq=1024)
        steps, lr = args.steps or 300, 1e-3
    else:
        cfg = dict(vocab=256, d=64, layers=2, heads=4, kv_heads=2, ffn=192, batch=4, seq=64)
        steps, lr = args.steps or 30, 3e-3
    dtype = torch.bfloat16 if gpu else torch.float32
    torch.manual_seed(0)
    coda_model = cnn.CausalLM(
        cfg["vocab"],
        cfg["d"],
        cfg["layers"],
        cfg["heads"],
        cfg["kv_heads"],
        cfg["ffn"],
        device=device,
        dtype=dtype,
    )
    torch_model = TorchLlama.of(coda_model)
    how = ", graphed" if args.graph else ", compiled" if args.compile else ""
    print(f"model: {cfg}, {steps} steps, {device}, {dtype}{how}")
    print("path:", "kernel (SM90)" if gpu else "reference (CPU: checks the math, not the speed)")
    data = dict(vocab=cfg["vocab"], batch=cfg["batch"], seq=cfg["seq"], steps=steps, device=device)
    batches = list(markov_batches(**data))  # once, for both models, before any clock starts
    floor = math.log(4)  # entropy of the chain: 4 equally likely successors
    last = min(10, steps)
    results, speed = {}, {}
    for name, model in (("coda", coda_model), ("pytorch", torch_model)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", coda.CodaReferencePathWarning)  # said above
            losses, speed[name] = train(
                model, batches, steps, lr, args.warmup, args.graph, args.compile
            )
        results[name] = losses
        rate = f"{speed[name]:,.0f} tokens/s" if speed[name] else "not timed (steps <= warmup)"
        print(
            f"{name:8s} final loss {sum(losses[-last:]) / last:.4f} (mean of last {last})  {rate}"
        )
    print(f"loss floor of the data: ln 4 = {floor:.4f}; start: ln V = {math.log(cfg['vocab']):.2f}")
    diff = max(abs(a - b) for a, b in zip(results["coda"], results["pytorch"]))
    ratio = f"{speed['coda'] / speed['pytorch']:.3f}" if speed["coda"] else "n/a"
    print(f"tokens/s coda / pytorch = {ratio}; max |loss difference| over the run = {diff:.4f}")
    if not gpu:
        print("(CPU: both models run plain torch math; tokens/s here says nothing about coda)")
    elif not (args.graph or args.compile):
        print(
            "(eager steps at this size wait on the host's launches; "
            "--graph or --compile time the kernels)"
        )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    png = args.png or os.path.join(args.out, "train_loss.png")
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, losses in results.items():
        ax.plot(losses, label=name, lw=1)
    ax.axhline(floor, color="gray", ls=":", lw=1, label="data floor (ln 4)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{cfg['layers']} layers, d={cfg['d']}, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    print("wrote", png)


if __name__ == "__main__":
    main()
