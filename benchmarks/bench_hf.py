"""Hugging Face models as users train them: one step ``model(input_ids, labels=input_ids)
.loss.backward()`` at 4 x 4096 tokens, tokens/s and peak memory, for a Llama-3.2-1B-shaped
``LlamaForCausalLM``, a Qwen3-0.6B-shaped ``Qwen3ForCausalLM`` and a Qwen2.5-0.5B-shaped
``Qwen2ForCausalLM`` (random init, bf16, sdpa; on request, ``ON_REQUEST``, Llama-1B with
attention biases, a Phi-3-mini-shaped ``Phi3ForCausalLM``, a Gemma-3-1B-shaped
``Gemma3ForCausalLM`` and a Gemma-2-2B-shaped ``Gemma2ForCausalLM`` (its logits soft-capped;
their layers coda's since sessions 71-72), Qwen2.5-VL-3B's and Qwen3-VL-2B's text models in their
vision-language classes, text-only batches, an OLMo-2-1B-shaped ``Olmo2ForCausalLM`` and a
Phi-4-mini-shaped ``Phi3ForCausalLM``),
in one run: unpatched, under ``torch.compile`` (``model.model``; the logits and loss stay
eager, as users compile it), with Liger's instance patch (called as the others, and with
``use_cache=False``, which a patched model's training call implies), and patched by
``coda.transformers.apply_coda``, and patched with ``model.model`` then compiled (``_compiled``:
for the models whose loss alone coda takes, Inductor fusing HF's own layers around coda's
loss; session 70), and patched with HF's activation checkpointing on (what it
saves in memory and costs in time; ``_storing``: its first forward storing what only the
backward's rerun reads, as before session 64), and patched with the embedding's backward left as
torch's (``apply_coda(embedding=False)``). Every variant starts from the same weights. coda's and
Liger's rows also carry one step's per-kernel table and GPU idle time (after the timing).
With ``CODA_HF_AMP=1`` every variant is the fp32 model with its forward under bf16 autocast
(HF's Trainer with ``bf16=True``): rows ``hf/<shape>+amp/...``.

Each variant's peak memory is measured as if it were alone (``_common.PeakAlone``), then
every variant is timed in interleaved rounds (``_common.interleaved``), with the GPU's clock
and power over the round (``_common.clocked``: a step that runs at the power cap runs at a
lower clock, attention's kernels included). Liger's patch also
rebinds process-wide names (the model class's forward, RoPE), so ``LigerSwitch`` applies them
around Liger's own steps only.
"""

from __future__ import annotations

import copy
import functools

import torch

from benchmarks._common import (
    SKIPPED,
    PeakAlone,
    bench_long,
    bf16_autocast,
    clocked,
    interleaved,
    mixed_precision,
    out_of_time,
    progress,
    selected,
    where_time_goes,
)
from benchmarks._switches import storing_for_backward
from benchmarks.hf_models import (
    ON_REQUEST,
    SHAPES,
    batch_of,
    build,
)

# (run only when CODA_HF_PEERS names them; ``hf_coda_loss_alone``: ``layers=False``, the
# mixture-of-experts models' patch before session 81; ``hf_coda_liger_experts``: coda's patch
# over a model whose experts Liger's fused-MoE kernel runs, the two composed)
ON_REQUEST_PEERS = ("hf_coda_flex", "hf_liger_flex", "hf_coda_loss_alone", "hf_coda_liger_experts")
ON_REQUEST_PEERS += ("hf_coda_eager_experts_norm",)
LIGER_PEERS = ("hf_liger", "hf_liger_no_cache", "hf_liger_flex")  # (Liger's patch, three ways)
# the variants whose per-kernel tables pass 1 takes
PROFILED = ("hf_coda", "hf_coda_compiled", "hf_liger", "hf_liger_no_cache", *ON_REQUEST_PEERS)


def _module_state(module) -> dict:
    """Every attribute of a modeling module and of the classes it defines, by (owner, name)."""
    state = {(module, k): v for k, v in vars(module).items()}
    for cls in [v for v in vars(module).values() if isinstance(v, type)]:
        if cls.__module__ == module.__name__:
            state.update({(cls, k): v for k, v in vars(cls).items()})
    return state


