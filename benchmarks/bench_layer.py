"""Benchmark one Llama layer's forward (M = 16384 tokens = 4 x 4096, SDPA flash attention)
against its floor: its four GEMMs at cuBLAS speed plus attention alone, each timed in the same
run. Peers: the same layer in torch eager (HF style), torch.compile, and with Liger's kernels.

coda's layer is the steady state of a stack: it takes x0 with a0 = x0 * gamma1 and r0 from the
previous layer's last epilogue, and hands the next layer x2, a2, r2 (KERNELS.md F1..F5); the
saved pre-activation u is written (training forward). ``coda_decoder_layer`` is what a user
calls, ``coda.nn.DecoderLayer`` under ``torch.no_grad()``: its entry norm is a row kernel of its
own (no previous layer hands it a0, r0) and it keeps nothing for backward (since session 61:
``coda_decoder_layer_storing_for_backward`` is the same call storing SwiGLU's pre-activation
as before, ``storing_for_backward``); ``coda_decoder_layer_before_row_kernels`` is the same
call with this entry norm through Inductor as before ``coda.kernels.norm_rows``
(``without_row_kernels``). The floor's parts and
every variant are timed round-robin (``interleaved``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._common import against_floor, beside_floor, row, selected
from benchmarks._switches import storing_for_backward, without_row_kernels
from benchmarks.bench_forward import ffn, heads
from coda import nn as cnn
from coda.kernels import gemm_residual_rms as grr
from coda.kernels import gemm_rope as rp
from coda.kernels import gemm_swiglu as sw
from coda.kernels.tuned import config_for
from coda.reference.rope import apply_rope_hf, hf_cos_sin

B, S, HD = 4, 4096, 128
M = B * S


def attention(q, k, v):
    """(B, heads, S, hd) views -> (M, H*hd): causal GQA flash attention."""
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(M, -1)


def split_heads(qkv, H, Hkv):
    t = qkv.view(B, S, H + 2 * Hkv, HD).transpose(1, 2)
    return t[:, :H], t[:, H : H + Hkv], t[:, H + Hkv :]


def torch_layer(x0, w, cos, sin, H, Hkv, norm=None, rope=None, act=None):
    """HF Llama layer forward in eager ops; ``norm``/``rope``/``act`` swap in Liger's."""
    norm = norm or (lambda h, g: F.rms_norm(h, (h.shape[-1],), g, 1e-5))
    y1 = norm(x0, w["g1"])
    q, k, v = split_heads(y1 @ w["wqkv"], H, Hkv)
    if rope is None:
        q, k = apply_rope_hf(q, cos, sin), apply_rope_hf(k, cos, sin)
    else:
        q, k = rope(q, k)
    x1 = x0 + attention(q, k, v) @ w["wo"]
    gu = norm(x1, w["g2"]) @ w["wgu"]
    f = gu.shape[-1] // 2
    s = act(gu[:, :f], gu[:, f:]) if act else F.silu(gu[:, :f]) * gu[:, f:]
    return x1 + s @ w["wd"]


def coda_layer(x0, a0, r0, w, pos, freq, H, Hkv, d, f):
    qkv = rp.gemm_rope_kernel(
        a0, w["wqkv"], r0, pos, freq, config_for("rope", M, d, (H + 2 * Hkv) * HD)
    )
    o = attention(*split_heads(qkv, H, Hkv))
    x1, a1, r1 = grr.gemm_residual_rms_kernel(
        o, w["wo"], x0, w["g2"], 1e-5, config_for("residual", M, H * HD, d)
    )
    s, u = sw.gemm_swiglu_kernel(a1, w["wil"], r1, True, config_for("swiglu", M, d, 2 * f))
    return grr.gemm_residual_rms_kernel(
        s, w["wd"], x1, w["g1"], 1e-5, config_for("residual", M, f, d)
    )


LAYER_WIDTHS = (2048, 4096)


