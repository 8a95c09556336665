"""Where does the layer's q/k weight-gradient error come from? (a diagnostic for the fuzz's
q/k ratios on the H200)

For a few large random layers, one bf16 forward+backward through ``coda.nn.DecoderLayer`` and
through the plain PyTorch layer (``TorchLlama``), both against the same layer in float64. Every
call of ``F.scaled_dot_product_attention`` is observed, so besides the weight gradients the
record has, per path, the error of the rotated q and k that enter attention, of the output, and
of dq and dk that leave it: the stage where coda's error overtakes PyTorch's is the cause. Each
case runs under the default SDPA backend choice and under the math backend.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import coda.nn as cnn
from coda import layouts
from coda.reference.model import hf_layer_step
from coda.reference.rope import head_perm

CASES = ((2, 600, 1024, 8, 2, 128), (2, 512, 768, 12, 4, 64), (1, 700, 1024, 16, 4, 64))
_SDPA = F.scaled_dot_product_attention


def _fro(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


def _spy(seen: list):
    """A stand-in for F.scaled_dot_product_attention that keeps q, k, o and their gradients
    (a plain function, so torch.compile's tracing of coda's row kernels still sees one)."""

    @functools.wraps(_SDPA)
    def sdpa(q, k, v, **kw):
        for t in (q, k):
            t.retain_grad()
        o = _SDPA(q, k, v, **kw)
        o.retain_grad()
        seen.append((q, k, o))
        return o

    return sdpa


def _run_peer(layer, x, dy):
    out, dx, p = hf_layer_step(layer, x, dy)
    names = ("q_proj", "k_proj", "v_proj")
    return out, {**{f"dW_{n[0]}": p[f"self_attn_{n}_weight"].grad for n in names}, "dx": dx}


def _run_coda(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_(True)
    out = layer(xr)
    out.backward(dy)
    q, k, v = layouts.qkv_weight_to_hf(
        layer.w_qkv.grad,
        n_heads=layer.n_heads,
        n_kv_heads=layer.n_kv_heads,
        head_dim=layer.head_dim,
    )
    return out.detach(), {"dW_q": q, "dW_k": k, "dW_v": v, "dx": xr.grad}


def _observed(fn, *args, adjacent=False):
    """(out, grads, stages) of one run with SDPA observed; ``adjacent``: coda's q/k heads hold
    RoPE pairs as adjacent columns, put back in HF's half-split order to compare."""
    seen = []
    F.scaled_dot_product_attention = _spy(seen)
    try:
        out, grads = fn(*args)
    finally:
        F.scaled_dot_product_attention = _SDPA
    q, k, o = seen[0]
    stages = {"q": q.detach(), "k": k.detach(), "o": o.detach(), "dq": q.grad, "dk": k.grad}
    if adjacent:
        inv = torch.argsort(head_perm(q.shape[-1])).to(q.device)
        stages = {n: t if n == "o" else t[..., inv] for n, t in stages.items()}
    return out, grads, stages


def run(cases=CASES, device="cuda", backend="kernel") -> list[dict]:
    """The suite entry (H200, kernel path); ``device="cpu", backend="auto"`` runs the same
    comparison on the reference path, a quick check of this script itself."""
    rows = []
    for case, (B, S, d, H, Hkv, hd) in enumerate(cases):
        torch.manual_seed(case)
        layer = cnn.DecoderLayer(d, H, Hkv, 2 * d, head_dim=hd, device=device, backend=backend)
        with torch.no_grad():
            for w in (layer.w_qkv, layer.w_o, layer.w_il, layer.w_d):
                w.normal_(std=w.shape[0] ** -0.5)
        x = torch.randn(B, S, d, device=device).to(torch.bfloat16)
        dy = torch.randn(B, S, d, device=device).to(torch.bfloat16)
        layer64 = copy.deepcopy(layer).double()
        with sdpa_kernel([SDPBackend.MATH]):
            _, g64, s64 = _observed(_run_peer, layer64, x.double(), dy.double())
        for backend in ("default", "math"):
            ctx = sdpa_kernel([SDPBackend.MATH]) if backend == "math" else contextlib.nullcontext()
            with ctx:
                _, gc, sc = _observed(_run_coda, layer, x, dy, adjacent=True)
                _, gp, sp = _observed(_run_peer, layer, x, dy)
            row = {"name": f"layer_grad_numerics/{backend}", "B": B, "S": S, "d": d, "H": H}
            row.update({"Hkv": Hkv, "hd": hd})
            for n in g64:
                ec, ep = _fro(gc[n], g64[n]), _fro(gp[n], g64[n])
                row.update({f"ratio_{n}": ec / ep, f"err_coda_{n}": ec, f"err_torch_{n}": ep})
            for n in s64:
                if sc[n].shape == s64[n].shape:  # (the CPU reference path expands GQA's k)
                    row[f"err_coda_{n}"] = _fro(sc[n], s64[n])
                row[f"err_torch_{n}"] = _fro(sp[n], s64[n])
            rows.append(row)
    return rows
