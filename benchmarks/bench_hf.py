"""Hugging Face models as users train them: one step ``model(input_ids, labels=input_ids)
.loss.backward()`` at 4 x 4096 tokens, tokens/s and peak memory, for a Llama-3.2-1B-shaped
``LlamaForCausalLM`` and a Qwen3-0.6B-shaped ``Qwen3ForCausalLM`` (random init, bf16, sdpa),
in one run: unpatched, under ``torch.compile`` (``model.model``; the logits and loss stay
eager, as users compile it), with Liger's instance patch, and patched by
``coda.transformers.apply_coda``. Every variant starts from the same weights. coda's and
Liger's rows also carry one step's per-kernel table and GPU idle time (after the timing).

Liger's patch also replaces the model class's forward for the whole process, so it runs last.
"""

from __future__ import annotations

import copy

import torch

from benchmarks._common import SKIPPED, out_of_time, selected, where_time_goes

SHAPES = {
    "llama-3.2-1B": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-0.6B": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
}
BATCH, SEQ = 4, 4096
PROFILED = ("hf_coda", "hf_liger")  # per-kernel tables, after the timed steps


def build(family: str, shape: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if family == "llama" else (Qwen3Config, Qwen3ForCausalLM)
    )
    config = cfg_cls(**shape, max_position_embeddings=SEQ, attn_implementation="sdpa")
    torch.manual_seed(0)
    return model_cls(config).to(device, dtype)


def _liger_patch(family: str, model):
    import liger_kernel.transformers as lk

    patch = lk.apply_liger_kernel_to_llama if family == "llama" else lk.apply_liger_kernel_to_qwen3
    patch(model=model)
    return model


def variants(family: str, base):
    """(name, make) in run order; ``make`` returns a fresh model from ``base``'s weights."""
    import coda.transformers as ct

    def compiled():
        m = copy.deepcopy(base)
        m.model = torch.compile(m.model)
        return m

    out = [
        ("hf", lambda: copy.deepcopy(base)),
        ("hf_torch_compile", compiled),
        ("hf_coda", lambda: ct.apply_coda(copy.deepcopy(base))),
    ]
    try:
        import liger_kernel.transformers  # noqa: F401

        out.append(("hf_liger", lambda: _liger_patch(family, copy.deepcopy(base))))
    except ImportError:
        pass
    return out


def _step(model, ids):
    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    return step


def step_time(model, ids, warmup: int = 2, steps: int = 5):
    """Mean seconds of one forward+backward after ``warmup`` steps, and peak GiB."""
    step = _step(model, ids)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps * 1e-3, torch.cuda.max_memory_allocated() / 2**30


def run() -> list[dict]:
    """Every shape, or those named in ``CODA_HF_SHAPES`` (comma-separated keys of SHAPES)."""
    chosen = selected("CODA_HF_SHAPES", SHAPES)
    rows = []
    for name, (family, shape) in SHAPES.items():
        if chosen and name not in chosen:
            continue
        base = build(family, shape, "cuda", torch.bfloat16)
        ids = torch.randint(0, shape["vocab_size"], (BATCH, SEQ), device="cuda")
        times = {}
        for label, make in variants(family, base):
            if out_of_time():
                rows.append({"name": f"hf/{name}/{label}", **SKIPPED})
                continue
            model, profile = None, {}
            try:
                model = make()
                seconds, peak = step_time(model, ids)
                if label in PROFILED:
                    try:  # a failed profile must not cost the timing
                        profile = where_time_goes(_step(model, ids))
                    except Exception as e:
                        profile = {"profile_error": repr(e)[:300]}
            except Exception as e:  # recorded, never hidden
                rows.append({"name": f"hf/{name}/{label}", "error": repr(e)[:300]})
                continue
            finally:
                del model
                torch.cuda.empty_cache()
            times[label] = seconds
            rows.append(
                {
                    "name": f"hf/{name}/{label}",
                    "tokens": BATCH * SEQ,
                    "ms": seconds * 1e3,
                    "tokens_per_s": BATCH * SEQ / seconds,
                    "peak_gib": peak,
                    **profile,
                }
            )
        peers = [t for k, t in times.items() if k in ("hf_torch_compile", "hf_liger")]
        for r in rows:
            if peers and r["name"].startswith(f"hf/{name}/") and "ms" in r:
                r["speedup_vs_best_peer"] = min(peers) / (r["ms"] * 1e-3)
        del base
        torch.cuda.empty_cache()
    return rows
