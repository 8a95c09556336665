"""Does the layout of q, k, v change SDPA's speed? (a diagnostic for issue 10's HF Llama step)

In the patched HF Llama-1B and coda's 1B model the same cuDNN flash kernels ran 4-7 % longer
than under Liger and torch.compile (run 21: backward 34.7 vs 32.3-33.2 ms, forward 12.8-13.1
vs 11.9-12.3 ms per step). coda hands attention q, k, v as strided views of the QKV GEMM's one
(B, S, H + 2 Hkv, hd) output; HF's projections give each its own (B, S, heads, hd) buffer.
This times SDPA forward+backward (causal, GQA, the 1B layer's shape, bf16) on both layouts
and on contiguous (B, heads, S, hd) tensors, and the copy that would give the latter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._common import bench

SHAPE = (4, 4096, 32, 8, 64)  # batch, seq, heads, kv heads, head_dim: Llama-3.2-1B


def run() -> list[dict]:
    B, S, H, Hkv, hd = SHAPE
    bf = torch.bfloat16
    packed = torch.randn(B, S, H + 2 * Hkv, hd, device="cuda", dtype=bf)
    do = torch.randn(B, H, S, hd, device="cuda", dtype=bf)

    def views():  # coda: views of one packed buffer
        t = packed.transpose(1, 2)
        return t[:, :H], t[:, H : H + Hkv], t[:, H + Hkv :]

    q_hf = torch.randn(B, S, H, hd, device="cuda", dtype=bf)
    k_hf, v_hf = (torch.randn(B, S, Hkv, hd, device="cuda", dtype=bf) for _ in range(2))

    def own_buffers():
        return q_hf.transpose(1, 2), k_hf.transpose(1, 2), v_hf.transpose(1, 2)

    layouts = {
        "packed_views (coda)": views,
        "own_buffers (HF)": own_buffers,
        "contiguous_bhsd": lambda: tuple(t.contiguous() for t in views()),
    }
    rows = []
    for name, make in layouts.items():
        q, k, v = (t.detach().requires_grad_(True) for t in make())

        def step(q=q, k=k, v=v):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.backward(do)

        rows.append({"name": f"attention_layout/{name}", "B": B, "S": S, **bench(step)})
    rows.append(
        {
            "name": "attention_layout/copy_to_contiguous",
            "B": B,
            "S": S,
            **bench(lambda: [t.contiguous() for t in views()]),
        }
    )
    return rows