def layer_widths() -> list[int]:
    """Every layer width, or those named in ``CODA_LAYER_SHAPES`` ("d2048", "d4096"): both
    layer benchmarks (forward here, forward+backward in ``bench_train``) run these."""
    known = {f"d{d}": d for d in LAYER_WIDTHS}
    chosen = selected("CODA_LAYER_SHAPES", known)
    return [known[c] for c in chosen] if chosen else list(LAYER_WIDTHS)


def run() -> list[dict]:
    try:
        import liger_kernel.transformers.functional as liger
    except Exception:
        liger = None
    rows = []
    for d in layer_widths():
        f, (H, Hkv) = ffn(d), heads(d)
        nqkv = (H + 2 * Hkv) * HD

        def mat(i, o):
            return torch.randn(i, o, device="cuda", dtype=torch.bfloat16) * i**-0.5

        w = {
            "wqkv": mat(d, nqkv),
            "wo": mat(H * HD, d),
            "wgu": mat(d, 2 * f),
            "wd": mat(f, d),
            "g1": 1 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16),
            "g2": 1 + 0.1 * torch.randn(d, device="cuda", dtype=torch.bfloat16),
        }
        w["wil"] = torch.stack([w["wgu"][:, :f], w["wgu"][:, f:]], -1).flatten(-2)
        x0 = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        a0 = x0 * w["g1"]
        r0 = torch.rsqrt(x0.float().pow(2).mean(-1) + 1e-5)
        pos = (torch.arange(M, device="cuda") % S).float()
        freq = rp.rope_freq_table(HD, H + Hkv, Hkv, device="cuda")
        cos, sin = hf_cos_sin(torch.arange(S, device="cuda"), HD, dtype=torch.bfloat16)
        q, k, v = split_heads(torch.randn(M, nqkv, device="cuda", dtype=torch.bfloat16), H, Hkv)
        y = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        o = torch.randn(M, H * HD, device="cuda", dtype=torch.bfloat16)
        s = torch.randn(M, f, device="cuda", dtype=torch.bfloat16)
        parts = {
            "gemm_qkv": lambda: y @ w["wqkv"],
            "gemm_o": lambda: o @ w["wo"],
            "gemm_gate_up": lambda: y @ w["wgu"],
            "gemm_down": lambda: s @ w["wd"],
            "attention": lambda: attention(q, k, v),
        }
        compiled = torch.compile(torch_layer)
        layer = cnn.DecoderLayer(d, H, Hkv, f, device="cuda", backend="kernel")
        x = x0.view(B, S, d)
        variants = {
            "coda": lambda: coda_layer(x0, a0, r0, w, pos, freq, H, Hkv, d, f),
            # what a user calls: the module, its entry norm included (its own random weights)
            "coda_decoder_layer": lambda: layer(x),
            "coda_decoder_layer_storing_for_backward": storing_for_backward(lambda: layer(x)),
            "coda_decoder_layer_before_row_kernels": without_row_kernels(lambda: layer(x)),
            "torch_eager": lambda: torch_layer(x0, w, cos, sin, H, Hkv),
            "torch_compile": lambda: compiled(x0, w, cos, sin, H, Hkv),
        }
        if liger is not None:
            variants["liger"] = lambda: torch_layer(
                x0,
                w,
                cos,
                sin,
                H,
                Hkv,
                norm=lambda h, g: liger.liger_rms_norm(h, g, 1e-5, in_place=False),
                rope=lambda q, k: liger.liger_rope(q, k, cos[None], sin[None]),
                act=liger.liger_swiglu,
            )
        shape = {"M": M, "d": d, "ffn": f, "heads": H, "kv_heads": Hkv, "head_dim": HD}
        with torch.no_grad():
            timed = against_floor("layer_fwd", shape, parts, variants, rows)
            for name, t in timed.items():
                rows.append(
                    row(f"layer_fwd/{name}", shape, t, 0.0, ratio_vs_floor=t["ratio_vs_floor"])
                )
            table = beside_floor(parts, variants["coda_decoder_layer"])
            rows.append({"name": "layer_fwd/coda_decoder_layer_kernels", **shape, **table})
    return rows
