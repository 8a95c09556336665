"""The fuzz campaign's H200 half (``gpu``): the same random cases as ``test_fuzz.py`` in bf16
on the kernel path, each output's error against a float64 evaluation of the canonical math
no larger than the plain PyTorch bf16 path's (CODA's protocol, rules in ``_ratio``). The
worst ratio of each op and module goes to ``CODA_FUZZ_REPORT`` (the GPU suite records it)."""

from __future__ import annotations

import copy
import fcntl
import json
import math
import os
import random

import pytest
import torch
from conftest import LinearOperands, band_of, effective_samples, family_z, fro_err
from test_fuzz import (
    CASES,
    OPS,
    canonical_head,
    canonical_layer,
    head_case,
    hf_layer_grads,
    layer_case,
    randn,
)

# -- H200: CODA's error protocol on random shapes -----------------------------------------------
# coda and the PyTorch path both return fp32 losses and statistics: relative errors below ~8
# fp32 ulps (2^-20) are at the resolution of the outputs themselves and cannot be ranked (a
# scalar loss where both land within an ulp or two read 2.0 or inf as a bare ratio). Such
# errors count as 2^-20.
FP32_RESOLUTION = 2.0**-20


def _ratio(got, ref32, peer, scale=None, rows=None):
    """err(coda) / err(plain PyTorch bf16), both against the fp32 evaluation (CODA's
    protocol), each error floored at the fp32 reference's resolution. Two ill-posed cases get
    their own well-posed rule: a reference that is all NaN (an all-ignored mean) must be NaN;
    a reference that is identically zero (a q/k gradient when every sequence has one token)
    has only round-off on both sides, so coda's result must be zero to bf16 precision on the
    scale of its sibling tensors, ``scale`` (returned as |got| / (2^-8 scale)).

    A scalar loss over ``rows`` rows is the sum of per-row errors of random sign: the ratio of
    two such sums is a ratio of two random numbers (seen: a mean whose per-row errors were
    0.64x PyTorch's read 9.2x). For scalars each error is floored at 2^-9 / sqrt(rows) of
    the value, the size of one bf16 rounding per row averaged over the rows."""
    if torch.isnan(ref32).all():
        return 0.0 if torch.isnan(got).all() else float("inf")
    ref_norm = float(ref32.double().norm())
    if scale is not None and ref_norm <= FP32_RESOLUTION * scale:
        return float(got.double().norm()) / (2.0**-8 * scale)
    if ref_norm == 0:
        return 0.0 if got.abs().max() == 0 else float("inf")
    e_c, e_t = fro_err(got, ref32), fro_err(peer, ref32)
    floor = FP32_RESOLUTION
    if got.numel() == 1 and rows:
        floor = max(floor, 2.0**-9 / rows**0.5)
    return max(e_c, floor) / max(e_t, floor)


SYSTEMATIC_FLOOR = math.log(1.01)