class LigerSwitch:
    """Liger's instance patch also rebinds process-wide names (the causal LM class's forward,
    the RoPE function of the modeling module), which would change every other variant timed
    after it. This applies the patch once, records what it rebound, puts the originals back,
    and ``wrap`` runs Liger's step with its bindings and every other step without them."""

    def __init__(self, module, apply):
        self.module, self.apply = module, apply  # apply(model=...): the patch

    @classmethod
    def of(cls, family: str) -> "LigerSwitch":
        import importlib

        import liger_kernel.transformers as lk

        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        patch = {"gemma3": "gemma3_text"}.get(family, family)  # (its text-only model's patch)
        return cls(module, getattr(lk, f"apply_liger_kernel_to_{patch}"))

    def experts_only(self) -> "LigerSwitch":
        """The same patch reduced to Liger's MLP kernels (its fused experts, in an MoE model):
        no RoPE, norms or loss of its own."""
        kw = dict(rope=False, rms_norm=False, fused_linear_cross_entropy=False, swiglu=True)
        return LigerSwitch(self.module, functools.partial(self.apply, **kw))

    def patch(self, model):
        before = _module_state(self.module)
        self.apply(model=model)
        after = _module_state(self.module)
        self.theirs = {k: v for k, v in after.items() if before.get(k, self) is not v}
        self.ours = {k: before.get(k, self) for k in self.theirs}
        self._bind(self.ours)
        return model

    def _bind(self, state):
        for (owner, name), value in state.items():
            if value is self:  # a name the patch added
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    def wrap(self, step):
        def run():
            self._bind(self.theirs)
            try:
                step()
            finally:
                self._bind(self.ours)

        return run


def variants(family: str, base, liger: "LigerSwitch | None"):
    """(name, make) in run order; ``make`` returns a fresh model from ``base``'s weights."""
    import coda.transformers as ct
    from coda._hf_forward import text_model

    def coda_patch(m, **kw):  # (the loss alone where coda's layers do not apply: Gemma, VLMs)
        vlm = type(m).__name__ in ct.VISION_LANGUAGE
        text = type(text_model(m)).__name__ if vlm else None
        alone = type(m).__name__ in ct.LOSS_ONLY or text in ct.TEXT_LOSS_ONLY
        return ct.apply_coda(m, layers=not alone, **kw)

    def compiled(m):  # the decoder stack under torch.compile, as users compile an HF model
        m.model = torch.compile(m.model)
        return m

    def flex(m):  # HF's flex attention (Gemma 3's sliding windows as block-sparse masks)
        m.set_attn_implementation("flex_attention")
        return m

    def eager_experts_norm(m):  # (each MoE layer's ``rows_norm`` HF's module again)
        for layer in m.model.layers:
            if getattr(layer, "mlp_module", False):
                norm = layer.post_attention_layernorm
                layer.rows_norm = lambda x1, weight, norm=norm: norm(x1)
        return m

    def checkpointed():  # HF's activation checkpointing over the patched layers
        m = coda_patch(copy.deepcopy(base)).train()
        enable = getattr(m, "activation_checkpointing_enable", None)  # (5.24's name)
        (enable or m.gradient_checkpointing_enable)()
        return m

    out = [
        ("hf", lambda: copy.deepcopy(base)),
        ("hf_torch_compile", lambda: compiled(copy.deepcopy(base))),
        ("hf_coda", lambda: coda_patch(copy.deepcopy(base))),
        # the patch, then the stack compiled: for the loss-alone models (Gemma), Inductor's
        # fusion of HF's own layers around coda's loss (run 297); for the layers coda takes,
        # their uncompiled step (run 301, since the patched layers keep SDPA's causal flag)
        ("hf_coda_compiled", lambda: compiled(coda_patch(copy.deepcopy(base)))),
        ("hf_coda_checkpointed", checkpointed),
        # the same, its checkpoint's first forward storing what only the backward's rerun
        # reads (``storing_for_backward``), as before session 64
        ("hf_coda_checkpointed_storing", checkpointed),
        # the embedding's backward left as torch's (before session 29)
        ("hf_coda_torch_embedding", lambda: coda_patch(copy.deepcopy(base), embedding=False)),
        ("hf_coda_loss_alone", lambda: ct.apply_coda(copy.deepcopy(base), layers=False)),
        # an MoE model's norm before the experts HF's eager module, as before session 82
        ("hf_coda_eager_experts_norm", lambda: eager_experts_norm(coda_patch(copy.deepcopy(base)))),
    ]
    if liger is not None:
        out.append(("hf_liger", lambda: liger.patch(copy.deepcopy(base))))
        experts = liger.experts_only()  # (what it rebinds is put back, as ``patch`` does)

        def composed():  # coda's patch over Liger's fused experts
            return coda_patch(experts.patch(copy.deepcopy(base)))

        out.append(("hf_coda_liger_experts", composed))
        # the same, called with ``use_cache=False`` (README's tip), as coda's training call
        # runs by default: the like-for-like row
        out.append(("hf_liger_no_cache", lambda: liger.patch(copy.deepcopy(base))))
    # on request (named in CODA_HF_PEERS): the model switched to flex attention, then patched
    out.append(("hf_coda_flex", lambda: coda_patch(flex(copy.deepcopy(base)))))
    if liger is not None:
        out.append(("hf_liger_flex", lambda: liger.patch(flex(copy.deepcopy(base)))))
    # checked against every peer's name, Liger's too where it has no patch of this family (its
    # row already says so): a selection naming it still runs the others (run 317 lost a whole
    # suite to a family without one)
    chosen = selected("CODA_HF_PEERS", {name for name, _ in out} | set(LIGER_PEERS))
    default = [name for name, _ in out if name not in ON_REQUEST_PEERS]
    return [(name, make) for name, make in out if name in (chosen or default)]


