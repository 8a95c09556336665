"""What a patched layer hands the model's attention function: exactly what HF's own layer
hands it (the same keywords, the same values). Flash attention reads ``position_ids`` from
them to find the documents of a padding-free packed batch (no attention mask): a layer that
dropped them would let attention cross document boundaries silently, which no sdpa test
shows (sdpa's packed mask is built before the layers). Probed on the CPU with an attention
function registered under its own name that records its keywords and runs sdpa's. One
difference is by design: for YaRN, whose cos and sin HF scales by a constant c, a patched
layer rotates unscaled and hands the attention a scale c^2 larger."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from test_transformers import model_class, tiny_config  # noqa: E402

import coda.env  # noqa: E402
import coda.transformers as ct  # noqa: E402

CALLS: list = []


@pytest.fixture(scope="module")
def probe():
    """An attention implementation "coda_probe": records each call's keywords, then sdpa."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, q, k, v, mask, **kw):
        CALLS.append({n: x.clone() if isinstance(x, torch.Tensor) else x for n, x in kw.items()})
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("coda_probe", attention)
    AttentionMaskInterface.register("coda_probe", sdpa_mask)
    return "coda_probe"


def _calls(model, **batch) -> list:
    CALLS.clear()
    with torch.no_grad():
        model(**batch)
    return list(CALLS)


# sliding windows (the attention function's ``sliding_window`` keyword): Mistral's on every
# layer, Qwen3's on its "sliding_attention" layers, Phi-3's from its config
WINDOWS = {
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "qwen3-window": (
        "qwen3",
        dict(
            use_sliding_window=True,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "phi3-window": ("phi3", dict(sliding_window=5)),
    # EXAONE 4's on its sliding layers only (its attention keeps the model's window on both)
    "exaone4-window": (
        "exaone4",
        dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    ),
    # YaRN: HF scales cos and sin by c, a patched layer the attention's scale by c^2 instead
    "llama-yarn": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="yarn", factor=4.0, rope_theta=1e4, original_max_position_embeddings=8
            )
        ),
    ),
}


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "qwen2", "mistral", "phi3", "smollm3", "glm4", *WINDOWS]
)
def test_the_attention_function_gets_what_hfs_layer_gives_it(family, kernel, probe, monkeypatch):
    if kernel:
        monkeypatch.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
    family, extra = WINDOWS.get(family, (family, {}))
    cfg = tiny_config(family, vocab_size=128, **extra)
    cfg._attn_implementation = probe
    torch.manual_seed(0)
    ref = model_class(cfg)(cfg).double()
    patched = ct.apply_coda(copy.deepcopy(ref))
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]])  # three documents
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    c2 = float(ref.model.rotary_emb.attention_scaling) ** 2  # (1 but for YaRN)
    for batch in (
        dict(input_ids=ids, position_ids=packed, use_cache=False),  # padding-free packing
        dict(input_ids=ids.repeat(2, 1), attention_mask=mask, use_cache=False),
        dict(input_ids=ids),  # (generation's first call: the cache on)
    ):
        want, got = _calls(ref, **batch), _calls(patched, **batch)
        assert len(got) == len(want) == cfg.num_hidden_layers
        for w, g in zip(want, got):
            assert g.keys() == w.keys(), (sorted(g), sorted(w))
            for name, value in w.items():
                same = torch.equal if isinstance(value, torch.Tensor) else lambda a, b: a == b
                assert same(g[name], value * c2 if name == "scaling" else value), name


# (eager flex attention, unfused, is what the test runs: torch's advice to compile it is moot)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_a_patched_model_runs_hfs_flex_attention(family, monkeypatch):
    """With ``attn_implementation="flex_attention"`` the model builds a BlockMask before the
    layers and each layer hands it to flex attention: the patched model's logits equal the
    unpatched model's, padded and packed, on both paths (fp32 forward: flex attention on the
    CPU runs neither float64 nor a backward). Gemma 3 and Gemma 2: a sliding layer and a full
    one, norms after each sublayer; Gemma 3's QK-norm, Gemma 2's attention soft-cap (which
    flex attention applies where sdpa cannot). Flex attention and its BlockMask are built
    eager here, for both models: HF compiles them, which on the CPU took 54 s for Gemma 3's
    case (12 Inductor compiles of flex attention alone; session 78)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    hf_flex = pytest.importorskip("transformers.integrations.flex_attention")
    import transformers.masking_utils as hf_masks

    def eager_flex(query, key, value, training=False, **kw):
        return flex.flex_attention(query, key, value, **kw)

    def eager_block_mask(*args, _compile=False, **kw):
        return flex.create_block_mask(*args, **kw)

    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", eager_flex)
    monkeypatch.setattr(hf_masks, "create_block_mask", eager_block_mask)
    types = ["sliding_attention", "full_attention"]
    extra = dict(sliding_window=4, layer_types=types, query_pre_attn_scalar=12)
    if family == "gemma2":  # (a cap that binds on the tiny model's scores)
        extra["attn_logit_softcapping"] = 0.05
    cfg = tiny_config(family, vocab_size=128, **extra)
    cfg._attn_implementation = "flex_attention"
    torch.manual_seed(0)
    ref = model_class(cfg)(cfg).eval()
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]]).repeat(2, 1)
    batches = (dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids, position_ids=packed))
    with torch.no_grad():
        want = [ref(**b, use_cache=False).logits for b in batches]
        for kernel in (False, True):
            with pytest.MonkeyPatch.context() as mp:
                if kernel:
                    mp.setattr(coda.env, "kernel_support", lambda device, dtype=None: (True, ""))
                patched = ct.apply_coda(copy.deepcopy(ref))
                for b, w in zip(batches, want):
                    got = patched(**b, use_cache=False).logits
                    assert (got - w).abs().max() <= 1e-5 * w.abs().max(), (kernel, sorted(b))
