"""Fine-tune a kda-moe model on a local JSONL file with `datasets` + `Trainer`, and report perplexity with `evaluate`.

    python examples/finetune.py                                  # default config, bundled keeper's-log JSONL
    python examples/finetune.py --model outputs/quickstart/model --lora --output-dir outputs/finetune
    python examples/finetune.py --train-file my.jsonl --validation-file my_val.jsonl --text-field text

Every record's `--text-field` is tokenized (end-of-text appended), the stream is cut into blocks of `--block-size`
tokens, and `Trainer` trains on them with its progress bar. Perplexity (before and after) comes from
`examples/metrics/perplexity`, a local `evaluate` metric fed with per-sequence log-likelihood sums, so nothing is
fetched from the Hub. `--lora` trains a PEFT LoRA adapter (the recommended targets below) instead of every weight.
"""

import argparse
import json
import math
import os
import warnings
from pathlib import Path

import torch
from transformers import PreTrainedModel

EXAMPLES = Path(__file__).resolve().parent
DATA = EXAMPLES / "data"
PERPLEXITY_METRIC = EXAMPLES / "metrics" / "perplexity"

# LoRA targets (PEFT): KDA q/k/v/o and its gate projections, MLA's low-rank query/key-value and output projections,
# the dense MLP and shared experts (gate/up/down_proj), the LatentMoE latent projections, and the fused routed experts
# through `target_parameters` (one low-rank update per expert). The router ("gate") goes into `modules_to_save`: it
# is tiny, and saving it puts the Quantile Balancing biases (which keep adapting in training mode) into the adapter,
# so base + adapter routes exactly like the model that was trained.
LORA_TARGET_MODULES = [
    "q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj",  # KDA (g_proj: MLA too)
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA
    "gate_proj", "up_proj", "down_proj",  # dense MLP and shared experts
    "latent_down_proj", "latent_up_proj",  # LatentMoE
]  # fmt: skip
LORA_TARGET_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
LORA_MODULES_TO_SAVE = ["gate"]

# What transformers calls gradient checkpointing on 5.17 it calls activation checkpointing on newer versions, where
# the old names (`TrainingArguments(gradient_checkpointing=...)`, `model.gradient_checkpointing_enable()`,
# `model.is_gradient_checkpointing`) raise FutureWarnings. The examples use whichever name this version has.
CHECKPOINTING = (
    "activation_checkpointing" if hasattr(PreTrainedModel, "activation_checkpointing_enable") else "gradient_checkpointing"
)


def lora_config(r: int = 8, alpha: int = 16, **overrides):
    from peft import LoraConfig

    values = dict(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=LORA_TARGET_MODULES,
        target_parameters=LORA_TARGET_PARAMETERS,
        modules_to_save=LORA_MODULES_TO_SAVE,
        task_type="CAUSAL_LM",
    )
    values.update(overrides)
    return LoraConfig(**values)