def _step(model, ids, amp=False, **call):
    """One training step's call; with ``amp`` its forward under bf16 autocast, the backward
    outside it, as HF's Trainer runs a mixed-precision step."""

    def step():
        model.zero_grad(set_to_none=True)
        with bf16_autocast(ids.device.type, enabled=amp):
            loss = model(input_ids=ids, labels=ids, **call).loss
        loss.backward()

    return step


def training_step(shape_name: str, patch=None, layers: int | None = None, **call):
    """One training step (``_step``) of the bf16 HF model of ``SHAPES[shape_name]`` on the GPU
    at ``batch_of(shape_name)`` random tokens, built by ``build`` and patched in place by
    ``patch`` (e.g. ``coda.transformers.apply_coda``); ``layers`` overrides the depth;
    ``call``: the model call's keywords. What the probes time and profile."""
    family, shape = SHAPES[shape_name]
    if layers is not None:
        shape = {**shape, "num_hidden_layers": layers}
    model = build(family, shape, "cuda", torch.bfloat16)
    if patch is not None:
        model = patch(model)
    ids = torch.randint(0, shape["vocab_size"], batch_of(shape_name), device="cuda")
    return _step(model, ids, **call)


def step_peak(step, model, steps: int = 4) -> float:
    """Peak GiB of ``steps`` runs of ``step`` (the first ones compile) as if ``model`` were
    alone on the GPU (``PeakAlone``: the variants kept for interleaved timing not counted)."""
    model.zero_grad(set_to_none=True)
    with PeakAlone(model) as mem:
        for _ in range(steps):
            step()
    return mem.gib


def _one_held(held: dict):
    """``interleaved``'s timer: a variant's step timed, then its model's gradients dropped
    (``held``: step -> model), so the rounds hold one variant's gradients at a time (run 293
    ran out of memory at a 256k vocabulary with every variant's held)."""
    timer = clocked(bench_long)

    def run(step):
        try:
            return timer(step)
        finally:
            held[step].zero_grad(set_to_none=True)

    return run


