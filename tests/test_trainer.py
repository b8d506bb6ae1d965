"""`transformers.Trainer` drives kda-moe unchanged: bf16 (where the CPU has it), gradient accumulation, gradient
checkpointing, Quantile Balancing without a callback, and `resume_from_checkpoint` that continues exactly."""

import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file


def stride_dataset(num_rows=24, seq_len=16, vocab_size=97, seed=0):
    """Arithmetic token sequences (start + 2j): learnable in a few steps, so the loss visibly falls."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        start = int(torch.randint(0, vocab_size - 3, (1,), generator=generator))
        ids = [3 + (start + 2 * j) % (vocab_size - 3) for j in range(seq_len)]
        rows.append({"input_ids": ids, "labels": ids})
    return Dataset.from_list(rows)


def training_args(output_dir, **overrides):
    from transformers import TrainingArguments

    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def biases(model):
    return {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}


def logged_losses(trainer):
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_trainer_runs_with_gradient_accumulation_and_checkpointing(tmp_path, bf16):
    from transformers import Trainer

    if bf16 and not torch.backends.cpu.get_cpu_capability():
        pytest.skip("no CPU bf16 autocast")
    model = tiny_model(seed=0).train()
    layer_calls = []
    model.model.layers[1].self_attn.register_forward_hook(lambda *args: layer_calls.append(1))
    steps, accumulation = 4, 2
    args = training_args(
        tmp_path, max_steps=steps, gradient_accumulation_steps=accumulation, gradient_checkpointing=True, bf16=bf16
    )
    trainer = Trainer(model=model, args=args, train_dataset=stride_dataset())
    trainer.train()

    assert model.is_gradient_checkpointing
    # Each micro-batch runs layer 1's mixer twice: the forward and the checkpointed recomputation in the backward.
    assert len(layer_calls) == 2 * steps * accumulation
    losses = logged_losses(trainer)
    assert sorted(losses) == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses.values())
    assert losses[steps] < losses[1]
    # Balancing ran inside plain Trainer (no callback): every router bias moved, and stayed fp32.
    assert all(torch.count_nonzero(b) > 0 and b.dtype == torch.float32 for b in biases(model).values())


def test_resume_from_checkpoint_continues_the_loss_curve_exactly(tmp_path):
    from transformers import Trainer, TrainerCallback

    steps, saved_at = 6, 3
    biases_after_step = {}

    class RecordBiases(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            biases_after_step[state.global_step] = biases(model)

    # Uninterrupted run, saving a checkpoint half-way.
    model = tiny_model(seed=0).train()
    args = training_args(tmp_path / "a", max_steps=steps, save_strategy="steps", save_steps=saved_at)
    full = Trainer(model=model, args=args, train_dataset=stride_dataset(), callbacks=[RecordBiases()])
    full.train()
    checkpoint = tmp_path / "a" / f"checkpoint-{saved_at}"

    # The checkpoint holds the routing biases of that step (they are not parameters: no optimizer state has them).
    saved = load_file(checkpoint / "model.safetensors")
    for name, bias in biases_after_step[saved_at].items():
        assert torch.count_nonzero(bias) > 0 and torch.equal(saved[name], bias), name

    # A fresh process-like start from a differently initialised model resumes from the checkpoint.
    resumed_model = tiny_model(seed=123).train()
    args = training_args(tmp_path / "b", max_steps=steps, save_strategy="steps", save_steps=saved_at)
    resumed = Trainer(model=resumed_model, args=args, train_dataset=stride_dataset(), callbacks=[RecordBiases()])
    biases_after_step.clear()
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert sorted(biases_after_step) == list(range(saved_at + 1, steps + 1))  # only the remaining steps ran

    # The resumed log history is the checkpoint's (steps 1-3) followed by the newly trained steps 4-6.
    full_losses, resumed_losses = logged_losses(full), logged_losses(resumed)
    assert sorted(resumed_losses) == list(range(1, steps + 1))
    assert resumed_losses == full_losses
    for (name, a), (_, b) in zip(model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name
    for name, bias in biases(model).items():
        assert torch.equal(biases(resumed_model)[name], bias), name
