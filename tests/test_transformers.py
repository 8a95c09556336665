"""``coda.transformers.apply_coda`` on tiny random Hugging Face Llama and Qwen3 models built
here (no downloads), on the CPU in float64 (coda's reference path): the patched model's
logits, loss, every parameter gradient (in HF's layout) and greedy generation equal the
unpatched model's, with padding masks and with packed sequences (positions restarting per
document); its state dict and ``save_pretrained`` are HF's, and load back into an unpatched
model exactly. With the kernel path forced on the CPU (GEMMs through the tile interpreter),
the whole patched model, every LM-head method, in float64, bf16 and under bf16 autocast.

Tolerance: 1e-5 relative. HF computes RMSNorm and the loss in fp32 even in a float64 model
(``LlamaRMSNorm`` upcasts to fp32; ``ForCausalLMLoss`` calls ``logits.float()``) and its RoPE
tables in fp32, so fp32 round-off is the floor of any comparison with it."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers"
)  # installed by the dev extra: never skipped in CI
from conftest import rel_err  # noqa: E402
from hf_tiny import MOE, SCALED_ROPES, model_class, tiny_config  # noqa: E402, F401
from transformers import LlamaForCausalLM, LlamaModel  # noqa: E402

import coda  # noqa: E402
import coda.transformers as ct  # noqa: E402

TOL = 1e-5


def pair(config, seed=0, model=None):
    """(an unpatched float64 model, a patched copy); ``model``: that model, made already."""
    torch.manual_seed(seed)
    ref = model_class(config)(config).double() if model is None else model
    with torch.no_grad():  # norms (QK-norms included) away from 1, so a lost gamma would show
        for n, p in ref.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("_proj.bias"):  # Qwen2's (HF makes them 0): a lost bias would show
                p.copy_(torch.randn_like(p))
    patched = ct.apply_coda(copy.deepcopy(ref))
    return ref, patched


def assert_same_step(ref, patched, **batch):
    """One training step of each: the losses and every gradient (HF layout) agree, and the
    same weights have one (frozen ones none)."""
    loss_r, loss_p = _step(ref, **batch), _step(patched, **batch)
    assert rel_err(loss_p, loss_r) < TOL
    grads_r = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    grads_p = ct.hf_gradients(patched)
    assert grads_p.keys() == grads_r.keys()
    floor = max(float(g.abs().max()) for g in grads_r.values())
    for name, g in grads_r.items():
        assert rel_err(grads_p[name], g, floor=floor) < TOL, name


def _step(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach()


@pytest.mark.parametrize(
    "rope",
    [
        None,
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
        dict(rope_type="linear", factor=4.0),
        # YaRN: its cos and sin scaled by c = 0.1 ln(4) + 1 (folded into the attention's scale)
        dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32),
    ],
    ids=["default", "llama3", "linear", "yarn"],
)
def test_patched_llama_matches_unpatched_float64(rope, coda_path):
    cfg = tiny_config(
        **({} if rope is None else {"rope_parameters": {**rope, "rope_theta": 500000.0}}),
        **coda_path,
    )
    ref, patched = pair(cfg)
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in patched.model.layers)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        assert rel_err(patched(ids).logits, ref(ids).logits) < TOL
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    # past the original context (positions 40-52 of YaRN's 32) and through the KV cache
    pos = torch.arange(40, 53)[None].expand(2, -1)
    assert_same_step(ref, patched, input_ids=ids, position_ids=pos, labels=ids)
    with torch.no_grad():
        want = ref.generate(ids[:, :5], max_new_tokens=6, do_sample=False)
        assert torch.equal(patched.generate(ids[:, :5], max_new_tokens=6, do_sample=False), want)


def test_padding_and_packed_sequences_behave_as_unpatched(coda_path):
    cfg = tiny_config(**coda_path)
    ref, patched = pair(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second row
    labels = ids.masked_fill(mask == 0, -100)
    for batch in (
        dict(input_ids=ids, attention_mask=mask, labels=labels),
        # two documents packed in one row, positions restarting at the boundary
        dict(
            input_ids=ids[:1],
            position_ids=torch.cat([torch.arange(5), torch.arange(7)])[None],
            labels=ids[:1],
        ),
    ):
        assert_same_step(ref, patched, **batch)


def _loss_arguments(ids):
    """The loss arguments HF's ``ForCausalLMLoss`` takes from a model call's keywords, each
    with a batch where it changes the loss: the Trainer's token count over accumulated
    micro-batches, pre-shifted labels (context parallelism, packed documents masked at their
    boundary) and another ignore index."""
    # targets two tokens ahead, which the labels would not give: read from shift_labels only
    shifted = torch.nn.functional.pad(ids, (0, 2), value=-100)[..., 2:].clone()
    shifted[:, 4] = -100  # a document boundary: no loss across it
    labels = ids.clone()
    labels[1, 2:4] = -1
    return {
        "num_items_in_batch": dict(labels=ids, num_items_in_batch=torch.tensor(37)),
        "shift_labels": dict(labels=ids, shift_labels=shifted),
        "ignore_index": dict(labels=labels, ignore_index=-1),
    }


@pytest.mark.parametrize("argument", ["num_items_in_batch", "shift_labels", "ignore_index"])
def test_hf_loss_arguments_are_honored(argument, coda_path):
    cfg = tiny_config(**coda_path)
    ref, patched = pair(cfg, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (2, 10))
    batch = _loss_arguments(ids)[argument]
    assert_same_step(ref, patched, input_ids=ids, **batch)
    loss = _step(patched, input_ids=ids, **batch)
    if argument == "ignore_index":  # (without it, the target -1 is refused as out of range)
        same = _step(
            patched, input_ids=ids, labels=batch["labels"].masked_fill(batch["labels"] == -1, -100)
        )
        assert rel_err(loss, same) < TOL
    else:  # the argument changed the loss: the test sees it
        assert rel_err(loss, _step(patched, input_ids=ids, labels=batch["labels"])) > 10 * TOL


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "phi3"])
def test_hidden_states_and_tuples_as_unpatched(family, coda_path):
    """``output_hidden_states`` (transformers records them with hooks on its layer class; with
    labels the last one is after the final norm, which runs inside coda's loss) and
    ``return_dict=False``, with and without labels."""
    cfg = tiny_config(family, **coda_path)
    ref, patched = pair(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    for labels in (None, ids):  # (skip_logits: coda's loss under no_grad too)
        with torch.no_grad():
            r = ref(input_ids=ids, labels=labels, output_hidden_states=True)
            p = patched(input_ids=ids, labels=labels, output_hidden_states=True, skip_logits=True)
            assert len(p.hidden_states) == len(r.hidden_states) == cfg.num_hidden_layers + 1
            for a, b in zip(p.hidden_states, r.hidden_states):
                assert rel_err(a, b) < TOL
            r = ref(input_ids=ids, labels=labels, return_dict=False)
            p = patched(input_ids=ids, labels=labels, return_dict=False, skip_logits=True)
            assert isinstance(p, tuple) and rel_err(p[0], r[0]) < TOL  # the loss, or logits


def test_logits_where_a_loop_reads_them(coda_path):
    """With labels, a training step (autograd recording) gets the loss without logits; an
    evaluation under no_grad gets HF's logits and loss (metrics read the logits);
    ``skip_logits`` overrides either way, and the step's gradients are the same."""
    cfg = tiny_config(**coda_path)
    ref, patched = pair(cfg, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        r, p = ref(input_ids=ids, labels=ids), patched(input_ids=ids, labels=ids)
        assert rel_err(p.logits, r.logits) < TOL and rel_err(p.loss, r.loss) < TOL
        assert patched(input_ids=ids, labels=ids, skip_logits=True).logits is None
    assert patched(input_ids=ids, labels=ids).logits is None
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    want = {k: g.clone() for k, g in ct.hf_gradients(patched).items()}
    patched.zero_grad(set_to_none=True)
    out = patched(input_ids=ids, labels=ids, skip_logits=False)
    out.loss.backward()
    assert rel_err(out.logits, r.logits) < TOL
    for k, g in ct.hf_gradients(patched).items():
        assert rel_err(g, want[k], floor=float(want[k].abs().max())) < TOL, k


def test_layers_found_by_hf_class_and_name():
    """A patched layer is an instance of the HF layer class it replaced, under its name: the
    Trainer's FSDP auto-wrap finds ``_no_split_modules`` by name, hooks by class."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.trainer_pt_utils import get_module_class_from_name

    cfg = tiny_config()
    ref, patched = pair(cfg)
    found = get_module_class_from_name(patched, "LlamaDecoderLayer")  # its _no_split_modules
    assert found is type(patched.model.layers[0]) and found is not LlamaDecoderLayer
    for layer in patched.model.layers:
        assert isinstance(layer, (found, LlamaDecoderLayer, ct.CodaLlamaDecoderLayer))
        assert repr(layer).startswith("LlamaDecoderLayer(\n  coda, d=48")  # says whose it is
    # hooks transformers installed on the layers before the patch are made anew after it
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    model = copy.deepcopy(ref)
    model(input_ids=ids, output_hidden_states=True)
    ct.apply_coda(model)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True).hidden_states
        assert len(out) == cfg.num_hidden_layers + 1
        assert rel_err(out[1], ref(input_ids=ids, output_hidden_states=True).hidden_states[1]) < TOL


@pytest.mark.parametrize("tied", [False, True])
def test_embedding_becomes_codas_in_place(tied):
    """``apply_coda`` makes the token embedding a ``coda.nn.Embedding`` in place: the same
    module and parameter (still the LM head's where tied), the same padding row; with
    ``embedding=False``, or for an embedding coda's backward does not cover, it is left."""
    import coda.nn as cnn

    cfg = tiny_config("llama", tie_word_embeddings=tied, pad_token_id=3)
    model = model_class(cfg)(cfg).double()
    embed, weight = model.model.embed_tokens, model.model.embed_tokens.weight
    ct.apply_coda(model)
    assert model.model.embed_tokens is embed and type(embed) is cnn.Embedding
    assert embed.weight is weight and embed.padding_idx == 3
    assert (model.lm_head.weight is weight) == tied
    ct.apply_coda(model)  # again: nothing changes
    assert type(model.model.embed_tokens) is cnn.Embedding
    left = ct.apply_coda(model_class(cfg)(cfg).double(), embedding=False)
    assert type(left.model.embed_tokens) is torch.nn.Embedding
    sparse = model_class(cfg)(cfg).double()
    sparse.model.embed_tokens.sparse = True
    assert type(ct.apply_coda(sparse).model.embed_tokens) is torch.nn.Embedding


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_after_the_patch(tied):
    """``resize_token_embeddings`` on a patched model (the way to pad a vocabulary to the
    kernels' multiple of 128, as coda's error says) keeps coda's embedding class and the tie,
    and the resized model trains as the unpatched one resized alike."""
    import coda.nn as cnn

    cfg = tiny_config("llama", tie_word_embeddings=tied)
    ref, patched = pair(cfg)
    for model in (ref, patched):
        model.resize_token_embeddings(cfg.vocab_size, pad_to_multiple_of=128, mean_resizing=False)
    assert type(patched.model.embed_tokens) is cnn.Embedding
    assert patched.lm_head.weight.shape == (128, cfg.hidden_size)
    assert (patched.lm_head.weight is patched.model.embed_tokens.weight) == tied
    patched.load_state_dict(ref.state_dict())  # (the new rows' random init, made alike)
    ids = torch.randint(0, 128, (2, 11))
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


def test_output_attentions_is_refused():
    cfg = tiny_config(attn_implementation="eager")
    _, patched = pair(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    for labels in (None, ids):
        with pytest.raises(coda.CodaInputError, match="output_attentions is not supported"):
            patched(input_ids=ids, labels=labels, output_attentions=True)


def test_generation_and_llama_model():
    cfg = tiny_config()
    ref, patched = pair(cfg, seed=2)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    with torch.no_grad():
        out_r = ref.generate(ids, max_new_tokens=5, do_sample=False)
        out_p = patched.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(out_r, out_p)
    base = LlamaModel(cfg).double()
    hidden = base(ids).last_hidden_state
    ct.apply_coda(base)
    assert rel_err(base(ids).last_hidden_state, hidden) < TOL


def test_state_dict_and_save_pretrained_are_hf(tmp_path):
    cfg = tiny_config()
    ref, patched = pair(cfg, seed=3)
    sd_r, sd_p = ref.state_dict(), patched.state_dict()
    assert sd_p.keys() == sd_r.keys()
    assert all(torch.equal(sd_p[k], sd_r[k]) for k in sd_r)
    patched.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    assert all(torch.equal(loaded.state_dict()[k], sd_r[k]) for k in sd_r)  # bit for bit
    with torch.no_grad():  # (``ref.double()`` also made its RoPE buffer float64: round-off)
        assert rel_err(loaded(ids).logits, ref(ids).logits) < 1e-12
    # and an HF state dict loads into a patched model
    other = ct.apply_coda(LlamaForCausalLM(cfg).double())
    other.load_state_dict(sd_r)
    assert all(torch.equal(other.state_dict()[k], sd_r[k]) for k in sd_r)


def test_coda_keys_are_the_parameters_own():
    """Inside ``coda_keys`` a patched model's state dict holds its own parameters under their
    own names (what torch.distributed.checkpoint needs), and loads back so; outside, HF's."""
    cfg = tiny_config()
    ref, patched = pair(cfg, seed=3)
    with ct.coda_keys(patched):
        own = patched.state_dict()
        assert own.keys() == dict(patched.named_parameters()).keys()
        other = ct.apply_coda(LlamaForCausalLM(cfg).double())
        with ct.coda_keys(other):
            other.load_state_dict(own)
    assert patched.state_dict().keys() == ref.state_dict().keys()  # HF's again
    for k, t in ref.state_dict().items():
        assert torch.equal(other.state_dict()[k], t), k


# (Qwen3 tied; Qwen2 with its biases; Phi-3 with its fused projections)
@pytest.mark.parametrize("family", ["qwen3", "qwen2", "phi3"])
def test_save_pretrained_loads_unpatched(tmp_path, family):
    cfg = tiny_config(family, tie_word_embeddings=family == "qwen3")
    ref, patched = pair(cfg, seed=6)
    patched.save_pretrained(tmp_path)
    loaded = model_class(cfg).from_pretrained(tmp_path, torch_dtype=torch.float64)
    sd_r = ref.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], sd_r[k]) for k in sd_r)  # bit for bit
    other = ct.apply_coda(model_class(cfg)(cfg).double())  # and an HF state dict loads back
    other.load_state_dict(sd_r)
    assert all(torch.equal(other.state_dict()[k], sd_r[k]) for k in sd_r)


def test_patched_qwen3_matches_unpatched_float64(coda_path):
    """Qwen3's per-head QK-norm (before RoPE): logits, loss and every gradient (q_norm and
    k_norm included), with padding and with packed sequences; generation; HF state dict."""
    # as Qwen3-0.6B: one embedding / head
    cfg = tiny_config("qwen3", tie_word_embeddings=True, **coda_path)
    ref, patched = pair(cfg)
    assert all(layer.qk_norm for layer in patched.model.layers)
    assert patched.lm_head.weight is patched.model.embed_tokens.weight
    assert_behaves_as_unpatched(ref, patched, torch.randint(0, cfg.vocab_size, (2, 13)))


def assert_behaves_as_unpatched(ref, patched, ids, right_padding: bool = False):
    """Logits, a training step (loss and every gradient), with a padding mask and with packed
    positions (two documents), greedy generation and the state dict as the unpatched model's;
    ``ids`` (2, 13). ``right_padding``: the padded row's pads at its end (HF's eager attention
    gives a left pad's row, which attends to nothing, NaN: Gemma 2's)."""
    with torch.no_grad():
        assert rel_err(patched(ids).logits, ref(ids).logits) < TOL
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, -4:] = 0 if right_padding else 1
    mask[1, :4] = 1 if right_padding else 0
    assert_same_step(
        ref, patched, input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)
    )
    packed = torch.cat([torch.arange(6), torch.arange(7)])[None]
    assert_same_step(ref, patched, input_ids=ids[:1], position_ids=packed, labels=ids[:1])
    with torch.no_grad():
        out_r = ref.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
        out_p = patched.generate(ids[:1, :5], max_new_tokens=4, do_sample=False)
    assert torch.equal(out_r, out_p)
    sd_r, sd_p = ref.state_dict(), patched.state_dict()
    assert sd_p.keys() == sd_r.keys() and all(torch.equal(sd_p[k], sd_r[k]) for k in sd_r)


