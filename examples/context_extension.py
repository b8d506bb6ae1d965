"""Context extension recipe: the 8K -> 64K -> 256K -> 1M curriculum, each stage continuing from the last one.

    python examples/context_extension.py --model path/to/8k-pretrained --output-dir outputs/context  # the recipe
    python examples/context_extension.py --scale-down                                                # CPU smoke test
    torchrun --nproc-per-node 4 examples/context_extension.py --scale-down             # context parallel, 4 ranks

Each stage is (sequence length, batch, steps, learning rate): `batch` packed rows of `seq_len` tokens per optimizer
step (one row per forward, the others by gradient accumulation; multiply by the data-parallel world size under
`accelerate launch` / `torchrun`). Every row packs several documents (`DataCollatorWithFlattening`: position ids
restart at 0 per document, so KDA resets its state and MLA attends within the document; nothing is spent on
padding). Gradient checkpointing recomputes the layer activations in the backward, and the loss never builds the
[tokens, vocab] logits: a training forward with labels computes it chunk by chunk from the final hidden states and
`lm_head.weight` (`config.fused_linear_cross_entropy`, on by default). A stage starts from the
previous stage's `save_pretrained` folder (router biases included) with `max_position_embeddings` raised to its
length; the default NoPE MLA needs no RoPE rescaling.

Launched by `torchrun` (WORLD_SIZE > 1), the example trains with context parallelism instead: every rank reads the
same rows and holds an equal slice of each (`kda_moe.distributed`: KDA passes its state from slice to slice, MLA
gathers the latent keys), the ranks sum their gradients and take the same optimizer step. A 1M-token row then needs
only 1M / world tokens of activations per GPU. (Data parallelism over several such groups is the next dimension of
the mesh; this example keeps one group.)

The stage lengths are the article's; batch / steps / learning rates below are a starting point to tune, not values
it gives. The documents here are windows of the bundled demo corpus, a stand-in for a long-document mixture.
"""

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from finetune import CHECKPOINTING


@dataclass(frozen=True)
class Stage:
    seq_len: int
    batch: int  # packed rows per optimizer step (per data-parallel rank)
    steps: int
    learning_rate: float


# Roughly constant tokens per step (~4M per rank group), a shorter and gentler stage as the length grows.
STAGES = [
    Stage(seq_len=8_192, batch=512, steps=2_000, learning_rate=2e-4),
    Stage(seq_len=65_536, batch=64, steps=1_000, learning_rate=1e-4),
    Stage(seq_len=262_144, batch=16, steps=500, learning_rate=5e-5),
    Stage(seq_len=1_048_576, batch=4, steps=250, learning_rate=3e-5),
]
# The same curriculum (same length ratios) for a tiny model on a CPU: seconds per stage.
SCALED_DOWN_STAGES = [
    Stage(seq_len=16, batch=2, steps=3, learning_rate=3e-3),
    Stage(seq_len=128, batch=2, steps=2, learning_rate=2e-3),
    Stage(seq_len=512, batch=1, steps=2, learning_rate=1e-3),
    Stage(seq_len=2_048, batch=1, steps=2, learning_rate=5e-4),
]


# ----------------------------------------------------------------------------------------------------------------
# Packed rows of documents
# ----------------------------------------------------------------------------------------------------------------