def run() -> list[dict]:
    """Every shape but those run only on request (``ON_REQUEST``), or those named in
    ``CODA_HF_SHAPES`` (comma-separated keys of SHAPES)."""
    chosen = selected("CODA_HF_SHAPES", SHAPES)
    amp = mixed_precision("CODA_HF_AMP")
    rows = []
    for shape_name, (family, shape) in SHAPES.items():
        if shape_name not in (chosen or set(SHAPES) - set(ON_REQUEST)):
            continue
        name = shape_name + ("+amp" if amp else "")
        base = build(family, shape, "cuda", torch.float32 if amp else torch.bfloat16)
        ids = torch.randint(0, shape["vocab_size"], batch_of(shape_name), device="cuda")
        # pass 1, one variant at a time: its peak memory as if alone (``PeakAlone``) and its
        # kernel table; pass 2 times every variant in
        # interleaved rounds (``_common.interleaved``)
        steps, peaks, profiles, held = {}, {}, {}, {}
        try:
            liger = LigerSwitch.of(family)
        except (ImportError, AttributeError) as e:  # no liger-kernel here, or no patch of
            liger = None  # this family (Arcee's): the other variants still run, the row says
            rows.append(progress({"name": f"hf/{name}/hf_liger", "error": repr(e)[:300]}))
        for label, make in variants(family, base, liger):
            if out_of_time():
                rows.append({"name": f"hf/{name}/{label}", **SKIPPED})
                continue
            try:
                model = make()
                call = {"use_cache": False} if label.endswith("_no_cache") else {}
                step = _step(model, ids, amp, **call)
                step = liger.wrap(step) if label.startswith("hf_liger") else step
                step = storing_for_backward(step) if label.endswith("_storing") else step
                peaks[label] = step_peak(step, model)
                if label in PROFILED:
                    try:  # a failed profile must not cost the timing
                        profiles[label] = where_time_goes(step)
                    except Exception as e:
                        profiles[label] = {"profile_error": repr(e)[:300]}
                model.zero_grad(set_to_none=True)
                steps[label], held[step] = step, model
                alone = {"peak_gib": peaks[label], **profiles.get(label, {})}
                progress({"name": f"hf/{name}/{label}/alone", **alone})  # kept if the call is cut
            except Exception as e:  # recorded, never hidden (and kept if the suite raises)
                rows.append(progress({"name": f"hf/{name}/{label}", "error": repr(e)[:300]}))
            model = None
            torch.cuda.empty_cache()
        timed = {}
        if steps and not out_of_time():
            try:
                timed = interleaved(steps, timer=_one_held(held))
            except Exception as e:  # recorded, with each variant's peak alone; the next
                for label in steps:  # shape still runs
                    alone = {"peak_gib": peaks[label], **profiles.get(label, {})}
                    row = {"name": f"hf/{name}/{label}", **alone, "error": repr(e)[:300]}
                    rows.append(progress(row))
                steps = {}
        if steps and not timed:  # measured alone, then out of time before the rounds (run 153)
            for label in steps:
                alone = {"peak_gib": peaks[label], **profiles.get(label, {})}
                rows.append({"name": f"hf/{name}/{label}", **alone, **SKIPPED})
        times = {label: t["ms"] * 1e-3 for label, t in timed.items()}
        for label, t in timed.items():
            rows.append(
                progress(  # kept if the call is cut
                    {
                        "name": f"hf/{name}/{label}",
                        "tokens": ids.numel(),
                        **t,
                        "tokens_per_s": ids.numel() / (t["ms"] * 1e-3),
                        "peak_gib": peaks[label],
                        **profiles.get(label, {}),
                    }
                )
            )
        steps = timed = held = None
        peers = [t for k, t in times.items() if k in ("hf_torch_compile", *LIGER_PEERS)]
        for r in rows:
            if peers and r["name"].startswith(f"hf/{name}/") and "ms" in r:
                r["speedup_vs_best_peer"] = min(peers) / (r["ms"] * 1e-3)
        del base
        torch.cuda.empty_cache()
    return rows
