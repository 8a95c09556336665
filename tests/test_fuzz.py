"""Fuzz: every public op and nn module on random shapes against the canonical math.

Each case draws odd token counts (1 included, never a tile multiple on purpose), every allowed
K/N alignment (multiples of 8 elements: the TMA's 16-byte rows in bf16), GQA ratios, head_dim
64 and 128, ignore_index patterns (none, some, all, the first row), both target dtypes, and
eps values, SwiGLU and GeGLU. The canonical side is written here from torch's own functions
(``F.rms_norm``, ``F.silu``, ``F.gelu``, HF rotate_half RoPE, ``F.cross_entropy``) on Hugging
Face weight layouts, so it shares no code with the op under test beyond the exact layout
permutations.

- CPU (CI): float64 inputs; the public op (reference path) and the kernel's own epilogue
  program through the tile interpreter (random tile configs) must equal the canonical math to
  float64 round-off.
- CPU (CI), bf16: the nn modules' kernel sequences through the interpreter, which enforces
  the TMA's layout rules as the GPU does (float64 skips them), within bf16 distance of the
  float64 canonical math; the LM head with either weight layout.
- H200 (``gpu``): the same cases in bf16 on the kernel path, against a float64 reference,
  with CODA's protocol: ``test_fuzz_gpu.py``.

``CODA_FUZZ_CASES`` sets the number of cases per op (default 200), ``CODA_FUZZ_BF16_CASES``
the bf16 layout cases (default 200).
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

import coda
import coda.nn as cnn
from coda import layouts
from coda.kernels import gemm_residual_rms as grr
from coda.kernels import gemm_rmsnorm_gemm as rg
from coda.kernels import gemm_rope as rp
from coda.kernels import gemm_swiglu as sw
from coda.kernels import linear_cross_entropy as lce
from coda.kernels.config import GemmConfig
from coda.primitives.aux import ce_loss_from_stats, combine_lse
from coda.reference.rope import adjacent_to_hf_columns, apply_rope_hf, hf_cos_sin

CASES = int(os.environ.get("CODA_FUZZ_CASES", "200"))
F64 = torch.float64


def up(t):
    """The precision the canonical math computes in: float64 stays, anything else fp32."""
    return t if t.dtype == F64 else t.float()


# -- random draws ----------------------------------------------------------------------------------
def tokens(rng: random.Random, big: bool) -> int:
    hi = 5000 if big else 300
    return rng.choice(
        [1, 3, 129, rng.randrange(1, hi, 2), rng.randrange(1, hi), rng.randrange(1, hi)]
    )


def mult8(rng: random.Random, lo: int, hi: int) -> int:
    return 8 * rng.randint(max(1, lo // 8), hi // 8)


def config(rng: random.Random, pair: bool = False) -> GemmConfig:
    tile_n = rng.choice([32, 64, 128, 192] if pair else [16, 48, 64, 128, 192])
    return GemmConfig(tile_m=rng.choice([64, 128]), tile_n=tile_n)


def row_scales(g, M, dtype, device):
    """A deferred row scale (rstd-like, in [0.5, ~3]) in the dtype statistics take for
    ``dtype`` inputs: float64 for float64, else fp32."""
    stat = F64 if dtype == F64 else torch.float32
    return (randn(g, M, dtype=torch.float32, device=device).abs() + 0.5).to(stat)


def randn(g, *shape, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(device, dtype)


# -- the ops: inputs, coda's call, the canonical math, the interpreted kernel ----------------
class Op:
    name = ""
    pair = False
    interp_tol = 1e-10  # float64 round-off, accumulated over K <= 2048

    def canonical(self, i):
        raise NotImplementedError

    def interpreted(self, i, cfg):
        raise NotImplementedError


class ResidualRMS(Op):
    name = "gemm_residual_rms"

    def inputs(self, rng, g, dtype, device, big):
        M, K, N = (
            tokens(rng, big),
            mult8(rng, 8, 2048 if big else 256),
            mult8(rng, 8, 2048 if big else 512),
        )
        return {
            "x": randn(g, M, K, dtype=dtype, device=device),
            "w": randn(g, K, N, dtype=dtype, device=device, scale=K**-0.5),
            "residual": randn(g, M, N, dtype=dtype, device=device),
            "gamma": randn(g, N, dtype=dtype, device=device, scale=0.1) + 1,
            "eps": rng.choice([1e-5, 1e-6, 1e-2]),
        }

    def coda(self, i):
        out = coda.gemm_residual_rms(i["x"], i["w"], i["residual"], i["gamma"], eps=i["eps"])
        return out.h, out.rstd[:, None] * out.normed.to(out.rstd.dtype)

    def canonical(self, i):
        h = i["residual"] + i["x"] @ i["w"]
        return h, F.rms_norm(up(h), (h.shape[1],), up(i["gamma"]), i["eps"])

    def interpreted(self, i, cfg):
        h, a, r, _ = grr.gemm_residual_rms_interpreted(
            i["x"], i["w"], i["residual"], i["gamma"], i["eps"], cfg
        )
        return h, r[:, None] * a


class RMSNormGemm(Op):
    name = "gemm_rmsnorm_gemm"

    def inputs(self, rng, g, dtype, device, big):
        i = ResidualRMS().inputs(rng, g, dtype, device, big)
        N, N2 = i["w"].shape[1], mult8(rng, 8, 2048 if big else 256)
        i["w2"] = randn(g, N, N2, dtype=dtype, device=device, scale=N**-0.5)
        return i

    def coda(self, i):
        out = coda.gemm_rmsnorm_gemm(
            i["x"], i["w"], i["residual"], i["gamma"], i["w2"], eps=i["eps"]
        )
        return out.h, out.z, out.rstd

    def canonical(self, i):
        h = i["residual"] + i["x"] @ i["w"]
        y = F.rms_norm(h, (h.shape[1],), i["gamma"], i["eps"])
        rstd = torch.rsqrt(up(h).pow(2).mean(-1) + i["eps"])
        return h, y @ i["w2"], rstd

    def interpreted(self, i, cfg):
        return rg.gemm_rmsnorm_gemm_interpreted(
            i["x"], i["w"], i["residual"], i["gamma"], i["w2"], i["eps"], cfg, cfg
        )


class SwiGLU(Op):
    name = "gemm_swiglu"
    pair = True

    def inputs(self, rng, g, dtype, device, big):
        M, K, f = (
            tokens(rng, big),
            mult8(rng, 8, 2048 if big else 256),
            mult8(rng, 8, 4096 if big else 256),
        )
        return {
            "x": randn(g, M, K, dtype=dtype, device=device),
            "wg": randn(g, K, f, dtype=dtype, device=device, scale=K**-0.5),
            "wu": randn(g, K, f, dtype=dtype, device=device, scale=K**-0.5),
            "rstd": row_scales(g, M, dtype, device),
            "activation": rng.choice(["silu", "gelu_tanh"]),  # SwiGLU, or GeGLU (Gemma's)
        }

    def w_il(self, i):
        return layouts.gate_up_weight_from_hf(i["wg"].t(), i["wu"].t())

    def coda(self, i):
        rstd = i["rstd"]
        return (coda.gemm_swiglu(i["x"], self.w_il(i), rstd, activation=i["activation"]).s,)

    def canonical(self, i):
        y = (up(i["x"]) * i["rstd"][:, None]).to(i["x"].dtype)
        gate = y @ i["wg"]
        act = F.silu(gate) if i["activation"] == "silu" else F.gelu(gate, approximate="tanh")
        return (act * (y @ i["wu"]),)

    def interpreted(self, i, cfg):
        x, w_il, act = i["x"], self.w_il(i), i["activation"]
        return (sw.gemm_swiglu_interpreted(x, w_il, i["rstd"], cfg, activation=act)[0],)


class Rope(Op):
    name = "gemm_rope"
    pair = True
    # the kernel's frequency table is a float-float pair of fp32 (~48 bits): at positions up to
    # 2^17 the angle carries ~2^17 * 2pi * 2^-49 ~ 1.5e-9 rad of representation error
    interp_tol = 1e-8

    def inputs(self, rng, g, dtype, device, big):
        hd = rng.choice([64, 128])
        Hkv = rng.choice([1, 2] if not big else [1, 2, 4, 8])
        H = Hkv * rng.choice([1, 2, 4])
        M, K = tokens(rng, big), mult8(rng, 8, 2048 if big else 256)
        s = K**-0.5
        return {
            "x": randn(g, M, K, dtype=dtype, device=device),
            "wq": randn(g, H * hd, K, dtype=dtype, device=device, scale=s),
            "wk": randn(g, Hkv * hd, K, dtype=dtype, device=device, scale=s),
            "wv": randn(g, Hkv * hd, K, dtype=dtype, device=device, scale=s),
            "rstd": row_scales(g, M, dtype, device),
            "pos": torch.randint(0, rng.choice([16, 4096, 131072]), (M,), generator=g).to(device),
            "H": H,
            "Hkv": Hkv,
            "hd": hd,
            "base": rng.choice([10000.0, 500000.0]),
        }

    def w_qkv(self, i):
        return layouts.qkv_weight_from_hf(
            i["wq"], i["wk"], i["wv"], n_heads=i["H"], n_kv_heads=i["Hkv"]
        )

    def to_hf(self, qkv, i):
        nq, nkv = i["H"] * i["hd"], i["Hkv"] * i["hd"]
        q = adjacent_to_hf_columns(qkv[:, :nq], i["H"], i["hd"])
        k = adjacent_to_hf_columns(qkv[:, nq : nq + nkv], i["Hkv"], i["hd"])
        return q, k, qkv[:, nq + nkv :]

    def coda(self, i):
        rstd = i["rstd"]
        qkv = coda.gemm_rope(
            i["x"],
            self.w_qkv(i),
            i["pos"],
            head_dim=i["hd"],
            n_heads=i["H"],
            n_kv_heads=i["Hkv"],
            rstd=rstd,
            rope_base=i["base"],
        )
        return self.to_hf(qkv, i)

    def canonical(self, i):
        M, hd = i["x"].shape[0], i["hd"]
        y = (up(i["x"]) * i["rstd"][:, None]).to(i["x"].dtype)
        if i["x"].dtype == F64:
            ang = i["pos"].double()[:, None] * i["base"] ** (
                -torch.arange(0, hd, 2, dtype=F64, device=y.device) / hd
            )
            cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        else:
            cos, sin = hf_cos_sin(i["pos"], hd, i["base"], i["x"].dtype)
        q = apply_rope_hf((y @ i["wq"].t()).view(M, -1, hd), cos[:, None], sin[:, None])
        k = apply_rope_hf((y @ i["wk"].t()).view(M, -1, hd), cos[:, None], sin[:, None])
        return q.flatten(1), k.flatten(1), y @ i["wv"].t()

    def interpreted(self, i, cfg):
        freq = rp.rope_freq_table(i["hd"], i["H"] + i["Hkv"], i["Hkv"], i["base"])
        qkv = rp.gemm_rope_interpreted(
            i["x"], self.w_qkv(i), i["rstd"], i["pos"].double(), freq.double(), cfg
        )
        return self.to_hf(qkv, i)


class CrossEntropy(Op):
    name = "linear_cross_entropy"

    def inputs(self, rng, g, dtype, device, big):
        M, d = tokens(rng, big), mult8(rng, 8, 2048 if big else 128)
        V = mult8(rng, 8, 65536 if big else 1000)
        ignore_index = rng.choice([-100, -1, V + 3])
        target = torch.randint(0, V, (M,), generator=g)
        pattern = rng.choice(["none", "some", "all", "first"])
        if pattern == "some":
            target[torch.rand(M, generator=g) < 1 / 7] = ignore_index
        elif pattern == "all":
            target[:] = ignore_index
        elif pattern == "first":
            target[0] = ignore_index
        return {
            "x": randn(g, M, d, dtype=dtype, device=device),
            "w": randn(g, d, V, dtype=dtype, device=device, scale=d**-0.5),
            "rstd": row_scales(g, M, dtype, device),
            "target": target.to(device, rng.choice([torch.int32, torch.int64])),
            "ignore_index": ignore_index,
            "reduction": rng.choice(["mean", "sum", "none"]),
        }

    def coda(self, i):
        rstd = i["rstd"]
        return (
            coda.linear_cross_entropy(
                i["x"],
                i["w"],
                i["target"],
                rstd=rstd,
                ignore_index=i["ignore_index"],
                reduction=i["reduction"],
            ),
        )

    def canonical(self, i):
        y = (up(i["x"]) * i["rstd"][:, None]).to(i["x"].dtype)
        logits = up(y @ i["w"])
        loss = F.cross_entropy(
            logits, i["target"].long(), ignore_index=i["ignore_index"], reduction=i["reduction"]
        )
        return (loss,)

    def interpreted(self, i, cfg):
        parts, tl = lce.lm_head_stats_interpreted(i["x"], i["w"], i["rstd"], i["target"], cfg)
        return (
            ce_loss_from_stats(
                combine_lse(parts), tl, i["target"], i["ignore_index"], i["reduction"]
            ),
        )


OPS = [ResidualRMS(), RMSNormGemm(), SwiGLU(), Rope(), CrossEntropy()]


def _compare_f64(got, want, what, tol=1e-10):
    for n, (a, b) in enumerate(zip(got, want)):
        if b.numel() and torch.isnan(b).all():
            assert torch.isnan(a).all(), f"{what} output {n}: expected NaN (as PyTorch)"
            continue
        # a loss can be exactly 0 (every row ignored, reduction "sum"): compare on scale 1
        assert rel_err(a, b, floor=1.0 if b.abs().max() == 0 else 0.0) < tol, f"{what} output {n}"


@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_fuzz_op_float64(op):
    for case in range(CASES):
        rng, g = random.Random(case), torch.Generator().manual_seed(case)
        i = op.inputs(rng, g, F64, "cpu", big=False)
        want = op.canonical(i)
        _compare_f64(op.coda(i), want, f"{op.name} case {case} (public op)")
        cfg = config(rng, op.pair)
        _compare_f64(op.interpreted(i, cfg), want, f"{op.name} case {case} ({cfg})", op.interp_tol)


# -- nn modules ----------------------------------------------------------------------------------
def layer_case(rng, g, dtype, device, big):
    hd = rng.choice([64, 128])
    Hkv = rng.choice([1, 2, 4] if big else [1, 2])
    H = Hkv * rng.choice([1, 2, 4])
    d = mult8(rng, 8, 1024 if big else 96)
    ffn = mult8(rng, 8, 2048 if big else 96)
    B = rng.choice([1, 2, 3])
    S = rng.choice([1, 2, 5, 17, rng.randrange(1, 700 if big else 24)])
    eps = rng.choice([1e-5, 1e-6, 1e-2])
    qk_norm = rng.random() < 0.25  # Qwen3's per-head QK-norm in a quarter of the cases
    torch.manual_seed(rng.randrange(2**31))
    layer = cnn.DecoderLayer(
        d, H, Hkv, ffn, head_dim=hd, eps=eps, device=device, dtype=dtype, qk_norm=qk_norm
    )
    # weights of std 1/sqrt(fan-in), so the layer's update is as large as its residual input:
    # with a small init the result is the residual plus a perturbation, and every path's error
    # is the same final rounding of the residual stream (the protocol then compares nothing)
    with torch.no_grad():
        for w in (layer.w_qkv, layer.w_o, layer.w_il, layer.w_d):
            w.normal_(std=w.shape[0] ** -0.5)
        for gamma in (layer.attention_norm, layer.ffn_norm, layer.q_norm, layer.k_norm):
            if gamma is not None:
                gamma.add_(0.1 * torch.randn_like(gamma))
    x = randn(g, B, S, d, dtype=dtype, device=device)
    return layer, x


def hf_layer_grads(layer) -> dict:
    """coda-layout parameter gradients -> HF ``LlamaDecoderLayer`` (``Qwen3DecoderLayer`` with
    QK-norm) layout (exact)."""
    q, k, v = layouts.qkv_weight_to_hf(
        layer.w_qkv.grad,
        n_heads=layer.n_heads,
        n_kv_heads=layer.n_kv_heads,
        head_dim=layer.head_dim,
    )
    gate, upg = layouts.gate_up_weight_to_hf(layer.w_il.grad)
    return {
        "input_layernorm.weight": layer.attention_norm.grad,
        "self_attn.q_proj.weight": q,
        "self_attn.k_proj.weight": k,
        "self_attn.v_proj.weight": v,
        "self_attn.o_proj.weight": layer.w_o.grad.t(),
        "post_attention_layernorm.weight": layer.ffn_norm.grad,
        "mlp.gate_proj.weight": gate,
        "mlp.up_proj.weight": upg,
        "mlp.down_proj.weight": layer.w_d.grad.t(),
        **(
            {
                "self_attn.q_norm.weight": layouts.head_weight_to_hf(layer.q_norm.grad),
                "self_attn.k_norm.weight": layouts.head_weight_to_hf(layer.k_norm.grad),
            }
            if layer.qk_norm
            else {}
        ),
    }


def canonical_layer(layer, x, dy):
    """HF's Llama layer (``TorchLlama.layer``) on the layer's HF weights: (out, dx, grads)."""
    from coda.reference.model import LAYER_KEYS, QK_NORM_KEYS, hf_layer_step

    out, dx, p = hf_layer_step(layer, x, dy)
    keys = LAYER_KEYS + (QK_NORM_KEYS if layer.qk_norm else ())
    return out, dx, {k: p[k.replace(".", "_")].grad for k in keys}


def test_fuzz_decoder_layer_float64():
    for case in range(CASES):
        rng, g = random.Random(10_000 + case), torch.Generator().manual_seed(case)
        layer, x = layer_case(rng, g, F64, "cpu", big=False)
        x.requires_grad_(True)
        dy = randn(g, *x.shape, dtype=F64, device="cpu")
        out = layer(x)
        out.backward(dy)
        want, dx, grads = canonical_layer(layer, x, dy)
        what = f"DecoderLayer case {case}"
        assert rel_err(out, want) < 1e-10, what
        floor = max(float(t.abs().max()) for t in (dx, *grads.values()))
        assert rel_err(x.grad, dx, floor=floor) < 1e-10, what
        for k, t in hf_layer_grads(layer).items():
            assert rel_err(t, grads[k], floor=floor) < 1e-10, f"{what}: {k}"


def head_case(rng, g, dtype, device, big):
    d = mult8(rng, 8, 2048 if big else 96)
    V = mult8(rng, 8, 65536 if big else 600)
    M = tokens(rng, big)
    ignore_index = rng.choice([-100, -1])
    t = torch.randint(0, V, (M,), generator=g)
    pattern = rng.choice(["none", "some", "all", "first"])
    if pattern == "some":
        t[torch.rand(M, generator=g) < 1 / 7] = ignore_index
    elif pattern == "all":
        t[:] = ignore_index
    elif pattern == "first":
        t[0] = ignore_index
    torch.manual_seed(rng.randrange(2**31))
    method = rng.choice(["recompute", "chunked", "scaled_exp"])
    if method == "scaled_exp":  # its vocabulary is a multiple of 128 (the targets stay valid)
        V = -(-V // 128) * 128
    head = cnn.LMHeadLoss(
        d,
        V,
        eps=rng.choice([1e-5, 1e-6]),
        ignore_index=ignore_index,
        method=method,
        device=device,
        dtype=dtype,
    )
    with torch.no_grad():
        head.final_norm.add_(0.1 * torch.randn_like(head.final_norm))
    reduction = rng.choice(["mean", "sum", "none"])
    x = randn(g, M, d, dtype=dtype, device=device)
    return head, x, t.to(device, rng.choice([torch.int32, torch.int64])), reduction


def canonical_head(head, x, t, reduction, dloss):
    xr = x.detach().clone().requires_grad_(True)
    gf = head.final_norm.detach().clone().requires_grad_(True)
    w = head.w_lm.detach().t().clone().requires_grad_(True)  # HF lm_head.weight (V, d)
    y = F.rms_norm(xr, (x.shape[1],), gf, head.eps)
    logits = F.linear(y, w)
    loss = F.cross_entropy(
        up(logits), t.long(), ignore_index=head.ignore_index, reduction=reduction
    )
    loss.backward(dloss)
    return loss.detach(), xr.grad, gf.grad, w.grad


def test_fuzz_lm_head_loss_float64():
    for case in range(CASES):
        rng, g = random.Random(20_000 + case), torch.Generator().manual_seed(case)
        head, x, t, reduction = head_case(rng, g, F64, "cpu", big=False)
        x.requires_grad_(True)
        loss = head(x, t, reduction)
        dloss = randn(g, *loss.shape, dtype=F64, device="cpu")
        want, dx, dgf, dw = canonical_head(head, x, t, reduction, dloss)
        what = f"LMHeadLoss case {case} ({reduction})"
        if torch.isnan(want).all():
            assert torch.isnan(loss).all(), what
        else:
            assert rel_err(loss, want, floor=1.0 if want.abs().max() == 0 else 0.0) < 1e-10
        loss.backward(dloss)
        floor = max(float(u.abs().max()) for u in (dx, dgf, dw)) or 1.0
        assert rel_err(x.grad, dx, floor=floor) < 1e-10, what
        assert rel_err(head.final_norm.grad, dgf, floor=floor) < 1e-10, what
        assert rel_err(head.weight.grad, dw, floor=floor) < 1e-10, what


# -- the kernel path in bf16 through the interpreter: TMA layout rules on random shapes ----------
BF16_CASES = int(os.environ.get("CODA_FUZZ_BF16_CASES", "200"))


def _near(got, ref64, what, floor=0.0, tol=0.1):
    """Within bf16 distance of the float64 canonical value, on the scale of the tensor or of
    its sibling gradients (``floor``: a q/k gradient at one token is identically zero): a wrong
    layout or a dropped term is O(1) off; bf16 rounding is ~1e-2 at these sizes."""
    if ref64.numel() and torch.isnan(ref64).all():
        assert torch.isnan(got).all(), what
        return
    assert torch.isfinite(got).all(), what
    assert rel_err(got, ref64, floor=max(float(ref64.abs().max()), floor) or 1.0) < tol, what


def test_fuzz_kernel_path_bf16_layouts():
    """The nn modules' kernel sequences in bf16 on random shapes (the interpreter enforces the
    TMA's 16-byte rows and unit strides on every GEMM operand, as the GPU does; float64 skips
    those rules): the LM head with a (d, V)-contiguous weight or a (V, d) weight's view (HF's,
    and ``LMHeadLoss``'s own), every method, and the DecoderLayer; each within bf16 distance
    of the float64 canonical math."""
    from coda.nn.head import _kernel_lm_head_loss

    for case in range(BF16_CASES):
        rng, g = random.Random(30_000 + case), torch.Generator().manual_seed(case)
        head, x, t, reduction = head_case(rng, g, torch.bfloat16, "cpu", big=False)
        hf = rng.random() < 0.5
        w = (head.weight if hf else head.w_lm).detach().contiguous().requires_grad_(True)
        x.requires_grad_(True)
        args = (head.eps, head.ignore_index, reduction, head.chunk, head.method, 0.0, 0.0)
        loss = _kernel_lm_head_loss(x, head.final_norm, w.t() if hf else w, t, *args)
        dloss = randn(g, *loss.shape, dtype=torch.float32, device="cpu")
        loss.backward(dloss)
        head64 = copy.deepcopy(head).double()
        want = canonical_head(head64, x.detach().double(), t, reduction, dloss.double())
        dw = w.grad if hf else w.grad.t()
        what = f"LMHeadLoss {head.method} {'(V, d)' if hf else '(d, V)'} weight case {case}"
        floor = max(float(u.nan_to_num().abs().max()) for u in want[1:])
        got = (loss.detach(), x.grad, head.final_norm.grad, dw)
        for name, a, b in zip(("loss", "dx", "dgamma", "dW"), got, want):
            _near(a, b, f"{what}: {name}", floor if name != "loss" else 0.0)

        rng, g = random.Random(40_000 + case), torch.Generator().manual_seed(case)
        layer, x = layer_case(rng, g, torch.bfloat16, "cpu", big=False)
        x.requires_grad_(True)
        dy = randn(g, *x.shape, dtype=torch.bfloat16, device="cpu")
        out = layer._kernel_forward(x)
        out.backward(dy)
        out64, dx64, g64 = canonical_layer(
            copy.deepcopy(layer).double(), x.detach().double(), dy.double()
        )
        what = f"DecoderLayer case {case} x {tuple(x.shape)}"
        floor = max(float(u.abs().max()) for u in (dx64, *g64.values()))
        _near(out.detach(), out64, f"{what}: out")
        _near(x.grad, dx64, f"{what}: dx", floor)
        for k, t_ in hf_layer_grads(layer).items():
            _near(t_, g64[k], f"{what}: {k}", floor)


@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_fuzz_op_kernel_path_bf16(op, monkeypatch):
    """The public op's kernel path (its validation, layouts and launches) in bf16, forced on
    the CPU (``kernel_support`` answers yes: GEMMs through the interpreter, TMA rules
    enforced), on the float64 fuzz's shapes: within bf16 distance of the canonical math."""
    import coda.env

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    for case in range(BF16_CASES):
        rng, g = random.Random(case), torch.Generator().manual_seed(case)
        i = op.inputs(rng, g, torch.bfloat16, "cpu", big=False)
        got = op.coda(i)
        assert coda.last_path(op.name)[0] == "kernel"
        f64 = {
            k: t.double() if torch.is_tensor(t) and t.is_floating_point() else t
            for k, t in i.items()
        }
        for n, (a, b) in enumerate(zip(got, op.canonical(f64))):
            _near(a.double(), b, f"{op.name} case {case} output {n}")