def packed_rows(token_stream: list[int], seq_len: int, num_rows: int, seed: int = 0) -> list[dict]:
    """`num_rows` rows of exactly `seq_len` tokens, each a list of documents (windows of the stream with lengths
    between seq_len / 8 and seq_len / 2; the last one cut to fit)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(num_rows):
        documents, filled = [], 0
        while filled < seq_len:
            length = int(torch.randint(max(2, seq_len // 8), max(3, seq_len // 2 + 1), (1,), generator=generator))
            length = min(length, seq_len - filled)
            start = int(torch.randint(0, len(token_stream) - length, (1,), generator=generator))
            documents.append(token_stream[start : start + length])
            filled += length
        rows.append({"documents": documents})
    return rows


class PackedRowCollator:
    """A batch of rows -> one flattened row (`DataCollatorWithFlattening`: input_ids, labels with -100 at each
    document start, position_ids restarting at 0 per document)."""

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_tensors="pt")

    def __call__(self, rows):
        return self.flatten([{"input_ids": document} for row in rows for document in row["documents"]])


# ----------------------------------------------------------------------------------------------------------------
# The curriculum
# ----------------------------------------------------------------------------------------------------------------


def corpus_tokens(tokenizer, min_tokens: int) -> list[int]:
    text = (Path(__file__).resolve().parent / "data" / "corpus.txt").read_text()
    ids = tokenizer(text)["input_ids"]
    return ids * max(1, math.ceil(min_tokens / len(ids)))


def tiny_model(tokenizer):
    from kda_moe import KdaMoeForCausalLM, KdaMoeTextConfig

    config = KdaMoeTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=4, linear_num_heads=2, linear_head_dim=8,
        num_attention_heads=2, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        moe_intermediate_size=16, intermediate_size=48, routed_expert_hidden_size=16, attn_res_block_size=2,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    return KdaMoeForCausalLM(config)


def train_with_trainer(model, rows, stage: Stage, index: int, output_dir: Path, progress: bool):
    """One stage with `Trainer` (one process, or data parallel under `accelerate launch`). Returns the step losses."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(output_dir / f"stage-{index}-trainer"),
        max_steps=stage.steps,
        per_device_train_batch_size=1,  # one packed row per forward ...
        gradient_accumulation_steps=stage.batch,  # ... `batch` rows per optimizer step
        learning_rate=stage.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, stage.steps // 20),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        remove_unused_columns=False,
        disable_tqdm=not progress,
        dataloader_num_workers=0,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned host memory only helps copies to a GPU
        seed=index,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=PackedRowCollator())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def train_context_parallel(model, rows, stage: Stage, group):
    """One stage with every row split across the ranks of `group`. Every rank reads the same rows and computes its
    slice's share of each row's loss (sum / the row's scored tokens); summing the gradients over the ranks gives the
    gradient of the whole rows, so every rank takes the same AdamW step (cosine schedule and clipping as Trainer's).
    Returns the step losses."""
    from transformers import get_cosine_schedule_with_warmup

    from kda_moe.distributed import context_parallel, shard_batch

    context_parallel(model, group)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=stage.learning_rate, weight_decay=0.0)  # Trainer's default
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, stage.steps // 20), stage.steps)
    collate, losses = PackedRowCollator(), []
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()  # as Trainer's bf16 switch
    for step in range(stage.steps):
        step_loss = torch.zeros((), device=device)
        for row in rows[step * stage.batch : (step + 1) * stage.batch]:
            inputs = {name: value.to(device) for name, value in shard_batch(collate([row]), group).items()}
            with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                loss = model(**inputs).loss / stage.batch
            loss.backward()
            step_loss += loss.detach()
        for parameter in model.parameters():
            if parameter.grad is not None:
                torch.distributed.all_reduce(parameter.grad, group=group)
        torch.distributed.all_reduce(step_loss, group=group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(step_loss.item())
    context_parallel(model, None)
    return losses


def run_stage(index: int, stage: Stage, init_from, tokenizer, output_dir: Path, progress: bool, group=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(init_from) if isinstance(init_from, (str, Path)) else init_from
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, stage.seq_len)
    getattr(model, f"{CHECKPOINTING}_enable")({"use_reentrant": False})
    model.train()
    rows = packed_rows(corpus_tokens(tokenizer, 4 * stage.seq_len), stage.seq_len, stage.batch * stage.steps, seed=index)
    if group is None:
        losses = train_with_trainer(model, rows, stage, index, output_dir, progress)
    else:
        model.to(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
        losses = train_context_parallel(model, rows, stage, group)
    stage_dir = output_dir / f"stage-{index}-{stage.seq_len}"
    main_process = group is None or torch.distributed.get_rank() == 0
    model.save_pretrained(stage_dir, is_main_process=main_process)
    if main_process:
        tokenizer.save_pretrained(stage_dir)
    if group is not None:
        torch.distributed.barrier()  # the next stage loads the folder on every rank
    documents = sum(len(row["documents"]) for row in rows)
    if main_process:
        print(f"stage {index}: {stage.seq_len} tokens x {stage.batch} rows x {stage.steps} steps, lr "
              f"{stage.learning_rate}, {documents / len(rows):.1f} documents per row, loss {losses[0]:.3f} -> "
              f"{losses[-1]:.3f}, saved to {stage_dir}")  # fmt: skip
    return {
        **asdict(stage),
        "init_from": str(init_from) if isinstance(init_from, (str, Path)) else "fresh model",
        "saved_to": str(stage_dir),
        "losses": losses,
        "documents_per_row": documents / len(rows),
        "gradient_checkpointing": getattr(model, f"is_{CHECKPOINTING}"),
        "context_parallel_ranks": 1 if group is None else torch.distributed.get_world_size(group),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the model to extend (default: a fresh model of the default config)")
    parser.add_argument("--tokenizer", default=None, help="folder or Hub id (default: the one kda-moe ships)")
    parser.add_argument("--output-dir", default="outputs/context_extension")
    parser.add_argument("--scale-down", "--tiny", dest="scale_down", action="store_true",
                        help="tiny model and SCALED_DOWN_STAGES (a CPU smoke test of the whole pipeline)")
    parser.add_argument("--no-progress-bar", action="store_true")
    args = parser.parse_args(argv)

    import kda_moe  # noqa: F401  (registers the Auto classes)
    from transformers import AutoTokenizer

    from kda_moe import KdaMoeForCausalLM, KdaMoeTextConfig
    from kda_moe.processing import TOKENIZER_DIR

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or str(TOKENIZER_DIR))
    stages = SCALED_DOWN_STAGES if args.scale_down else STAGES
    if args.model:
        init_from = args.model
    elif args.scale_down:
        init_from = tiny_model(tokenizer)
    else:
        init_from = KdaMoeForCausalLM(KdaMoeTextConfig(vocab_size=len(tokenizer)))
    output_dir = Path(args.output_dir)
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: one sequence split across every rank
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        group = torch.distributed.group.WORLD
    results = []
    for index, stage in enumerate(stages):
        progress = not args.no_progress_bar
        results.append(run_stage(index, stage, init_from, tokenizer, output_dir, progress, group))
        init_from = results[-1]["saved_to"]  # the next stage continues from this stage's checkpoint
    if group is None or torch.distributed.get_rank() == 0:
        (output_dir / "stages.json").write_text(json.dumps(results, indent=2))
    if group is not None:
        torch.distributed.destroy_process_group()
    return results


if __name__ == "__main__":
    main()
