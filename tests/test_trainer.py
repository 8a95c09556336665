"""A patched Hugging Face model in HF's ``Trainer`` (tiny random Llama, Qwen3 and Mistral
models built here, on the CPU in float64, reference and forced kernel paths): two optimizer
steps of two accumulated micro-batches each (the Trainer passes the token count of both,
``num_items_in_batch``), weight decay by the Trainer's name rule (norms exempt), then an
evaluation whose metric reads the logits. The losses, the metric and the trained weights equal
the unpatched model's under the same Trainer. Before session 21 the Trainer dropped
``input_ids`` from every batch (it keeps the columns the forward's signature names, and the
patched forward showed ``(*args, **kwargs)``) and decayed the patched layers' norms."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")  # installed by the dev extra: never skipped in CI
pytest.importorskip("accelerate")  # (the Trainer needs it; also in the dev extra)
from test_transformers import TOL, pair, rel_err, tiny_config  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402


class _Rows(torch.utils.data.Dataset):
    """Eight rows of 12 tokens, the first ``i % 4`` of row i not predicted: micro-batches
    with unequal token counts, so a per-micro-batch mean would differ from the Trainer's."""

    def __init__(self, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(0, vocab, (12,), generator=g) for _ in range(8)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        labels = self.rows[i].clone()
        labels[: i % 4] = -100
        return {"input_ids": self.rows[i], "labels": labels}


def _accuracy(pred) -> dict:
    """Next-token accuracy from the evaluation's logits."""
    hit = pred.predictions.argmax(-1)[:, :-1] == pred.label_ids[:, 1:]
    keep = pred.label_ids[:, 1:] != -100
    return {"accuracy": float(hit[keep].mean())}


def _train(model, out_dir, vocab: int):
    args = TrainingArguments(
        output_dir=str(out_dir),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        optim="sgd",  # (its update is linear in the gradient: round-off stays round-off)
        learning_rate=0.05,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        logging_steps=1,
        per_device_eval_batch_size=4,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    data = _Rows(vocab)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        compute_metrics=_accuracy,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, trainer.evaluate()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2", "llama-bias", "phi3"])
def test_the_trainer_trains_a_patched_model_as_the_unpatched_one(family, coda_path, tmp_path):
    cfg = tiny_config(family, **coda_path)
    ref, patched = pair(cfg, seed=5)
    losses_r, eval_r = _train(ref, tmp_path / "ref", cfg.vocab_size)
    losses_p, eval_p = _train(patched, tmp_path / "coda", cfg.vocab_size)
    assert len(losses_p) == len(losses_r) == 2
    for a, b in zip(losses_p, losses_r):
        assert abs(a - b) <= TOL * abs(b)
    assert abs(eval_p["eval_loss"] - eval_r["eval_loss"]) <= TOL * abs(eval_r["eval_loss"])
    assert eval_p["eval_accuracy"] == eval_r["eval_accuracy"]
    want, got = ref.state_dict(), patched.state_dict()
    assert got.keys() == want.keys()
    for key, w in want.items():
        assert rel_err(got[key], w) < TOL, key
