"""``apply_coda`` on vision-language models (``coda.transformers.VISION_LANGUAGE``): Llava,
Llava-NeXT, Llava-OneVision, Mistral 3, InternVL, Idefics3, SmolVLM, PaliGemma, Qwen2-VL,
Qwen2.5-VL and Qwen3-VL (their Llama, Mistral, Qwen2, Qwen3 and Gemma text models' decoder
layers coda's, PaliGemma's under its prefix mask, the Qwen-VL models' with multimodal RoPE,
and the loss; Gemma 3's Gemma 3 text model's too), Mllama, Qwen3-VL-MoE, GLM-4V
and GLM-4.5V (the loss alone: ``layers=False``), tiny and random (``hf_vlm``), on the CPU in
float64 on coda's reference path and its kernel path (the tile interpreter): a training step
with an image (text alone for ``hf_vlm.TEXT_ONLY``'s) equals the unpatched model's (the loss and
every gradient, the vision encoder's included) and forms no logits; what else the call returns
(hidden states, tuples, HF's logits without labels or under ``no_grad``) is HF's; HF's loss
arguments are honored; the unsupported combinations are refused, named."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from hf_vlm import KINDS, tiny_vlm  # noqa: E402
from test_transformers import TOL, assert_same_step  # noqa: E402

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402
from coda import _validate as v  # noqa: E402
from coda._hf_forward import text_model  # noqa: E402


def _patched(kind: str, model):
    return ct.apply_coda(copy.deepcopy(model), layers=KINDS[kind])


def _inputs(batch: dict) -> dict:
    return {k: t for k, t in batch.items() if k != "labels"}


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_vlm_step_equals_unpatched_float64(kind, kernel, monkeypatch):
    if kernel:
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    coda.env._LAST.clear()
    ref, batch = tiny_vlm(kind)
    patched = _patched(kind, ref)
    text = text_model(patched)
    assert all(isinstance(x, ct.CodaLlamaDecoderLayer) for x in text.layers) == KINDS[kind]
    assert_same_step(ref, patched, **batch)
    path = "kernel" if kernel else "reference"
    assert coda.last_path("LMHeadLoss")[0] == path
    if KINDS[kind]:
        assert coda.last_path("DecoderLayer")[0] == path
    out = patched(**batch)
    assert out.logits is None and type(out) is type(ref(**batch))  # (no logits in training)
    with torch.no_grad():  # (evaluation: HF's logits and loss)
        want, got = ref(**batch), patched(**batch)
        assert rel_err(got.logits, want.logits) < TOL and rel_err(got.loss, want.loss) < TOL
    # text alone (no image) through the same call
    ids = batch["input_ids"].masked_fill(batch["input_ids"] == 120, 7)
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl"])
def test_vlm_call_surface_is_hf(kind):
    """What a training call returns besides the loss is HF's: every hidden state (the last
    after the final norm, as HF's), ``return_dict=False``'s tuple, the loss arguments
    (``num_items_in_batch``, ``shift_labels``), and a loss function the user set on the
    model stays set."""
    ref, batch = tiny_vlm(kind, seed=2)
    patched = _patched(kind, ref)
    want = ref(**batch, output_hidden_states=True)
    got = patched(**batch, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states)
    for mine, theirs in zip(got.hidden_states, want.hidden_states):
        assert rel_err(mine, theirs) < TOL
    loss, *rest = patched(**batch, return_dict=False)
    assert rel_err(loss, want.loss) < TOL and not any(
        isinstance(t, torch.Tensor) and t.shape[-1] == 128 for t in rest
    )  # (no logits among the rest)
    assert_same_step(ref, patched, **batch, num_items_in_batch=torch.tensor(9.0))
    shifted = torch.nn.functional.pad(batch["labels"], (0, 2), value=-100)[..., 2:].clone()
    assert_same_step(ref, patched, **batch, shift_labels=shifted)

    with torch.no_grad():  # (generation: HF's forward, the patched layers and their cache)
        ids = batch["input_ids"][:, :5].masked_fill(batch["input_ids"][:, :5] >= 120, 7)
        want = ref.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(patched.generate(input_ids=ids, max_new_tokens=4, do_sample=False), want)

    def own_loss(logits, labels, vocab_size, **kw):  # (a user's, kept by the patch)
        return logits.float().logsumexp(-1).mean()

    patched.loss_function = own_loss
    patched(**batch)
    assert patched.loss_function is own_loss


@pytest.mark.parametrize("kind", [k for k, layers in KINDS.items() if not layers])
def test_vlm_layers_that_are_not_codas_are_refused_named(kind):
    ref, _ = tiny_vlm(kind)
    name = type(text_model(ref)).__name__
    with pytest.raises(v.CodaInputError, match=f"text model {name}: its decoder layers"):
        ct.apply_coda(ref)


def test_vlm_state_dict_is_hf_and_loads_back():
    """A patched Llava's state dict is HF's, keys and values; it loads into an unpatched
    model, whose step then equals the patched one's."""
    ref, batch = tiny_vlm("llava", seed=3)
    patched = _patched("llava", ref)
    mine, theirs = patched.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    fresh, _ = tiny_vlm("llava", seed=4)
    fresh.load_state_dict(mine)
    assert_same_step(fresh, patched, **batch)


