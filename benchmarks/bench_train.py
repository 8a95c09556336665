"""Benchmark training steps: one Llama layer forward+backward and the LM head + CE
forward+backward (M = 16384 tokens = 4 x 4096), against their floors and peers, same run.

Layer floor: its 12 GEMMs in the layouts autograd uses (forward Y = X W, dgrad dY W^T, wgrad
X^T dY; cuBLAS) plus SDPA flash attention forward+backward. LM-head floor: its three GEMMs
(logits, dX, dW). Peers: torch eager (HF-style modules), torch.compile, Liger. Memory: the
activation memory a layer's forward keeps for backward, and the LM head's extra memory
(``extra_gib``: the peak during forward+backward over what was allocated before it, every
gradient already allocated). The LM head's variants and
its floor's GEMMs are timed in interleaved rounds (``_common.interleaved``), each row with its
round medians and their spread. ``CODA_LM_HEAD_SOFTCAP=c``: every LM-head variant's logits
soft-capped, c tanh(l / c) (Gemma 2's, c = 30), those that take a cap only
(``SOFTCAP_VARIANTS``). ``CODA_LAYER_POST_NORMS=1``: the layer also with a norm after each
sublayer (Gemma 2's and 3's form, ``DecoderLayer(post_norms=True)``; the floor is the same
GEMMs and attention) as coda's and as torch.compile's, beside the pre-norm rows.
"""

from __future__ import annotations

import os
from unittest import mock

import torch
import torch.nn.functional as F

import coda.nn as cnn
from benchmarks._common import (
    SKIPPED,
    TOKEN_DISTRIBUTIONS,
    against_floor,
    bench,
    beside_floor,
    graphed,
    host_ms,
    idle_report,
    in_order,
    interleaved,
    kernel_table,
    liger_functional,
    out_of_time,
    progress,
    row,
    selected,
    settled_allocated,
    steady_idle,
    token_ids,
)
from benchmarks._switches import without_row_kernels
from benchmarks.bench_forward import ffn, heads
from benchmarks.bench_layer import HD, S, attention, layer_widths, split_heads
from coda import _quack
from coda.kernels import ce_scaled_exp
from coda.reference.rope import apply_rope_hf, hf_cos_sin

B = 4
M = B * S


def _hf_layer(x, p, cos, sin, H, Hkv, liger=None):
    """HF Llama layer (nn.Linear-style (out, in) weights), optionally with Liger's kernels;
    with gains ``g1o`` and ``g2o`` in ``p``, the attention's and the MLP's outputs normed
    before their residual adds (Gemma 2's and 3's form)."""

    def norm(h, g):
        if liger:
            return liger.liger_rms_norm(h, g, 1e-5, in_place=False)
        return F.rms_norm(h, (h.shape[-1],), g, 1e-5)

    y1 = norm(x, p["g1"])
    q, k, v = split_heads(y1 @ p["wqkv"].t(), H, Hkv)
    if liger:
        q, k = liger.liger_rope(q, k, cos[None], sin[None])
    else:
        q, k = apply_rope_hf(q, cos, sin), apply_rope_hf(k, cos, sin)
    o = attention(q, k, v) @ p["wo"].t()
    x1 = x + (norm(o, p["g1o"]) if "g1o" in p else o)
    y2 = norm(x1, p["g2"])
    g, u = y2 @ p["wg"].t(), y2 @ p["wu"].t()
    s = liger.liger_swiglu(g, u) if liger else F.silu(g) * u
    m = s @ p["wd"].t()
    return x1 + (norm(m, p["g2o"]) if "g2o" in p else m)


def _hf_params(layer) -> dict:
    """A coda layer's weights as ``_hf_layer`` takes them (HF's layouts), each a leaf that
    wants its gradient; with post-norms their gains too."""
    sd = layer.hf_state_dict()
    post = layer.post_norms
    names = {
        "g1": "input_layernorm",
        "g2": "pre_feedforward_layernorm" if post else "post_attention_layernorm",
        "wo": "self_attn.o_proj",
        "wg": "mlp.gate_proj",
        "wu": "mlp.up_proj",
        "wd": "mlp.down_proj",
    }
    if post:
        names.update(g1o="post_attention_layernorm", g2o="post_feedforward_layernorm")
    params = {k: sd[f"{n}.weight"] for k, n in names.items()}
    params["wqkv"] = torch.cat([sd[f"self_attn.{n}_proj.weight"] for n in "qkv"])
    return {k: v.clone().requires_grad_(True) for k, v in params.items()}


