"""A transformers ``Trainer`` with gradient accumulation whose ``compute_loss`` keeps each micro-batch's outputs
for the step's logging: ``gradguard run --mode raise`` fails it inside the first optimizer step, naming the
holder; the same Trainer keeping ``loss.detach()`` passes, with final weights bitwise equal to the unwatched
run. No adapter knows this Trainer: only the watch's micro-batch clock stands between it and the growth.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _helpers import env, require_engine
from _tables import flat

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    KEEP = sys.argv[1]
    STEPS = []


    class Logging(transformers.Trainer):
        step_outputs = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            self.step_outputs.append(outputs.logits if KEEP == "outputs" else loss.detach())
            return (loss, outputs) if return_outputs else loss


    class Report(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            STEPS.append(len(Logging.step_outputs))  # the step's records, read for its log line
            Logging.step_outputs.clear()


    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 32, (8,), generator=g)), "labels": ids} for _ in range(64)]
    args = transformers.TrainingArguments(output_dir=sys.argv[2], use_cpu=True, max_steps=3,
                                          per_device_train_batch_size=2, gradient_accumulation_steps=8,
                                          report_to="none", save_strategy="no", disable_tqdm=True,
                                          logging_strategy="no")
    Logging(model=model, args=args, train_dataset=data, callbacks=[Report()]).train()
    print("STEPS", STEPS)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, sys.argv[3])
    """
)


def _run(tmp_path: Path, keep: str, watched: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    weights = tmp_path / f"{keep}-{watched}.pt"
    command = [sys.executable, str(script), keep, str(tmp_path / "out"), str(weights)]
    if watched:
        command = [sys.executable, "-m", "gradguard", "run", "--mode", "raise", *command[1:]]
    done = subprocess.run(command, capture_output=True, text=True, env=env(), timeout=600, cwd=tmp_path)
    return done, weights


def test_a_trainer_keeping_each_micro_batchs_outputs_fails_inside_its_first_step(tmp_path: Path) -> None:
    require_engine("transformers")
    done, _ = _run(tmp_path, "outputs", watched=True)
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert "STEPS" not in done.stdout  # the first optimizer step never completed
    assert "Logging.step_outputs[*]" in text and "across the micro-batches of one step" in flat(text), text
    assert "fix: detach before storing into Logging.step_outputs[0]" in text, text


def test_the_same_trainer_keeping_the_detached_loss_passes_with_equal_weights(tmp_path: Path) -> None:
    require_engine("transformers")
    plain, plain_weights = _run(tmp_path, "detached", watched=False)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    watched, watched_weights = _run(tmp_path, "detached", watched=True)
    assert watched.returncode == 0, watched.stdout + watched.stderr
    assert "STEPS [8, 8, 8]" in watched.stdout
    a, b = torch.load(plain_weights), torch.load(watched_weights)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