class Report:
    """Worst normalized error per op, written to ``CODA_FUZZ_REPORT`` (JSON) when set.

    Two failure rules, both decided once every case is in:
    - a single check fails when its ratio exceeds 1 + ``tie_band`` at the family's z
      (``family_z`` of the number of checks: a 200-case fuzz of 13 outputs is 2600
      comparisons, and a per-check z of 2 would fail dozens of them by chance even for a path
      that exactly ties PyTorch);
    - an output fails as a whole when its ratios are systematically above 1: the mean of
      log(ratio) over the cases more than two standard errors, and more than 1 %, above 0 (a
      bias that no single case shows; the 1 % keeps a path whose rounding is PyTorch's own,
      ratios 1.0000x with a spread of 1e-5, from failing on an immaterial 1e-5).
    The report also counts every ratio over 1.0 (``over_1``) so ties stay visible."""

    def __init__(self, name):
        self.name, self.cases = name, 0
        self.checks = []  # (case, output key, label, ratio, n_eff)

    def add(self, case, label, ratio, ref, dof=None):
        self.checks.append((case, label.split(",")[0], label, ratio, effective_samples(ref, dof)))

    def write(self):
        z = family_z(len(self.checks))
        failures, ties, by_output = [], [], {}
        for case, key, label, ratio, n_eff in self.checks:
            band = band_of(n_eff, z)
            b = by_output.setdefault(
                key, {"worst": 0.0, "over_1": 0, "over_tie_band": 0, "logs": [], "big": 0.0}
            )
            b["worst"] = max(b["worst"], ratio)
            if n_eff >= 2**16:
                b["big"] = max(b["big"], ratio)
            if ratio > 0 and math.isfinite(ratio):
                b["logs"].append(math.log(ratio))
            if not ratio <= 1.0:
                b["over_1"] += 1
                ties.append((case, label, round(ratio, 4), round(band, 4)))
            if not ratio <= 1.0 + band:
                b["over_tie_band"] += 1
                failures.append((case, label, ratio))
        for key, b in by_output.items():
            logs = b.pop("logs")
            n = len(logs)
            mean = sum(logs) / max(n, 1)
            sd = (sum((x - mean) ** 2 for x in logs) / max(n - 1, 1)) ** 0.5
            b["geomean_ratio"] = math.exp(mean)
            b["systematic_bound"] = math.exp(max(2.0 * sd / max(n, 1) ** 0.5, SYSTEMATIC_FLOOR))
            if n >= 10 and mean > max(2.0 * sd / n**0.5, SYSTEMATIC_FLOOR):
                failures.append(("all cases", f"{key}: systematic", math.exp(mean)))
        worst = max(self.checks, key=lambda c: c[3], default=(None, None, None, 0.0, 0))
        entry = {
            "cases": self.cases,
            "checks": len(self.checks),
            "family_z": z,
            "worst_ratio": worst[3],
            "worst_case": worst[0],
            "worst_output": worst[2],
            "over_1": len(ties),
            "over_tie_band": len(failures),
            "over_1_cases": ties[:200],
            "by_output": {
                k: {**{n: v for n, v in b.items() if n != "big"}, "worst_at_least_65536": b["big"]}
                for k, b in by_output.items()
            },
        }
        path = os.environ.get("CODA_FUZZ_REPORT")
        if path:  # one file for every fuzz test, which may run side by side (pytest-xdist)
            with open(path + ".lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                data = json.load(open(path)) if os.path.exists(path) else {}
                data[self.name] = entry
                with open(path, "w") as f:
                    json.dump(data, f, indent=1)
        assert not failures, f"{self.name}: ratio > 1 + tie band in {failures[:5]}"


def _upcast(i):
    """The reference's inputs in float64: stricter than CODA's fp32 reference (on the GPU an
    fp32 SDPA may run TF32 math, as noisy as bf16; float64 attention is exact math)."""
    return {
        k: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
        for k, t in i.items()
    }


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_gpu_fuzz_op_protocol(op):
    rep = Report(op.name)
    for case in range(CASES):
        rng, g = random.Random(case), torch.Generator().manual_seed(case)
        i = op.inputs(rng, g, torch.bfloat16, "cuda", big=True)
        got = op.coda(i)
        ref32 = op.canonical(_upcast(i))
        peer = op.canonical(i)
        rows = int(i["x"].shape[0])
        for n, (a, b, c) in enumerate(zip(got, ref32, peer)):
            ratio = _ratio(a, b, c, rows=rows)
            rep.add(case, f"output {n}, x {tuple(i['x'].shape)}", ratio, b)
        rep.cases += 1
    rep.write()


def layer_dof(label, ref, B, S, H, operands=None):
    """The independent error sources of a layer output (``tie_band``'s ``dof``): None for the
    activations; for a weight gradient over T = B S tokens, T (rows + cols), or, when the
    reference run's ``operands`` (``LinearOperands``) saw its GEMM, their size-weighted count
    (``weight_grad_samples``); attention's q/k side (q_proj, k_proj, q_norm, k_norm) also at
    most the B H S (S + 1) / 2 entries of the causal score gradient."""
    if label in ("out", "dx"):
        return None
    dof = B * S * sum(ref.shape)
    weighted = operands.samples(ref) if operands is not None else None
    if weighted is not None:
        dof = min(dof, weighted)
    if any(k in label for k in ("q_proj", "k_proj", "q_norm", "k_norm")):
        dof = min(dof, B * H * S * (S + 1) // 2)
    return dof


@pytest.mark.gpu
def test_gpu_fuzz_decoder_layer_protocol():
    rep = Report("DecoderLayer")
    for case in range(CASES):
        rng, g = random.Random(10_000 + case), torch.Generator().manual_seed(case)
        layer, x = layer_case(rng, g, torch.bfloat16, "cuda", big=True)
        dy = randn(g, *x.shape, dtype=torch.bfloat16, device="cuda")
        x.requires_grad_(True)
        out = layer(x)
        out.backward(dy)
        got = (out.detach(), x.grad, *hf_layer_grads(layer).values())
        layer32 = copy.deepcopy(layer).double()  # the same weights, in float64
        with LinearOperands() as operands:  # each weight gradient's two GEMM operands
            o32, dx32, g32 = canonical_layer(layer32, x.detach().double(), dy.double())
        o16, dx16, g16 = canonical_layer(layer, x.detach(), dy)
        shape = tuple(x.shape)
        scale = max(float(t.double().norm()) for t in g32.values())
        B, S, _ = shape
        for label, a, b, c in zip(
            ["out", "dx", *g32], got, (o32, dx32, *g32.values()), (o16, dx16, *g16.values())
        ):
            ratio = _ratio(a, b, c, scale if label in g32 else None)
            rep.add(
                case,
                f"{label}, x {shape}, hd {layer.head_dim}",
                ratio,
                b,
                layer_dof(label, b, B, S, layer.n_heads, operands),
            )
        rep.cases += 1
    rep.write()


@pytest.mark.gpu
def test_gpu_fuzz_lm_head_loss_protocol():
    rep = Report("LMHeadLoss")
    for case in range(CASES):
        rng, g = random.Random(20_000 + case), torch.Generator().manual_seed(case)
        head, x, t, reduction = head_case(rng, g, torch.bfloat16, "cuda", big=True)
        x.requires_grad_(True)
        loss = head(x, t, reduction)
        dloss = randn(g, *loss.shape, dtype=torch.float32, device="cuda")
        # any upstream gradient: the three-GEMM programs apply it before their one rounding
        loss.backward(dloss)
        got = (loss.detach(), x.grad, head.final_norm.grad, head.weight.grad)
        head32 = copy.deepcopy(head).double()  # the same weights, in float64
        ref32 = canonical_head(head32, x.detach().double(), t, reduction, dloss.double())
        peer = canonical_head(head, x.detach(), t, reduction, dloss)
        label = f"{head.method}/{reduction}, x {tuple(x.shape)}, V {head.vocab}"
        rows = max(1, int((t != head.ignore_index).sum()))
        for name, a, b, c in zip(("loss", "dx", "dgamma", "dW"), got, ref32, peer):
            ratio = _ratio(a, b, c, rows=rows)
            rep.add(case, f"{name} {head.method}, {label}", ratio, b)
        rep.cases += 1
    rep.write()
