"""transformers: ``Trainer`` fine-tuning a tiny random BERT classifier, as the docs of the 3.x releases show.

``Trainer(model=..., args=TrainingArguments(...), train_dataset=...)`` then ``train()``, the data set a
list of ``{"input_ids", "label"}`` features collated by the default collator. On 3.1.0 ``train()``
adds each step's loss, graph included, to ``tr_loss``; 3.2.0's ``training_step`` returns it detached.
The remedy gradguard names (``_probe.REMEDY``): a ``Trainer`` whose ``training_step`` returns the loss detached.
"""

from __future__ import annotations

import os
import tempfile

import _probe
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

STEPS = int(os.environ.get("GRADGUARD_FIELD_STEPS", "24"))
BATCH, SEQ, VOCAB = 8, 32, 100


def detaching_trainer() -> type[Trainer]:
    """The remedy: a ``Trainer`` whose ``training_step`` returns the loss detached (made only when applied:
    gradguard names a program's override of ``training_step`` where one exists)."""

    class DetachingTrainer(Trainer):
        def training_step(self, model, inputs):  # type: ignore[no-untyped-def]
            return super().training_step(model, inputs).detach()

    return DetachingTrainer


def main() -> None:
    _probe.install()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=SEQ, num_labels=2)  # fmt: skip
    model = BertForSequenceClassification(config)
    data = torch.Generator().manual_seed(1)
    features = [
        {
            "input_ids": torch.randint(0, VOCAB, (SEQ,), generator=data),
            "label": int(torch.randint(0, 2, (), generator=data)),
        }
        for _ in range(BATCH * STEPS)
    ]
    with tempfile.TemporaryDirectory(prefix="field-hf-") as out:
        args = TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=BATCH, no_cuda=True, seed=0,
            disable_tqdm=True,
        )  # fmt: skip
        trainer = detaching_trainer() if _probe.REMEDY else Trainer
        trainer(model=model, args=args, train_dataset=features).train()
    _probe.finish(model)


if __name__ == "__main__":
    main()