def vlm_protocol(kind: str, device: str, seed: int = 5):
    """One bf16 training step with an image of the unpatched and the patched ``kind`` model
    and a float64 copy's, on ``device`` (the kernel path: the GPU's, or the interpreter's
    on the CPU): ((loss errors coda, PyTorch), scalar floor, {gradient: (coda's error / the
    unpatched bf16 model's, tie band)}). Gradients that are 0 in exact arithmetic, as
    attention's k biases', hold only the float64 copy's round-off: left out."""
    from conftest import tie_band

    losses, floor, errors, g64 = vlm_errors(kind, device, seed)
    ratios = {n: (c / max(t, 1e-30), tie_band(g64[n])) for n, (c, t) in errors.items()}
    return losses, floor, ratios


def vlm_errors(kind: str, device: str, seed: int):
    """``vlm_protocol``'s step: ((loss errors coda, PyTorch), floor, {gradient: (coda's
    error, the unpatched bf16 model's), as ``conftest.seed_errors`` forms them for pooling
    over seeds}, the float64 gradients)."""
    from conftest import seed_errors

    ref64, batch = tiny_vlm(kind, seed=seed)
    ref64 = ref64.to(device)
    batch = {k: t.to(device) for k, t in batch.items()}
    ref16 = copy.deepcopy(ref64).to(torch.bfloat16)
    patched = _patched(kind, copy.deepcopy(ref16))
    b16 = {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in batch.items()}
    losses = [m(**(batch if m is ref64 else b16)).loss for m in (ref64, ref16, patched)]
    for loss in losses:
        loss.backward()
    l64 = float(losses[0].detach())
    e_t, e_c = (abs(float(x.detach()) - l64) / abs(l64) for x in losses[1:])
    floor = 2.0**-9 / int((batch["labels"] != -100).sum()) ** 0.5
    g64 = {n: p.grad for n, p in ref64.named_parameters() if p.grad is not None}
    g16 = {n: p.grad for n, p in ref16.named_parameters() if p.grad is not None}
    gc = ct.hf_gradients(patched)
    top = max(float(g.norm()) for g in g64.values())
    kept = [n for n, g in g64.items() if float(g.norm()) > 1e-8 * top]
    errors = {n: seed_errors(gc[n], g64[n], g16[n]) for n in kept}
    return (e_c, e_t), floor, errors, g64


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl", "qwen3_vl", "paligemma"])
def test_gpu_vlm_protocol(kind):
    """H200: a patched bf16 Llava, Qwen2.5-VL, Qwen3-VL and PaliGemma (coda's layers,
    multimodal RoPE for the Qwen-VL models', Gemma's for PaliGemma, and loss), one training
    step with an image, against the unpatched bf16 model, both against a float64 copy
    (``vlm_protocol``): the loss no worse than PyTorch's above its rounding floor, every
    gradient of the text model and the head within its tie band of the unpatched model's
    error (CODA's protocol; ``text_side``: the text model's and the head's)."""
    (e_c, e_t), floor, ratios = vlm_protocol(kind, "cuda")
    assert max(e_c, floor) <= max(e_t, floor), (e_c, e_t, floor)
    worse = {n: r for n, (r, band) in text_side(ratios).items() if r > 1.0 + band}
    assert not worse, worse