def with_lora(model, r: int = 8):
    """`model` wrapped by PEFT with a LoRA adapter of rank `r` on the recommended targets."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        # peft reads `model.is_gradient_checkpointing`, which newer transformers versions deprecate: peft's warning
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(model, lora_config(r=r))


def load_tokenizer(path=None):
    """The tokenizer at `path` (a folder or Hub id), by default the one shipped with kda-moe."""
    from transformers import AutoTokenizer

    from kda_moe.processing import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(str(path or TOKENIZER_DIR))


def tokenized_blocks(dataset, tokenizer, block_size: int, text_field: str = "text"):
    """Tokenize every record (+ end-of-text), concatenate, and cut into `block_size` blocks with `labels`."""

    def tokenize(batch):
        return {"input_ids": [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] for text in batch[text_field]]}

    def group(batch):
        stream = [token for ids in batch["input_ids"] for token in ids]
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    tokenized = dataset.map(tokenize, batched=True, remove_columns=dataset.column_names)
    return tokenized.map(group, batched=True, batch_size=1000, remove_columns=tokenized.column_names)


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per sequence [summed next-token NLL, scored-token count]: [B, T, V], [B, T] -> [B, 2] (fp32)."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
    scored = labels != -100
    return torch.stack([(nll * scored).sum(-1), scored.sum(-1).float()], dim=-1)


def perplexity_metric():
    """`compute_metrics` and `preprocess_logits_for_metrics` for `Trainer`, backed by the local evaluate metric."""
    import evaluate

    metric = evaluate.load(str(PERPLEXITY_METRIC))

    def preprocess_logits_for_metrics(logits, labels):
        logits = logits[0] if isinstance(logits, tuple) else logits
        return sequence_nll(logits, labels)  # keep [B, 2] per batch instead of the [B, T, V] logits

    def compute_metrics(eval_prediction):
        sums = eval_prediction.predictions.reshape(-1, 2)
        return metric.compute(nll_sum=sums[:, 0].tolist(), token_count=sums[:, 1].astype("int64").tolist())

    return compute_metrics, preprocess_logits_for_metrics


def build_model(model_path: str | None, tokenizer, tiny: bool = False):
    import kda_moe  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    from kda_moe import KdaMoeForCausalLM, KdaMoeTextConfig

    if model_path:
        return AutoModelForCausalLM.from_pretrained(model_path)
    sizes = dict(hidden_size=64, linear_num_heads=2, num_attention_heads=2, moe_intermediate_size=32, routed_expert_hidden_size=32)
    sizes = sizes if tiny else {}
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return KdaMoeForCausalLM(KdaMoeTextConfig(vocab_size=len(tokenizer), **ids, **sizes))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="folder or Hub id to start from (default: a fresh default config)")
    parser.add_argument("--tokenizer", default=None, help="folder or Hub id (default: the one kda-moe ships)")
    parser.add_argument("--train-file", default=str(DATA / "keeper_log_train.jsonl"))
    parser.add_argument("--validation-file", default=str(DATA / "keeper_log_validation.jsonl"))
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--output-dir", default="outputs/finetune")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--learning-rate", type=float, default=None, help="default 2e-3 (3e-3 with --lora)")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter instead of every weight")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a very small model (smoke tests)")
    parser.add_argument("--no-progress-bar", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from datasets import load_dataset
    from transformers import Trainer, TrainingArguments, default_data_collator, set_seed

    set_seed(args.seed)
    tokenizer = load_tokenizer(args.tokenizer)
    raw = load_dataset("json", data_files={"train": args.train_file, "validation": args.validation_file})
    data = {split: tokenized_blocks(raw[split], tokenizer, args.block_size, args.text_field) for split in raw}
    model = build_model(args.model, tokenizer, tiny=args.tiny)
    if args.lora:
        model = with_lora(model, r=args.lora_rank)
        model.print_trainable_parameters()

    compute_metrics, preprocess_logits_for_metrics = perplexity_metric()
    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate or (3e-3 if args.lora else 2e-3),
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 10),
        logging_steps=max(1, args.max_steps // 10),
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        bf16=use_bf16,
        seed=args.seed,
        disable_tqdm=args.no_progress_bar,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned host memory only helps copies to a GPU
        **{CHECKPOINTING: args.gradient_checkpointing},
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        data_collator=default_data_collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )
    before = trainer.evaluate()
    print(f"validation perplexity before: {before['eval_perplexity']:.2f}")
    trainer.train()
    after = trainer.evaluate()
    print(f"validation perplexity after : {after['eval_perplexity']:.2f} (exp(eval_loss) = {math.exp(after['eval_loss']):.2f})")

    trainer.save_model(args.output_dir)  # full model: config, weights, model card; LoRA: the adapter
    tokenizer.save_pretrained(args.output_dir)
    (Path(args.output_dir) / "metrics.json").write_text(json.dumps({"before": before, "after": after}, indent=2))
    print(f"saved to {os.path.abspath(args.output_dir)} (metrics.json: perplexity before / after)")
    return {"before": before, "after": after, "trainer": trainer}


if __name__ == "__main__":
    main()
