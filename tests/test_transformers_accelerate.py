"""``coda.transformers.apply_coda`` on a model accelerate dispatched (what
``from_pretrained(device_map=...)`` does): the patch keeps each layer's hook (moving the
layer's inputs to its device) on the coda layer that replaces it and the embedding's on
coda's embedding, and refuses a layer whose weights accelerate offloads. On the CPU; the
two-GPU placement is tests/test_multi_device.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
from hf_tiny import model_class, tiny_config  # noqa: E402
from test_transformers import _step, assert_same_step  # noqa: E402

import coda  # noqa: E402
import coda.transformers as ct  # noqa: E402


def test_accelerates_layer_hooks_move_to_the_patched_layers():
    """A model dispatched by accelerate (``device_map``: a hook per module, moving its inputs
    to its device) keeps each layer's hook through the patch, on the coda layer that replaces
    it, and the embedding's, whose hooked call runs coda's embedding; it steps as the
    unpatched model; a layer whose weights accelerate offloads is refused by name, before
    any layer changes."""
    from accelerate.hooks import AlignDevicesHook, ModelHook, add_hook_to_module

    class Seen(ModelHook):  # notes each call's module, passes its inputs on
        def __init__(self, log):
            self.log = log

        def pre_forward(self, module, *args, **kwargs):
            self.log.append(module)
            return args, kwargs

    cfg, log = tiny_config(), []
    ref = model_class(cfg)(cfg).double()
    seen = [Seen(log) for _ in range(cfg.num_hidden_layers - 1)]  # (2 layers or more)
    hooks = [AlignDevicesHook(execution_device="cpu"), *seen]
    hooked = copy.deepcopy(ref)
    for layer, hook in zip(hooked.model.layers, hooks):
        add_hook_to_module(layer, hook)
    add_hook_to_module(hooked.model.embed_tokens, Seen(log))
    patched = ct.apply_coda(hooked)
    layers, embed = patched.model.layers, patched.model.embed_tokens
    assert seen and [layer._hf_hook for layer in layers] == hooks
    assert all(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in layers)
    assert isinstance(embed, coda.nn.Embedding)
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    coda.env._LAST.pop("Embedding", None)
    assert_same_step(ref, patched, input_ids=ids, labels=ids)
    assert log == [embed, *layers[1:]]  # each hooked module's call went through its hook
    assert coda.last_path("Embedding") is not None  # ... into coda's embedding forward
    offloaded = copy.deepcopy(ref)
    add_hook_to_module(offloaded.model.layers[1], AlignDevicesHook("cpu", offload=True))
    with pytest.raises(coda.CodaInputError, match=r"layers\.1: its weights are offloaded"):
        ct.apply_coda(offloaded)
    assert not any(isinstance(layer, ct.CodaLlamaDecoderLayer) for layer in offloaded.model.layers)


def test_a_model_dispatched_by_accelerate_steps_as_undispatched():
    """``accelerate.dispatch_model`` (what ``from_pretrained(device_map=...)`` runs), on the
    CPU with its hooks forced, then the patch: each coda layer holds its ``AlignDevicesHook``
    and the step equals the patched undispatched model's, bit for bit (tests/test_multi_device.py
    places the layers on two GPUs)."""
    from accelerate import dispatch_model

    cfg = tiny_config()
    ref = model_class(cfg)(cfg).double()
    places = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu"}
    places.update({f"model.layers.{i}": "cpu" for i in range(cfg.num_hidden_layers)})
    places["lm_head"] = "cpu"
    dispatched = dispatch_model(copy.deepcopy(ref), device_map=places, force_hooks=True)
    patched, alone = ct.apply_coda(dispatched), ct.apply_coda(copy.deepcopy(ref))
    assert all(type(m._hf_hook).__name__ == "AlignDevicesHook" for m in patched.model.layers)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    assert torch.equal(
        _step(patched, input_ids=ids, labels=ids), _step(alone, input_ids=ids, labels=ids)
    )
    grads = ct.hf_gradients(patched)
    for name, g in ct.hf_gradients(alone).items():
        assert torch.equal(grads[name], g), name