@pytest.mark.parametrize(
    "kw",
    [
        dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
        dict(attn_implementation="eager"),
    ],
    ids=["sliding_window", "eager_attention"],
)
def test_patched_qwen3_sliding_window_and_eager_attention(kw):
    """A sliding-window layer (the model's own masks and window reach its attention function)
    and HF's eager attention: logits, loss and every gradient as unpatched."""
    cfg = tiny_config("qwen3", **kw)
    ref, patched = pair(cfg, seed=4)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        assert rel_err(patched(ids).logits, ref(ids).logits) < TOL
    assert_same_step(ref, patched, input_ids=ids, labels=ids)


@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding_window"])
def test_patched_mistral_matches_unpatched_float64(window, coda_path):
    """Mistral (Llama's layer; the model's sliding window, when configured, in its masks and
    passed to its attention function): logits, loss and every gradient as unpatched, with a
    padding mask too."""
    cfg = tiny_config("mistral", sliding_window=window, **coda_path)
    ref, patched = pair(cfg, seed=6)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        assert rel_err(patched(ids).logits, ref(ids).logits) < TOL
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    assert_same_step(ref, patched, input_ids=ids, attention_mask=mask, labels=ids)


@pytest.mark.parametrize(
    "head_dim, span",
    [(32, "head"), (12, "head"), (16, "head"), (32, "whole"), (12, "whole")],
    ids=["epilogue", "row-pass", "narrow-heads", "whole", "whole-narrow-heads"],
)
def test_qwen3_kernel_sequence_equals_reference_float64(head_dim, span):
    """The kernel path's QK-norm Function on the CPU through the tile interpreter equals the
    reference path, both ways it runs: F1 with the head norms and RoPE in its epilogue
    (head_dim 32: whole heads in a 128-column tile) and F1 without rotation plus a row pass
    (head_dim 12: no tile width holds whole heads; 16: a head narrower than the epilogue's
    32-column subtile, whose statistic the GPU would fold with its neighbour's; OLMo's norm
    over the whole q and k projections, ``span`` "whole", at any head_dim); the backward
    of each."""
    import coda.nn as cnn
    from coda.kernels.qk_norm import qk_norm_config

    assert (qk_norm_config(head_dim) is None) == (head_dim != 32)
    torch.manual_seed(5)
    layer = cnn.DecoderLayer(
        48, 4, 2, 40, head_dim=head_dim, eps=1e-2, dtype=torch.float64, qk_norm=span
    )
    assert layer.q_norm.shape == ((4 if span == "whole" else 1) * head_dim,)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 7, 48, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 7, 48, dtype=torch.float64)

    def grads(run):
        for p in (*layer.parameters(), x):
            p.grad = None
        out = run()
        out.backward(dy)
        return out.detach(), [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]

    out_k, g_k = grads(lambda: layer._kernel_forward(x))
    out_r, g_r = grads(lambda: layer(x))
    assert rel_err(out_k, out_r) < 1e-12
    floor = max(float(g.abs().max()) for g in g_r)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    assert "q_norm" in names and "k_norm" in names
    for name, a, b in zip(names, g_k, g_r):
        assert rel_err(a, b, floor=floor) < 1e-11, name


