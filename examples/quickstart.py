"""Quickstart: train a small kda-moe model with Trainer, save it with a model card, reload it, generate, LoRA-tune it.

    python examples/quickstart.py [--steps 120] [--lora-steps 40] [--output-dir outputs/quickstart]

1. Build a model from the default `KdaMoeTextConfig` (every K3 feature on: KDA + gated MLA, Block AttnRes,
   LatentMoE with SiTU-GLU and Quantile Balancing) and the tokenizer shipped with the package (`kda_moe.processing`).
2. Train it with `transformers.Trainer` (progress bar, cosine schedule) on the bundled corpus
   `examples/data/corpus.txt` until the loss has clearly fallen; log the experts' max / mean load on the way.
3. `save_pretrained` (config, weights with the router biases, model card `README.md`), reload with
   `AutoModelForCausalLM`, and generate.
4. Fine-tune a PEFT LoRA adapter (attention, shared and routed experts) on a different text, the keeper's log in
   `examples/data/keeper_log_train.jsonl`, and show that the adapter changed the output for the same prompt.

About two minutes on a laptop CPU; on a machine with a CUDA GPU the same command trains there (bf16 where supported).
A `summary.json` in the output folder records the losses and the generations. It needs only the base install
(`bash install.sh`): the data are plain PyTorch datasets, so neither `datasets` nor `evaluate` is imported.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from finetune import DATA, load_tokenizer, with_lora
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments, default_data_collator

import kda_moe  # noqa: F401  (registers the Auto classes)
from kda_moe import KdaMoeForCausalLM, KdaMoeTextConfig
from kda_moe.model_cards import write_model_card

PROMPT = "Day 12. Wind from the"


class ExpertLoadLogger(TrainerCallback):
    """Adds the worst max/mean expert load of the last training forward to Trainer's logs."""

    def on_log(self, args, state, control, model=None, logs=None, **kwargs):
        loads = model.router_load_statistics() if model is not None and hasattr(model, "router_load_statistics") else {}
        loads = {name: s for name, s in loads.items() if "original_module" not in name}  # PEFT's idle router copy
        if logs is not None and loads:
            logs["max/mean expert load"] = round(max(s["max_load"] / s["mean_load"] for s in loads.values()), 2)


class TokenWindows(torch.utils.data.Dataset):
    """Causal-LM examples (labels = inputs) cut from one token stream: `seq_len` tokens every `stride` tokens."""

    def __init__(self, ids: list[int], seq_len: int, stride: int):
        self.windows = torch.tensor(ids).unfold(0, seq_len, stride)  # [num_windows, seq_len]

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


def corpus_windows(tokenizer, seq_len: int) -> TokenWindows:
    """Overlapping windows over the tokenized corpus (a small corpus, so overlap gives more examples)."""
    ids = tokenizer((DATA / "corpus.txt").read_text())["input_ids"]
    return TokenWindows(ids, seq_len, stride=seq_len // 4)


def jsonl_blocks(tokenizer, path: Path, seq_len: int) -> TokenWindows:
    """Every record's `text` + end-of-text, concatenated and cut into `seq_len` blocks."""
    records = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    stream = [token for text in records for token in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    return TokenWindows(stream, seq_len, stride=seq_len)


def train(model, dataset, output_dir: Path, steps: int, batch_size: int, learning_rate: float, progress: bool):
    args = TrainingArguments(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 20),
        weight_decay=0.01,
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        seed=0,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned host memory only helps copies to a GPU
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator, callbacks=[ExpertLoadLogger()])
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def generate(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120, help="pre-training steps on the bundled corpus")
    parser.add_argument("--lora-steps", type=int, default=40, help="LoRA fine-tuning steps on the keeper's log")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--output-dir", default="outputs/quickstart")
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)
    output_dir = Path(args.output_dir)
    start = time.time()

    # 1. model from the default config + the shipped tokenizer
    torch.manual_seed(0)
    tokenizer = load_tokenizer()
    config = KdaMoeTextConfig(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = KdaMoeForCausalLM(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"kda-moe {kda_moe.__version__}: {model.num_parameters() / 1e6:.2f}M parameters, layers {config.layer_types}, "
          f"MLPs {config.mlp_layer_types}, {config.num_experts} experts top-{config.num_experts_per_tok}, device {device}")

    # 2. pre-train with Trainer on the bundled corpus
    corpus = corpus_windows(tokenizer, args.seq_len)
    print(f"\n== training on examples/data/corpus.txt ({len(corpus)} windows of {args.seq_len} tokens) ==")
    losses = train(model, corpus, output_dir / "trainer", args.steps, args.batch_size, 3e-3, not args.no_progress_bar)
    print(f"loss: first logged {losses[0]:.3f} -> final {losses[-1]:.3f}")

    # 3. save (with a model card), reload with the Auto class, generate
    model_dir = output_dir / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    write_model_card(
        model,
        model_dir,
        training_summary=f"`examples/quickstart.py`: {args.steps} Trainer steps of {args.batch_size} x {args.seq_len} "
        f"tokens on the bundled demo corpus (loss {losses[0]:.2f} -> {losses[-1]:.2f}). A demo, not a useful model.",
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device)
    base_text = generate(model, tokenizer, PROMPT, args.max_new_tokens)
    print(f"\nsaved to {model_dir} (README.md = model card), reloaded as {type(model).__name__}")
    print(f"generate   : {PROMPT!r} -> {base_text!r}")

    # 4. LoRA on attention + shared / routed experts, trained on a different text
    log = jsonl_blocks(tokenizer, DATA / "keeper_log_train.jsonl", args.seq_len)
    lora_model = with_lora(model, r=8)
    print(f"\n== LoRA fine-tuning on examples/data/keeper_log_train.jsonl ({len(log)} blocks) ==")
    lora_model.print_trainable_parameters()
    lora_losses = train(lora_model, log, output_dir / "lora-trainer", args.lora_steps, args.batch_size, 3e-3, not args.no_progress_bar)
    lora_model.save_pretrained(output_dir / "lora-adapter")
    lora_text = generate(lora_model, tokenizer, PROMPT, args.max_new_tokens)
    with lora_model.disable_adapter():
        without = generate(lora_model, tokenizer, PROMPT, args.max_new_tokens)
    print(f"LoRA loss: first logged {lora_losses[0]:.3f} -> final {lora_losses[-1]:.3f}")
    print(f"without adapter: {PROMPT!r} -> {without!r}")
    print(f"with adapter   : {PROMPT!r} -> {lora_text!r}")
    print(f"the adapter changed the output: {lora_text != without}")

    summary = {
        "device": device,
        "losses": losses,
        "lora_losses": lora_losses,
        "prompt": PROMPT,
        "base_generation": base_text,
        "generation_without_adapter": without,
        "lora_generation": lora_text,
        "adapter_changed_output": lora_text != without,
        "seconds": round(time.time() - start, 1),
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\ndone in {summary['seconds']:.0f}s; outputs in {output_dir}/")
    return summary


if __name__ == "__main__":
    main()
