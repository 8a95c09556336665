"""Does the layout of q, k, v change SDPA's speed? (a diagnostic for issue 10's HF steps)

In the patched HF models the same cuDNN flash kernels run longer than under Liger's patch
(run 93: Llama-3.2-1B backward 33.6 vs 31.2 ms per step, forward 12.2 vs 11.7; Qwen3-0.6B
backward 44.9 vs 36.7, forward 15.0 vs 13.4). coda hands attention q, k, v as strided views
of the QKV GEMM's one (B, S, H + 2 Hkv, hd) output; HF's projections give each its own
(B, S, heads, hd) buffer. This times SDPA (causal, GQA as HF calls it, bf16) forward alone
and forward+backward on both layouts and on contiguous (B, heads, S, hd) tensors, at both
models' attention shapes, with the copy that would give each layout from the packed one,
and records the strides of the gradients SDPA returns for each and its three largest kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._common import bench, kernel_table

SHAPES = {  # batch, seq, heads, kv heads, head_dim
    "llama-3.2-1B": (4, 4096, 32, 8, 64),
    "qwen3-0.6B": (4, 4096, 16, 8, 128),
}


def layouts(B, S, H, Hkv, hd):
    """name -> a function giving (q, k, v) (B, heads, S, hd) in that layout: views of one
    packed random buffer (coda's), or copies of them (timing a function is timing its copy)."""
    bf = torch.bfloat16
    packed = torch.randn(B, S, H + 2 * Hkv, hd, device="cuda", dtype=bf)

    def views():  # coda: views of one packed buffer
        t = packed.transpose(1, 2)
        return t[:, :H], t[:, H : H + Hkv], t[:, H + Hkv :]

    def own_buffers():  # HF: each projection its own (B, S, heads, hd) buffer
        return tuple(t.transpose(1, 2).contiguous().transpose(1, 2) for t in views())

    def contiguous():
        return tuple(t.contiguous() for t in views())

    return {
        "packed_views (coda)": views,
        "own_buffers (HF)": own_buffers,
        "contiguous_bhsd": contiguous,
    }


def run() -> list[dict]:
    rows = []
    for shape_name, (B, S, H, Hkv, hd) in SHAPES.items():
        do = torch.randn(B, S, H, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        dims = {"shape": shape_name, "B": B, "S": S, "heads": H, "kv_heads": Hkv, "head_dim": hd}
        for name, make in layouts(B, S, H, Hkv, hd).items():
            q, k, v = (t.detach().requires_grad_(True) for t in make())

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def step(q=q, k=k, v=v):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                out.backward(do)

            step()
            grads = {f"d{n}_stride": list(t.grad.stride()) for n, t in zip("qkv", (q, k, v))}
            rows.append({"name": f"attention_layout/{name}/forward", **dims, **bench(fwd)})
            kernels = [k["kernel"][:60] for k in kernel_table(step, steps=2, top=3)]
            rows.append(
                {
                    "name": f"attention_layout/{name}/fwd_bwd",
                    **dims,
                    **grads,
                    "top_kernels": kernels,
                    **bench(step),
                }
            )
            rows.append(
                {
                    "name": f"attention_layout/{name}/copy_from_packed",
                    **dims,
                    **bench(lambda make=make: make()),
                }
            )
    return rows
