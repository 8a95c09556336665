"""Train a small Llama-style model with coda layers and, from the same initial weights and the
same batches, with plain PyTorch; print final losses and tokens/s, overlay the loss curves.

    python demos/train.py                 # H200: 4 layers, d=1024, 300 steps (kernel path)
    python demos/train.py --steps 30      # CPU: a tiny model through the reference path

The data is synthetic and made here: sequences from a fixed random first-order Markov chain
over the vocabulary (each token has a few likely successors), so the loss has a known floor
well below log(V) and both models must learn the same table.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

import coda.nn as cnn


class CodaLlama(nn.Module):
    def __init__(self, vocab, d, layers, heads, kv_heads, ffn, device, dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, device=device, dtype=dtype)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(
            cnn.DecoderLayer(d, heads, kv_heads, ffn, device=device, dtype=dtype)
            for _ in range(layers)
        )
        self.head = cnn.LMHeadLoss(d, vocab, device=device, dtype=dtype)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x, targets)


class TorchLlama(nn.Module):
    """The same model in plain PyTorch, HF conventions (nn.Linear weights, rotate_half RoPE)."""

    def __init__(self, coda_model: CodaLlama, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.embed = nn.Embedding.from_pretrained(
            coda_model.embed.weight.detach().clone(), freeze=False
        )
        self.blocks = nn.ParameterList()
        self.names = []
        sd = {}
        for i, layer in enumerate(coda_model.layers):
            sd.update(layer.hf_state_dict(f"{i}."))
        sd.update(coda_model.head.hf_state_dict())
        self.p = nn.ParameterDict(
            {k.replace(".", "_"): nn.Parameter(v.clone()) for k, v in sd.items()}
        )
        self.n_layers = len(coda_model.layers)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        B, S, d = x.shape
        p = self.p
        hd = d // self.heads
        inv = 10000.0 ** (-torch.arange(0, hd, 2, device=x.device).float() / hd)
        ang = torch.arange(S, device=x.device).float()[:, None] * inv
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)

        def rot(t):
            h = t.shape[-1] // 2
            return torch.cat([-t[..., h:], t[..., :h]], -1)

        for i in range(self.n_layers):

            def w(name):
                return p[f"{i}_{name}".replace(".", "_")]

            y = F.rms_norm(x, (d,), w("input_layernorm.weight"), 1e-5)
            q = (y @ w("self_attn.q_proj.weight").t()).view(B, S, self.heads, hd).transpose(1, 2)
            k = (y @ w("self_attn.k_proj.weight").t()).view(B, S, -1, hd).transpose(1, 2)
            v = (y @ w("self_attn.v_proj.weight").t()).view(B, S, -1, hd).transpose(1, 2)
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + o.transpose(1, 2).reshape(B, S, d) @ w("self_attn.o_proj.weight").t()
            y = F.rms_norm(x, (d,), w("post_attention_layernorm.weight"), 1e-5)
            s = F.silu(y @ w("mlp.gate_proj.weight").t()) * (y @ w("mlp.up_proj.weight").t())
            x = x + s @ w("mlp.down_proj.weight").t()
        y = F.rms_norm(x, (d,), p["model_norm_weight"], 1e-5)
        logits = y @ p["lm_head_weight"].t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


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


def train(model, batches, steps, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    losses, t_start, tokens = [], None, 0
    for step, (x, y) in enumerate(batches):
        if step == 5:  # time from step 5: compiles and warm-up excluded
            if x.is_cuda:
                torch.cuda.synchronize()
            t_start, tokens = time.perf_counter(), 0
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.detach())  # no per-step host sync
        tokens += x.numel()
    losses = [float(v) for v in losses]  # synchronizes
    return losses, tokens / (time.perf_counter() - t_start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--png", default="demos/train_loss.png")
    args = ap.parse_args()
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
    coda_model = CodaLlama(
        cfg["vocab"],
        cfg["d"],
        cfg["layers"],
        cfg["heads"],
        cfg["kv_heads"],
        cfg["ffn"],
        device,
        dtype,
    )
    torch_model = TorchLlama(coda_model, cfg["heads"], cfg["kv_heads"])
    print(f"model: {cfg}, {steps} steps, {device}, {dtype}")
    print("path:", "kernel (SM90)" if gpu else "reference (CPU)")
    data = dict(vocab=cfg["vocab"], batch=cfg["batch"], seq=cfg["seq"], steps=steps, device=device)
    floor = math.log(4)  # entropy of the chain: 4 equally likely successors
    results, speed = {}, {}
    for name, model in (("coda", coda_model), ("pytorch", torch_model)):
        losses, speed[name] = train(model, markov_batches(**data), steps, lr)
        results[name] = losses
        print(
            f"{name:8s} final loss {sum(losses[-10:]) / 10:.4f} (mean of last 10)  "
            f"{speed[name]:,.0f} tokens/s"
        )
    print(f"loss floor of the data: ln 4 = {floor:.4f}; start: ln V = {math.log(cfg['vocab']):.2f}")
    diff = max(abs(a - b) for a, b in zip(results["coda"], results["pytorch"]))
    print(
        f"tokens/s coda / pytorch = {speed['coda'] / speed['pytorch']:.3f}; "
        f"max |loss difference| over the run = {diff:.4f}"
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    for name, losses in results.items():
        ax.plot(losses, label=name, lw=1)
    ax.axhline(floor, color="gray", ls=":", lw=1, label="data floor (ln 4)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{cfg['layers']} layers, d={cfg['d']}, {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png)
    print("wrote", args.png)


if __name__ == "__main__":
    main()
