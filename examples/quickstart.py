"""Quickstart: build a small kda-moe model from the default config, train it briefly, save, reload, generate.

    python examples/quickstart.py [--steps 60] [--output-dir outputs/quickstart]

The task is synthetic copying (the second half of every sequence repeats the first), which a model only solves by
recalling earlier tokens through its KDA / MLA layers, so the falling loss shows the mixers at work. Runs on CPU in
about a minute; uses the GPU when one is present.
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

import kda_moe  # noqa: F401  (registers the Auto classes)
from kda_moe import KdaMoeForCausalLM, KdaMoeTextConfig


def copy_task_batch(batch_size: int, half: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    first = torch.randint(3, vocab_size, (batch_size, half), generator=generator)
    return torch.cat([first, first], dim=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--output-dir", default="outputs/quickstart")
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    config = KdaMoeTextConfig(vocab_size=64, hidden_size=128, num_hidden_layers=4)
    model = KdaMoeForCausalLM(config).to(device)
    print(f"kda-moe {kda_moe.__version__}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          f"layers {config.layer_types}, device {device}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    model.train()
    start = time.time()
    for step in range(1, args.steps + 1):
        input_ids = copy_task_batch(16, 16, config.vocab_size, generator).to(device)
        labels = input_ids.clone()
        labels[:, :16] = -100  # score only the copied half
        loss = model(input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 10 == 0:
            loads = model.router_load_statistics()
            worst = max(stats["max_load"] / stats["mean_load"] for stats in loads.values())
            print(f"step {step:4d}  loss {loss.item():.3f}  max/mean expert load {worst:.2f}  {time.time() - start:.0f}s")

    model.save_pretrained(args.output_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(args.output_dir).to(device).eval()
    prompt = copy_task_batch(1, 16, config.vocab_size, generator)[:, :17].to(device)
    generated = reloaded.generate(prompt, max_new_tokens=15, do_sample=False, eos_token_id=None)
    print("prompt   :", prompt[0, :16].tolist())
    print("generated:", generated[0, 16:].tolist())


if __name__ == "__main__":
    main()