VLM_POOLED_SEEDS = 16


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gemma3", "glm4v", "mistral3_ministral3"])
def test_gpu_vlm_protocol_pooled(kind):
    """``test_gpu_vlm_protocol`` for Gemma 3 (coda's layers since session 72: the norms after each
    sublayer, QK-norm), GLM-4V (since session 75: GLM-4's norms after each sublayer, multimodal
    RoPE on adjacent pairs of half of each head) and Mistral 3 with Ministral 3's text model
    (its attention temperature), each gradient's error pooled over ``VLM_POOLED_SEEDS`` seeds
    as the gradient stacked over them (``conftest.seed_errors``, since session 79, as the HF
    models' pooled protocol; ``conftest.pooled_ratio``, Bonferroni over the text side's
    gradients): one seed of this
    48-wide model over 56 tokens cannot decide a tie. Run 306 read seed 5 alone: three weights
    at 1.11-1.17x, over bands of ~0.1; the CPU model of the GPU's roundings (``cpu_numerics.py
    vlm``) flags the same seed (1.096 against 1.095) and, pooled over 16 seeds, every text-side
    gradient at or below 1.11, inside its band (0.92-0.93 for those three; benchmarks/NOTES.md,
    session 72). The loss's error as an RMS over the seeds."""
    from conftest import family_z, pooled_ratio

    errors: dict = {}
    loss_errors = []
    for seed in range(VLM_POOLED_SEEDS):
        losses, floor, errs, _ = vlm_errors(kind, "cuda", seed)
        loss_errors.append(losses)
        for n, e in text_side(errs).items():
            errors.setdefault(n, []).append(e)
    rms = [(sum(e[i] ** 2 for e in loss_errors) / len(loss_errors)) ** 0.5 for i in (0, 1)]
    assert max(rms[0], floor) <= max(rms[1], floor), (rms, floor)
    z = family_z(len(errors))
    pooled = {n: pooled_ratio(e, z) for n, e in errors.items()}
    worse = {n: (round(r, 4), round(1 + b, 4)) for n, (r, b) in pooled.items() if r > 1 + b}
    assert not worse, worse


def text_side(ratios: dict) -> dict:
    """The gradients of the text model and the LM head, the ones coda's layers and loss form.
    The vision encoder's and the projector's are HF's modules' backward of the image tokens'
    gradient (4 to 16 tokens here): every one of their entries carries that one gradient's
    error, so a tie band counting them as independent samples is far too narrow (on the CPU
    model of the GPU's roundings, 2 of 9 Llava seeds put 3 and 7 vision weights at 1.2-1.3x,
    all together; ``cpu_numerics.py vlm``)."""
    return {n: r for n, r in ratios.items() if ".language_model." in n or n.startswith("lm_head")}


def test_multimodal_rows_survive_checkpointing_and_pickling(monkeypatch):
    """The Qwen-VL layers read their three position rows from the cos table the rotary
    module tagged (``_tag_mrope_rows``): with HF's activation checkpointing (the backward's
    recompute reads the same rows) and after a pickle round trip (``torch.save(model)``:
    the hook comes back), the kernel path's step still equals the unpatched model's."""
    import io

    monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    ref, batch = tiny_vlm("qwen2_5_vl", seed=6)
    patched = _patched("qwen2_5_vl", ref)
    kwargs = {"use_reentrant": False}
    if hasattr(patched, "activation_checkpointing_enable"):  # (5.23's name; 5.17 has the old)
        patched.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    patched.train()
    assert_same_step(ref, patched, **batch)
    buffer = io.BytesIO()
    torch.save(_patched("qwen2_5_vl", ref), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_same_step(ref, loaded, **batch)
    assert coda.last_path("DecoderLayer")[0] == "kernel"
