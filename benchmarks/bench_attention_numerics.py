"""Does the layout of q, k, v change SDPA's gradient error? (a diagnostic for the fuzz's q/k
weight-gradient ratios on the H200)

coda's layer hands attention q, k, v as strided views of one packed (B, S, H + 2 Hkv, hd)
buffer; the PyTorch layer hands it RoPE's fresh contiguous q and k. For each SDPA backend (and
the default choice) and both layouts, this measures the relative Frobenius error of dq, dk, dv
and the output against a float64 evaluation, same bf16 inputs. Rows name the backend and
layout; an unsupported combination is recorded as such.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = ((2, 600, 8, 2, 64), (2, 600, 8, 4, 128), (3, 333, 4, 1, 128), (1, 1024, 16, 4, 64))
BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def _fro(got, ref):
    return float((got.double() - ref).norm() / ref.norm())


def _run(q, k, v, do, backend):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if backend is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def run() -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, S, H, Hkv, hd in SHAPES:
        packed = torch.randn(B, S, H + 2 * Hkv, hd, device="cuda", generator=g)
        packed = packed.to(torch.bfloat16)
        views = packed.transpose(1, 2)
        strided = (views[:, :H], views[:, H : H + Hkv], views[:, H + Hkv :])
        contiguous = tuple(t.contiguous() for t in strided)
        do = torch.randn(B, H, S, hd, device="cuda", generator=g).to(torch.bfloat16)
        with sdpa_kernel([SDPBackend.MATH]):
            ref = _run(*(t.double() for t in contiguous), do.double(), None)
        shape = {"B": B, "S": S, "H": H, "Hkv": Hkv, "hd": hd}
        for layout, qkv in (("packed_views", strided), ("contiguous", contiguous)):
            for bname, backend in BACKENDS.items():
                name = f"attention_numerics/{bname}/{layout}"
                try:
                    got = _run(*qkv, do, backend)
                except Exception as e:  # an unsupported backend/layout: recorded, not hidden
                    rows.append({"name": name, **shape, "error": repr(e)[:200]})
                    continue
                errs = {
                    f"err_{n}": _fro(a, b) for n, a, b in zip(("o", "dq", "dk", "dv"), got, ref)
                }
                rows.append({"name": name, **shape, **errs})
    return rows