@pytest.mark.parametrize("method", ["scaled_exp", "chunked", "recompute"])
@pytest.mark.parametrize("mode", ["float64", "bfloat16", "autocast"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "llama-bias", "phi3", "smollm3"])
def test_patched_model_kernel_path_on_cpu(family, mode, method, monkeypatch):
    """The patched model with its kernel path forced on the CPU (``kernel_support`` answers
    yes, so every layer and the loss run the kernel sequence, GEMMs through the interpreter,
    with HF's attention function and position ids): a whole-model integration test of what
    the H200 runs. float64: equal to the unpatched model to HF's fp32 floor; bf16 (the
    interpreter then enforces the TMA's layout rules) and fp32 weights under bf16 autocast:
    within bf16 distance, fp32 gradients in the autocast case."""
    import coda.env

    def kernel_everywhere(device, dtype=None):
        if dtype in (None, torch.bfloat16, torch.float64):
            return True, ""
        return False, f"{dtype}: not a kernel dtype"

    monkeypatch.setattr(coda.env, "kernel_support", kernel_everywhere)
    cfg = tiny_config(family, vocab_size=128)  # TMA: 16-byte rows (V a multiple of 8)
    torch.manual_seed(0)
    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(mode, torch.float32)
    ref = model_class(cfg)(cfg).to(dtype)
    patched = ct.apply_coda(copy.deepcopy(ref), method=method)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        loss_r = _step(ref, input_ids=ids, labels=ids)
        loss_p = _step(patched, input_ids=ids, labels=ids)
    assert coda.last_path("DecoderLayer")[0] == coda.last_path("LMHeadLoss")[0] == "kernel"
    # (an fp32 table under autocast is nn.Embedding's own: autocast leaves the gather fp32)
    assert coda.last_path("Embedding")[0] == ("reference" if mode == "autocast" else "kernel")
    tol = TOL if mode == "float64" else 3e-2
    assert rel_err(loss_p, loss_r) < tol
    grads_p = ct.hf_gradients(patched)
    floor = max(float(p.grad.abs().max()) for p in ref.parameters())
    for name, p in ref.named_parameters():
        assert grads_p[name].dtype == p.dtype, name
        assert rel_err(grads_p[name], p.grad, floor=floor) < tol, name


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "phi3"])
def test_patched_model_under_autocast_trains_like_unpatched(family):
    """fp32 weights under torch.autocast (bf16), as HF's Trainer runs bf16=True: the patched
    model's loss and gradients (fp32, HF layout) stay within bf16 distance of the unpatched
    model's under the same autocast (on the GPU its layers then run the bf16 kernels)."""
    ref, patched = pair(tiny_config(family))
    ref, patched = ref.float(), patched.float()
    with torch.no_grad():  # Qwen2's biases at 0.1 (``pair``'s, at 1, swamp q and k in bf16:
        for p in (*_biases(ref), *_biases(patched)):  # HF's own q grads err by 35 % there)
            p.mul_(0.1)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_r, loss_p = (
            _step(ref, input_ids=ids, labels=ids),
            _step(patched, input_ids=ids, labels=ids),
        )
    assert abs(float(loss_p) - float(loss_r)) < 5e-3 * abs(float(loss_r))
    grads_p = ct.hf_gradients(patched)
    for name, g in ref.named_parameters():
        assert grads_p[name].dtype == torch.float32, name
        assert rel_err(grads_p[name], g.grad, floor=float(g.grad.abs().max())) < 0.05, name


