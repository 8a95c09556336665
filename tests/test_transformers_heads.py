"""``apply_coda`` on the task models of the supported families (``coda.transformers.TASK_HEADS``:
``...ForSequenceClassification``, as reward models are, ``...ForTokenClassification``,
``...ForQuestionAnswering``): the decoder stack is patched as its ``...Model`` is, the task
head and its loss stay HF's. CPU, float64, the layers on their reference path and on their
kernel path through the tile interpreter: the loss and every gradient equal the unpatched
model's, with right and left padding (a sequence classifier reads the last token that is not
padding)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from test_transformers import TOL, assert_same_step, tiny_config  # noqa: E402

import coda  # noqa: E402
import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402
from coda.nn import DecoderLayer  # noqa: E402

FAMILIES = ["llama", "qwen3", "qwen2", "mistral", "phi3", "smollm3", "gemma", "olmo2"]
B, S, V, LABELS = 2, 11, 128, 3


def task_model(family: str, head: str):
    """A tiny float64 ``family`` model with the task ``head`` (pad token 0, three labels)."""
    import transformers

    cfg = tiny_config(family, vocab_size=V, pad_token_id=0, num_labels=LABELS)
    name = type(cfg).__name__.removesuffix("Config") + head
    torch.manual_seed(0)  # (eval: the token classifier's dropout off, so both draw none)
    return getattr(transformers, name)(cfg).double().eval()


def batch(head: str, left: bool) -> dict:
    """Tokens in [1, V) (0 is padding), the second row padded by 4 on the ``left`` or right,
    and the head's labels: a class per sequence, per token (-100 on padding), or a span."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (B, S), generator=g)
    mask = torch.ones_like(ids)
    pad = slice(0, 4) if left else slice(S - 4, S)
    ids[1, pad], mask[1, pad] = 0, 0
    out = dict(input_ids=ids, attention_mask=mask)
    if head == "ForSequenceClassification":
        return {**out, "labels": torch.randint(0, LABELS, (B,), generator=g)}
    if head == "ForTokenClassification":
        labels = torch.randint(0, LABELS, (B, S), generator=g)
        return {**out, "labels": labels.masked_fill(mask == 0, -100)}
    start = torch.randint(4, S - 4, (B,), generator=g)
    return {**out, "start_positions": start, "end_positions": start + 2}


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize("head", ct.TASK_HEADS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_task_model_trains_as_unpatched(family, head, kernel, monkeypatch):
    import transformers

    cls = type(tiny_config(family)).__name__.removesuffix("Config") + head
    if not hasattr(transformers, cls):  # (Phi-3 has no question-answering model, OLMo 2 a
        # sequence classifier alone: its reward models)
        pytest.skip(f"transformers has no {cls}")
    if kernel:
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    ref = task_model(family, head)
    patched = ct.apply_coda(copy.deepcopy(ref))
    stack = getattr(patched, patched.base_model_prefix)  # (``transformer`` for QA models)
    assert all(isinstance(layer, DecoderLayer) for layer in stack.layers)
    assert type(patched.score if hasattr(patched, "score") else patched.qa_outputs) is (
        torch.nn.Linear  # (the task head stays HF's)
    )
    for left in (False, True):
        assert_same_step(ref, patched, **batch(head, left))
    assert coda.last_path("DecoderLayer")[0] == ("kernel" if kernel else "reference")
    with torch.no_grad():
        want = ref(**batch(head, True))
        got = patched(**batch(head, True))
    for key in ("logits", "start_logits", "end_logits"):
        if key in want:
            assert rel_err(got[key], want[key]) < TOL, key
    # saved as HF saves it: the same keys, shapes and values (a reward model's checkpoint)
    saved, hf = patched.state_dict(), ref.state_dict()
    assert saved.keys() == hf.keys()
    assert all(torch.equal(saved[k], hf[k]) for k in hf)


def test_a_task_model_of_an_unsupported_family_is_named():
    from transformers import GptOssConfig, GptOssForSequenceClassification

    cfg = GptOssConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0,
        num_local_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    with pytest.raises(coda.CodaInputError, match="GptOssForSequenceClassification"):
        ct.apply_coda(GptOssForSequenceClassification(cfg))


def test_a_mixtral_reward_model_takes_codas_attention_sublayers():
    """A mixture-of-experts family's task model (``MOE_LAYERS``): its stack's attention
    sublayers coda's, the experts the model's."""
    from transformers import MixtralConfig, MixtralForSequenceClassification

    cfg = MixtralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, num_local_experts=2,
    )  # fmt: skip
    model = ct.apply_coda(MixtralForSequenceClassification(cfg))
    (layer,) = model.model.layers
    assert isinstance(layer, ct.CodaLlamaDecoderLayer) and layer.mlp_module


def test_a_gemma2_reward_model_takes_codas_layers():
    """Gemma 2's task model: its stack's layers coda's (their norms after each sublayer); its
    config's final-logit soft-cap (30 by default) concerns an LM head it does not have."""
    from transformers import Gemma2Config, Gemma2ForSequenceClassification

    cfg = Gemma2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0,
    )  # fmt: skip
    model = ct.apply_coda(Gemma2ForSequenceClassification(cfg))
    assert isinstance(model.model.layers[0], ct.CodaLlamaDecoderLayer)
    assert model.model.layers[0].post_norms


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_reward_model_protocol(family):
    """H200: a 2-layer bf16 ``...ForSequenceClassification`` (a reward model's class; d = 256,
    4 x 256 tokens, right padding) patched by coda against the unpatched bf16 model, both
    against a float64 copy: every gradient's error no worse than the unpatched model's (CODA's
    protocol, ties within ``tie_band``), and the pooled scores' too."""
    import transformers
    from conftest import fro_err, tie_band
    from test_transformers import _step

    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    cfg = tiny_config(family, vocab_size=1024, pad_token_id=0, num_labels=1, **shape)
    name = type(cfg).__name__.removesuffix("Config") + "ForSequenceClassification"
    torch.manual_seed(0)
    ref = getattr(transformers, name)(cfg).to("cuda", torch.bfloat16)
    ref64, patched = copy.deepcopy(ref).double(), ct.apply_coda(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 1024, (4, 256), generator=g)
    ids[1, 200:] = 0  # (right padding: the score is read at the last real token)
    call = dict(input_ids=ids.cuda(), attention_mask=(ids != 0).long().cuda())
    # one label, a regression loss: in each model's dtype (CUDA's mse_loss backward refuses
    # a float32 target beside float64 or bf16 scores, unpatched as patched), bf16-exact
    labels = torch.randn(4, generator=g).bfloat16().cuda()
    for m in (ref64, ref, patched):
        _step(m, **call, labels=labels.to(m.dtype))
    assert coda.last_path("DecoderLayer")[0] == "kernel"
    with torch.no_grad():
        s64, s16, sc = (m(**call).logits for m in (ref64, ref, patched))
    assert fro_err(sc, s64) <= fro_err(s16, s64) * (1 + tie_band(s64))
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (ref64, ref)]
    gc = ct.hf_gradients(patched)
    for n, g64 in grads[0].items():
        ratio = fro_err(gc[n], g64) / fro_err(grads[1][n], g64)
        assert ratio <= 1.0 + tie_band(g64), (n, ratio)
