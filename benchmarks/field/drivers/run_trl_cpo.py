"""TRL: ``CPOTrainer`` on a tiny random GPT-2 and a made-up preference data set, as TRL's docs show it.

``CPOTrainer(model=..., args=CPOConfig(...), train_dataset=..., tokenizer=...)`` then ``train()``;
the data set has ``prompt``/``chosen``/``rejected`` columns. The tokenizer is a word-level one built
in memory (nothing is downloaded). On 0.8.3 the trainer stores the ``nll_loss`` metric with its graph
in ``_stored_metrics`` until the next log; 0.8.4 detaches it.
"""

from __future__ import annotations

import os
import random
import tempfile

import _probe
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from trl import CPOConfig, CPOTrainer

STEPS = int(os.environ.get("GRADGUARD_FIELD_STEPS", "24"))
WORDS = [f"w{i}" for i in range(60)]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


def dataset(n: int) -> Dataset:
    rng = random.Random(1)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    rows = [{"prompt": text(6), "chosen": " " + text(8), "rejected": " " + text(8)} for _ in range(n)]
    return Dataset.from_list(rows)


def main() -> None:
    _probe.install()
    torch.manual_seed(0)
    tok = tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory(prefix="field-trl-") as out:
        args = CPOConfig(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=4, max_length=32, max_prompt_length=16,
            use_cpu=True, report_to="none", save_strategy="no", seed=0, remove_unused_columns=False, disable_tqdm=True,
        )  # fmt: skip
        trainer = CPOTrainer(model=model, args=args, train_dataset=dataset(4 * STEPS), tokenizer=tok)
        trainer.train()
    _probe.finish(model)


if __name__ == "__main__":
    main()