def _step(fn, params, x, dy):
    def run():
        for t in (*params, x):
            t.grad = None
        fn().backward(dy)

    return run


def _mem_kept_by_forward(fn) -> float:
    """GiB allocated by a forward and still held (saved for backward) when it returns."""
    before = settled_allocated()
    out = fn()
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated() - before
    del out
    return kept / 2**30


def layer_rows(liger) -> list[dict]:
    rows = []
    for d in layer_widths():
        f, (H, Hkv) = ffn(d), heads(d)
        layer = cnn.DecoderLayer(d, H, Hkv, f, device="cuda", backend="kernel")
        x = torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(B, S, d, device="cuda", dtype=torch.bfloat16)
        hf = _hf_params(layer)
        cos, sin = hf_cos_sin(torch.arange(S, device="cuda"), HD, dtype=torch.bfloat16)
        xm = x.detach().view(M, d)
        nqkv = (H + 2 * Hkv) * HD
        # floor: 12 GEMMs (forward, dgrad, wgrad of four linears) + attention fwd+bwd
        gemm_shapes = {"qkv": (d, nqkv), "o": (H * HD, d), "gate_up": (d, 2 * f), "down": (f, d)}
        parts = {}
        for name, (k_, n_) in gemm_shapes.items():
            a = torch.randn(M, k_, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(k_, n_, device="cuda", dtype=torch.bfloat16)
            g = torch.randn(M, n_, device="cuda", dtype=torch.bfloat16)
            parts[f"{name}_fwd"] = lambda a=a, w=w: a @ w
            parts[f"{name}_dgrad"] = lambda g=g, w=w: g @ w.t()
            parts[f"{name}_wgrad"] = lambda a=a, g=g: a.t() @ g
        qkv = torch.randn(M, nqkv, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.detach().requires_grad_() for t in split_heads(qkv, H, Hkv))
        do = torch.randn(M, H * HD, device="cuda", dtype=torch.bfloat16)

        def attn_fwd_bwd():
            for t in (q, k, v):
                t.grad = None
            attention(q, k, v).backward(do)

        parts["attention_fwd_bwd"] = attn_fwd_bwd
        compiled = torch.compile(_hf_layer)
        hf_params = list(hf.values())
        coda_step = _step(lambda: layer(x), list(layer.parameters()), x, dy)
        variants = {
            "coda": (coda_step, lambda: layer(x)),
            "coda_before_row_kernels": (without_row_kernels(coda_step), lambda: layer(x)),
            "torch_eager": (
                _step(
                    lambda: _hf_layer(xm.requires_grad_(), hf, cos, sin, H, Hkv).view(B, S, d),
                    hf_params,
                    x,
                    dy,
                ),
                lambda: _hf_layer(xm, hf, cos, sin, H, Hkv),
            ),
            "torch_compile": (
                _step(lambda: compiled(xm, hf, cos, sin, H, Hkv).view(B, S, d), hf_params, x, dy),
                lambda: compiled(xm, hf, cos, sin, H, Hkv),
            ),
        }
        if os.environ.get("CODA_LAYER_POST_NORMS") == "1":  # (Gemma 2's and 3's form)
            post = cnn.DecoderLayer(d, H, Hkv, f, device="cuda", backend="kernel", post_norms=True)
            hf_post = _hf_params(post)
            variants["coda_post_norms"] = (
                _step(lambda: post(x), list(post.parameters()), x, dy),
                lambda: post(x),
            )
            variants["torch_compile_post_norms"] = (
                _step(
                    lambda: compiled(xm, hf_post, cos, sin, H, Hkv).view(B, S, d),
                    list(hf_post.values()),
                    x,
                    dy,
                ),
                lambda: compiled(xm, hf_post, cos, sin, H, Hkv),
            )
        if liger is not None:
            variants["liger"] = (
                _step(
                    lambda: _hf_layer(xm, hf, cos, sin, H, Hkv, liger).view(B, S, d),
                    hf_params,
                    x,
                    dy,
                ),
                lambda: _hf_layer(xm, hf, cos, sin, H, Hkv, liger),
            )
        shape = {"M": M, "d": d, "ffn": f, "heads": H, "kv_heads": Hkv}
        xm.requires_grad_(True)
        timed = against_floor(
            "layer_train", shape, parts, {n: step for n, (step, _) in variants.items()}, rows
        )
        for name, t in timed.items():
            mem = _mem_kept_by_forward(variants[name][1])
            rows.append(
                row(
                    f"layer_train/{name}",
                    shape,
                    t,
                    0.0,
                    ratio_vs_floor=t["ratio_vs_floor"],
                    activation_gib=mem,
                )
            )
        rows.append(
            {
                "name": "layer_train/coda_kernels",
                **shape,
                **beside_floor(parts, variants["coda"][0]),
                # from an idle GPU (one call after a sync: its first kernels wait on the
                # host's launches) and back to back (as the timed steps and a training loop)
                **idle_report(variants["coda"][0]),
                **steady_idle(variants["coda"][0]),
            }
        )
        variants = None  # free this width's weights before the next
        torch.cuda.empty_cache()
    return rows


# (d, V) of issue 9's table, plus the largest Llama width; quack's chunk for its LCE peer
# (chunk == d is refused by its operand inference, "m == n makes row/col inference ambiguous").
LM_HEAD_SHAPES = ((2048, 32768, 4096), (4096, 128256, 2048), (8192, 128256, 2048))


def lm_head_shapes():
    """Every LM-head shape, or those named in ``CODA_LM_HEAD_SHAPES`` ("d2048", "d4096", ...)."""
    known = {f"d{s[0]}": s for s in LM_HEAD_SHAPES}
    chosen = selected("CODA_LM_HEAD_SHAPES", known)
    return [known[c] for c in chosen] if chosen else list(LM_HEAD_SHAPES)


IGNORE_EVERY = 7  # 1 in 7 targets is ignore_index, as in issue 9's protocol


def lm_head_targets() -> str:
    """How the LM head's targets are drawn: uniform (the default, every record before session
    29), or as ``CODA_LM_HEAD_TARGETS=zipf`` names (text-like: the exact target entries'
    scatter then sums long runs of one id)."""
    chosen = selected("CODA_LM_HEAD_TARGETS", TOKEN_DISTRIBUTIONS)
    if len(chosen) > 1:
        raise ValueError(f"CODA_LM_HEAD_TARGETS: one distribution, got {chosen}")
    return chosen[0] if chosen else "uniform"


# every LM-head variant, coda's first (its default program, then its other programs and
# weight layouts), then the peers
LM_HEAD_VARIANTS = (
    "coda", "coda_e2g", "coda_e512m", "coda_hf_layout", "coda_dv_weight", "coda_recompute",
    "coda_chunked",
    "torch_eager", "torch_compile", "quack_chunked_lce", "liger",
)  # fmt: skip


# run only when named in ``CODA_LM_HEAD_PEERS``: CE-S at 512 MiB chunks, measured and refused
# (run 338: 0.08 GiB less for 3.4 % more time; benchmarks/NOTES.md, session 84)
LM_HEAD_ON_REQUEST = ("coda_e512m",)


def lm_head_variants() -> list[str]:
    """Every LM-head variant but ``LM_HEAD_ON_REQUEST``'s, or "coda" and those named in
    ``CODA_LM_HEAD_PEERS``: at d=8192 every variant takes ~250 s, more than a short device
    call has (session 28)."""
    chosen = selected("CODA_LM_HEAD_PEERS", LM_HEAD_VARIANTS)
    if not chosen:
        return [n for n in LM_HEAD_VARIANTS if n not in LM_HEAD_ON_REQUEST]
    return [n for n in LM_HEAD_VARIANTS if n == "coda" or n in chosen]


# the variants that take a logit soft-cap (coda's CE-S program, "auto"'s, and its recompute
# program; the torch paths; Liger's ``softcap``): run alone under ``CODA_LM_HEAD_SOFTCAP``
SOFTCAP_VARIANTS = ("coda", "coda_recompute", "torch_eager", "torch_compile", "liger")


def lm_head_softcap() -> float | None:
    """Every LM-head variant's logit soft-cap c (``CODA_LM_HEAD_SOFTCAP``, e.g. 30: Gemma 2's
    c tanh(logits / c)), or None (the default: no cap)."""
    raw = os.environ.get("CODA_LM_HEAD_SOFTCAP", "").strip()
    return float(raw) if raw else None


def _graphed_ms(step):
    try:
        return bench(graphed(step))["ms"]
    except Exception as e:  # recorded beside the eager numbers, never hidden
        return repr(e)[:200]


def extra_gib(step, fn) -> float:
    """The LM head's extra memory as issue 9 defines it: the peak allocated during one
    forward+backward minus what was allocated before it, with every ``.grad`` (the input's,
    the weights') already allocated and accumulated into, as from a training run's second
    step on: the step's transient tensors (activations, chunks, accumulators and the new
    gradients before they are added). ``step`` (clearing the gradients first) allocates them;
    ``fn`` is the loss call. Before session 83 the figure (``extra_peak_gib``) was taken over a
    step that cleared the gradients and then less their size, so it read the gradients' size
    twice too low (Liger's -0.86 GiB at d = 4096, V = 128256: 1.35 by this reading, the
    issue's own figure)."""
    step()
    base = settled_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn().backward()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def lm_head_rows(liger) -> list[dict]:
    rows = []
    quack_lce = _quack.chunked_linear_cross_entropy()
    targets, cap = lm_head_targets(), lm_head_softcap()
    for d, V, quack_chunk in lm_head_shapes():
        first = len(rows)
        kw = dict(device="cuda", backend="kernel", softcap=cap)
        head = cnn.LMHeadLoss(d, V, **kw)  # "auto": CE-S here, with a soft-cap too
        head_c = cnn.LMHeadLoss(d, V, device="cuda", backend="kernel", method="chunked")
        head_r = cnn.LMHeadLoss(d, V, **kw, method="recompute")
        # one set of weights, three programs
        for other in (head_c, head_r):
            other.final_norm, other.weight = head.final_norm, head.weight
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = token_ids(targets, V, M)
        t[::IGNORE_EVERY] = -100
        w_lin = head.weight.detach().clone().requires_grad_(True)  # (V, d) peers
        # (d, V)-contiguous: the layout LMHeadLoss held its weight in before session 15
        w_dv = head.w_lm.detach().contiguous().requires_grad_(True)
        gf = head.final_norm.detach().clone().requires_grad_(True)

        def torch_loss(x=x, w_lin=w_lin, gf=gf, t=t):
            y = F.rms_norm(x, (d,), gf, 1e-5)
            logits = y @ w_lin.t()
            if cap is not None:  # (as HF's Gemma 2: in the logits' dtype)
                logits = torch.tanh(logits / cap) * cap
            return F.cross_entropy(logits.float(), t)

        compiled = torch.compile(torch_loss)
        variants = {
            "coda": (lambda: head(x, t), [head.final_norm, head.weight]),
            # CE-S storing 2 GiB of E per token chunk (fewer fp32 dW reduce-adds)
            "coda_e2g": (
                mock.patch.object(ce_scaled_exp, "E_CHUNK_BYTES", 2**31)(lambda: head(x, t)),
                [head.final_norm, head.weight],
            ),
            # 512 MiB of E per token chunk: half a chunk's memory for more dW reduce-adds
            "coda_e512m": (
                mock.patch.object(ce_scaled_exp, "E_CHUNK_BYTES", 2**29)(lambda: head(x, t)),
                [head.final_norm, head.weight],
            ),
            # the weight as HF holds it, lm_head.weight (V, d): what apply_coda passes (and,
            # since session 15, LMHeadLoss's own layout)
            "coda_hf_layout": (
                lambda x=x, gf=gf, w_lin=w_lin, t=t: cnn.lm_head_loss(
                    x, gf, w_lin.t(), t, backend="kernel"
                ),
                [gf, w_lin],
            ),
            # a (d, V)-contiguous weight: its gradient leaves CE-S through a transposing pass
            "coda_dv_weight": (
                lambda x=x, gf=gf, w_dv=w_dv, t=t: cnn.lm_head_loss(
                    x, gf, w_dv, t, backend="kernel"
                ),
                [gf, w_dv],
            ),
            "coda_recompute": (lambda: head_r(x, t), [head.final_norm, head.weight]),
            "coda_chunked": (lambda: head_c(x, t), [head.final_norm, head.weight]),
            "torch_eager": (torch_loss, [gf, w_lin]),
            "torch_compile": (compiled, [gf, w_lin]),
            "quack_chunked_lce": (
                lambda x=x, w_lin=w_lin, gf=gf, t=t, c=quack_chunk: quack_lce(
                    F.rms_norm(x, (d,), gf, 1e-5), w_lin, t, chunk_size=c
                ),
                [gf, w_lin],
            ),
        }
        if liger is not None:
            variants["liger"] = (
                lambda x=x, w_lin=w_lin, gf=gf, t=t: liger.liger_fused_linear_cross_entropy(
                    F.rms_norm(x, (d,), gf, 1e-5), w_lin, t, softcap=cap
                ),
                [gf, w_lin],
            )
        keep = lm_head_variants()
        if cap is not None:
            keep = [n for n in keep if n in SOFTCAP_VARIANTS]
        variants = {name: v for name, v in variants.items() if name in keep}
        a = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(d, V, device="cuda", dtype=torch.bfloat16)
        g = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
        floor_fns = {
            "fwd": lambda: a @ w,
            "dgrad": lambda: g @ w.t(),
            "wgrad": lambda: a.t() @ g,
        }
        shape = {"M": M, "d": d, "V": V, "targets": targets}
        if cap is not None:
            shape["softcap"] = cap

        def make_step(fn, params):
            def step():
                for p in (*params, x):
                    p.grad = None
                fn().backward()

            return step

        steps = {name: make_step(fn, params) for name, (fn, params) in variants.items()}
        # each variant once for its extra memory (and to surface an error), then every
        # variant and the floor's three GEMMs timed in interleaved rounds (``interleaved``)
        extra = {}
        for name, (fn, _) in variants.items():
            if out_of_time():
                rows.append({"name": f"lm_head_train/{name}", **shape, **SKIPPED})
                continue
            try:
                extra[name] = extra_gib(steps[name], fn)
            except Exception as e:
                rows.append({"name": f"lm_head_train/{name}", **shape, "error": repr(e)[:300]})

        timed = interleaved({**{f"floor_{k}": f for k, f in floor_fns.items()},
                             "floor_as_one_step": in_order(floor_fns),
                             **{n: steps[n] for n in extra}})  # fmt: skip
        floor = sum(timed[f"floor_{k}"]["ms"] for k in floor_fns)
        rows.append(
            {
                "name": "lm_head_train/floor",
                **shape,
                "ms": floor,
                **{f"{k}_ms": timed[f"floor_{k}"]["ms"] for k in floor_fns},
                "spread": max(timed[f"floor_{k}"]["spread"] for k in floor_fns),
            }
        )
        one = timed["floor_as_one_step"]
        one_row = row("lm_head_train/floor_as_one_step", shape, one, 0.0)
        rows.append({**one_row, "ratio_vs_floor": one["ms"] / floor})
        for name in extra:
            tm = timed[name]
            rows.append(
                row(
                    f"lm_head_train/{name}",
                    shape,
                    tm,
                    0.0,
                    ratio_vs_floor=tm["ms"] / floor,
                    extra_gib=extra[name],
                )
            )
        for name in ("coda", "coda_dv_weight", "coda_e2g", "coda_recompute"):
            if name in extra and not out_of_time():
                rows.append(
                    {
                        "name": f"lm_head_train/{name}_kernels",
                        **shape,
                        # the call's host time on an idle GPU, and its CUDA-graph replay: the
                        # GPU time alone, without the host's share of the call
                        "host_ms": host_ms(steps[name]),
                        "graphed_ms": _graphed_ms(steps[name]),
                        **steady_idle(steps[name]),
                        "kernels": kernel_table(steps[name]),
                        **idle_report(steps[name]),
                    }
                )
        variants = steps = g = None
        torch.cuda.empty_cache()
        for r in rows[first:]:  # a finished shape's rows are kept if the call is cut
            progress(r)
    return rows


class LayerOnly:
    """The layer half alone, as a suite entry (``gpu_suite``'s "layer_train")."""

    @staticmethod
    def run() -> list[dict]:
        return layer_rows(liger_functional())


class LMHeadOnly:
    """The LM-head half alone, as a suite entry (``gpu_suite``'s "lm_head_train")."""

    @staticmethod
    def run() -> list[dict]:
        return lm_head_rows(liger_functional())
