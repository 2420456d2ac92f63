"""HF ``transformers.Trainer`` on a tiny randomly initialised Llama (no download), with gradient
accumulation over two micro-batches and loss logging: the Trainer's own bookkeeping (``tr_loss``,
``log_history``) keeps detached values only."""

import logging
import tempfile

import torch

REQUIRES = ("transformers", "accelerate")

torch.set_num_threads(1)


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (12,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def main() -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM, PrinterCallback, Trainer, TrainingArguments

    for name in ("transformers", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=3,
            learning_rate=1e-2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.remove_callback(PrinterCallback)  # the logs are kept in log_history, not printed
        trainer.train()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


RESULT = main()
