"""``apply_coda(model, layers=False)`` on tiny random Hugging Face Gemma, Gemma 2 and Gemma 3
(text) models (their layers patched too: tests/test_transformers_families.py): their decoder
layers and scaled token embedding stay HF's, and the training
call's loss is coda's LM-head loss with Gemma's final norm, whose gain 1 + w is formed in fp32
and applied before the output's one rounding (``coda._hf_forward.final_norm``,
``coda.reference.final_norm_ref``). CPU: float64, coda's loss on its reference path and on its
kernel path through the tile interpreter, the loss and every gradient equal the unpatched
model's; bf16 (the final norm, head and loss alone, on the same bf16 rows), the kernel path's
every output no further from float64 than HF's bf16 path's, and its gradients closer than the
same call's with the gain rounded to bf16. What the whole patch lacks, and Gemma 2's logit
soft-capping, are named."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import fro_err, rel_err, tie_band  # noqa: E402
from hf_tiny import padded_batch  # noqa: E402
from test_transformers import assert_same_step, model_class, tiny_config  # noqa: E402

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402

FAMILIES = ["gemma", "gemma2", "gemma3"]


def gemma_model(family: str, dtype=torch.float64, w_std: float = 0.5, **kw):
    """A tiny ``family`` causal LM in ``dtype``, seeded, every norm's weight w drawn with
    standard deviation ``w_std`` (HF makes them 0: a gain 1 + w of 1 would hide a lost w)."""
    cfg = tiny_config(family, **kw)
    torch.manual_seed(0)
    model = model_class(cfg)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, w_std)
    return model.to(dtype)


def _kernel_path(monkeypatch) -> None:
    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_alone_equals_unpatched_float64(family, kernel, monkeypatch):
    if kernel:  # (coda's loss on its kernel path; the layers are HF's either way)
        _kernel_path(monkeypatch)
    coda.env._LAST.clear()
    ref = gemma_model(family, **({"vocab_size": 128} if kernel else {}))
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    # (right padding: left-padded rows attend to nothing, NaN in HF's float64 eager attention,
    # Gemma 2's)
    batch = padded_batch(ref.config.vocab_size, right=True)
    ids, labels = batch["input_ids"], batch["labels"]
    assert_same_step(ref, patched, **batch)
    assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")
    assert patched(input_ids=ids, labels=labels).logits is None  # (a training call: no logits)
    n = torch.tensor(17.0, dtype=torch.float64)
    assert_same_step(ref, patched, input_ids=ids, labels=ids, num_items_in_batch=n)
    with torch.no_grad():  # (evaluation and generation: HF's own logits, as before)
        assert torch.equal(patched(input_ids=ids).logits, ref(input_ids=ids).logits)
    # the scaled token embedding stays HF's class (coda's would drop its sqrt(d) scale)
    assert type(patched.model.embed_tokens) is type(ref.model.embed_tokens)


def gemma_head(seed: int, M: int, d: int, V: int, device: str = "cpu", w_std: float = 0.02):
    """bf16 final-norm inputs x (M, d), the norm's w (d,) (small, as a trained model's can be:
    1 + w rounded to bf16 would lose most of it, 2^-8 near 1), the LM head's weight (V, d)
    and targets (one in 7 ignored), seeded."""
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(M, d, generator=g)).bfloat16()
    w = (w_std * torch.randn(d, generator=g)).bfloat16()
    W = (d**-0.5 * torch.randn(V, d, generator=g)).bfloat16()
    t = torch.randint(0, V, (M,), generator=g)
    t[torch.rand(M, generator=g) < 1 / 7] = -100
    return [a.to(device) for a in (x, w, W, t)]


def gemma_head_errors(x, w, W, t, method: str) -> dict:
    """Each output's error (loss, dX, dw, dW; ``fro_err``, the scalar loss's at least its floor
    2^-9 / sqrt(rows)) against the float64 Gemma final norm +
    head + cross-entropy on the same bf16 inputs, for HF's bf16 path (``GemmaRMSNorm``, the
    head, ``F.cross_entropy`` of the upcast logits, as HF's loss), for coda's kernel path given
    the gain 1 + w in fp32 (as ``apply_coda`` gives it), and for the same call given the gain
    rounded to bf16."""
    import torch.nn.functional as F
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    from coda.nn import lm_head_loss

    def run(dtype, loss_of):
        xs, ws, Ws = (a.detach().to(dtype).requires_grad_() for a in (x, w, W))
        loss = loss_of(xs, ws, Ws)
        loss.backward()
        return [loss.detach(), xs.grad, ws.grad, Ws.grad]

    def hf(xs, ws, Ws):
        norm = GemmaRMSNorm(xs.shape[1], eps=1e-6)
        normed = torch.func.functional_call(norm, {"weight": ws}, (xs,))  # (HF's forward, w ours)
        return F.cross_entropy((normed @ Ws.t()).float(), t)

    def coda_gain(rounded):
        def loss_of(xs, ws, Ws):
            gain = 1.0 + ws.float()
            gain = gain.bfloat16() if rounded else gain
            return lm_head_loss(xs, gain, Ws.t(), t, eps=1e-6, method=method, backend="kernel")

        return loss_of

    want = run(torch.float64, hf)
    floor = 2.0**-9 / int((t != -100).sum()) ** 0.5
    runs = {"hf": hf, "coda": coda_gain(False), "coda, bf16 gain": coda_gain(True)}
    names = ("loss", "dx", "dw", "dW")
    errs = {}
    for key, f in runs.items():
        got = dict(zip(names, (fro_err(a, b) for a, b in zip(run(torch.bfloat16, f), want))))
        errs[key] = {**got, "loss": max(got["loss"], floor)}
    errs["want"] = dict(zip(names, want))
    return errs


@pytest.mark.parametrize("method", ["scaled_exp", "recompute", "chunked"])
def test_an_fp32_gain_keeps_the_norms_accuracy(method, monkeypatch):
    """CPU, bf16, coda's loss on its kernel path (the interpreter): every output's error no
    worse than HF's bf16 path's (CODA's protocol; dX 0.50-0.87x HF's, seeds 0-4), and every
    gradient's below the same call's with the gain rounded to bf16 (0.61-0.87x of it, seeds
    0-4, every method): what keeping the fp32 gain buys, and what catches a gain rounded
    inside the call (the two calls would then agree exactly)."""
    _kernel_path(monkeypatch)
    for seed in range(2):
        errs = gemma_head_errors(*gemma_head(seed, 512, 64, 256), method)
        for name, e in errs["coda"].items():
            assert e <= errs["hf"][name] * (1.0 + tie_band(errs["want"][name])), (name, errs)
        for name in ("dx", "dw", "dW"):
            assert errs["coda"][name] < 0.95 * errs["coda, bf16 gain"][name], (name, errs)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["scaled_exp", "recompute", "chunked"])
def test_gpu_an_fp32_gain_keeps_the_norms_accuracy(method):
    """H200: Gemma's final norm (gain 1 + w in fp32, Gemma 3 1B's width and a 32768-token
    vocabulary) through coda's kernels: CODA's protocol against HF's bf16 path (ties within
    ``tie_band``), and every gradient's error below the same call's with the gain rounded to
    bf16."""
    for seed in range(2):
        errs = gemma_head_errors(*gemma_head(seed, 4096, 1152, 32768, "cuda"), method)
        for name, e in errs["coda"].items():
            assert e <= errs["hf"][name] * (1.0 + tie_band(errs["want"][name])), (name, errs)
        for name in ("dx", "dw", "dW"):
            assert errs["coda"][name] < 0.95 * errs["coda, bf16 gain"][name], (name, errs)


def test_an_fp32_gain_with_bf16_rows_is_refused_by_neither_path(monkeypatch):
    """``lm_head_loss`` with bf16 rows and an fp32 gain (the reference path multiplied them into
    an fp32 product before the bf16 GEMM and failed deep in torch, before): both paths apply
    the gain in fp32 and round once; its gradient returns in fp32. Another dtype is named."""
    from coda.nn import lm_head_loss
    from coda.reference import cross_entropy_ref, final_norm_ref

    torch.manual_seed(3)
    x = torch.randn(21, 32, dtype=torch.bfloat16)
    w = (0.2 * torch.randn(32, 64)).bfloat16()
    gain = (1 + 0.01 * torch.randn(32)).requires_grad_()
    t = torch.randint(0, 64, (21,))
    want = cross_entropy_ref(final_norm_ref(x, gain, 1e-6) @ w, t, -100, "mean")
    got = lm_head_loss(x, gain, w, t, eps=1e-6, backend="reference")
    assert torch.equal(got, want)
    _kernel_path(monkeypatch)
    (grad,) = torch.autograd.grad(lm_head_loss(x, gain, w, t, eps=1e-6, backend="kernel"), gain)
    (want_grad,) = torch.autograd.grad(want, gain)
    assert grad.dtype == torch.float32 and rel_err(grad, want_grad) < 2e-2
    with pytest.raises(coda.CodaInputError, match=r"gamma: dtype must be x's .*float16"):
        lm_head_loss(x, gain.detach().half(), w, t)


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_soft_capped_logits_loss_equals_unpatched_float64(family, kernel, monkeypatch):
    """Gemma 2's ``final_logit_softcapping`` (and Gemma 3's, where set) in coda's loss: c
    tanh(l / c) of the logits before the cross-entropy, as HF's forward applies it (a cap
    of 1 against logits of a few units: far from linear), on "auto"'s program (on the
    kernel path CE-S's capped one: V = 128); the same model without its cap is far from
    it."""
    if kernel:
        _kernel_path(monkeypatch)
    coda.env._LAST.clear()
    ref = gemma_model(
        family, final_logit_softcapping=1.0, **({"vocab_size": 128} if kernel else {})
    )
    with torch.no_grad():  # (logits of a few units)
        ref.lm_head.weight.mul_(30.0)
    patched = ct.apply_coda(copy.deepcopy(ref), layers=False)
    batch = padded_batch(ref.config.vocab_size, right=True)
    assert_same_step(ref, patched, **batch)
    assert coda.last_path("LMHeadLoss")[0] == ("kernel" if kernel else "reference")
    n = torch.tensor(13.0, dtype=torch.float64)
    assert_same_step(ref, patched, **batch, num_items_in_batch=n)
    uncapped = copy.deepcopy(patched)
    uncapped.config.final_logit_softcapping = None
    assert rel_err(uncapped(**batch).loss, ref(**batch).loss) > 1e-2


def test_what_the_patch_does_not_take_is_named():
    capped = gemma_model("gemma2", final_logit_softcapping=30.0)
    with pytest.raises(coda.CodaInputError, match=r"final_logit_softcapping=30\.0: softcap: "):
        ct.apply_coda(capped, layers=False, method="chunked")  # (CE-C's program takes no cap)
    with pytest.raises(coda.CodaInputError, match=r"Gemma3ForCausalLM"):  # the list of loss-only
        ct.apply_coda(torch.nn.Linear(2, 2))