def _biases(model):
    return [p for n, p in model.named_parameters() if n.endswith(("_proj.bias", "bias_qkv"))]


def test_bad_labels_are_named_as_the_caller_passed_them():
    """A patched model's training call checks ``labels`` (and ``shift_labels``) by HF's names,
    against the tokens' (batch, seq), before any layer runs."""
    patched = ct.apply_coda(LlamaForCausalLM(tiny_config()).double())
    ids = torch.randint(0, 97, (2, 8))
    with pytest.raises(coda.CodaInputError, match=r"labels: expected shape \(2, 8\), got \(2, 7\)"):
        patched(input_ids=ids, labels=ids[:, :7])
    with pytest.raises(coda.CodaInputError, match="labels: dtype must be int32 or int64"):
        patched(ids, labels=ids.double())
    with pytest.raises(coda.CodaInputError, match="shift_labels: expected shape"):
        patched(input_ids=ids, labels=ids, shift_labels=ids[:1])
    embeds = patched.model.embed_tokens(ids)
    with pytest.raises(coda.CodaInputError, match=r"labels: expected shape \(2, 8\)"):
        patched(inputs_embeds=embeds, labels=ids[:, :5])
    assert torch.isfinite(patched(input_ids=ids, labels=ids).loss)


def test_unsupported_models_and_configs_are_named():
    with pytest.raises(coda.CodaInputError, match="mlp_bias=True is not supported"):
        ct.apply_coda(LlamaForCausalLM(tiny_config(mlp_bias=True)))
    with pytest.raises(coda.CodaInputError, match="torch.nn.Linear is not supported|Linear is not"):
        ct.apply_coda(torch.nn.Linear(2, 2))
