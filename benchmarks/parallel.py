"""Training throughput and memory per GPU of each multi-GPU layout, against one GPU of the same launch.

    torchrun --nproc-per-node N benchmarks/parallel.py OUTDIR [model=anchor|k3_layer|tiny] [layouts=a,b]
                                                      [tokens=4096] [steps=5] [experts=64]

One training step = forward with labels, backward, AdamW step, on random tokens. Layouts (`LAYOUTS`):

- ``single``: rank 0 alone, the whole model on one GPU (the other ranks wait): the baseline.
- ``fsdp2``: `fully_shard` on every decoder layer and the root; each rank its own row.
- ``tp``: `from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`: KDA and MLA heads split over the
  ranks, every rank the same row.
- ``ep``: the experts placed over the ranks (`DistributedConfig(ep_size=N)`, all-to-all token dispatch, transformers
  >= 5.19; before that `tp_size=N, enable_expert_parallel=True`), every rank the same row.
- ``cp``: one row of N x `tokens` tokens split over the ranks (`kda_moe.distributed.context_parallel`), gradients
  summed over the ranks.
- ``hsdp``: a (replicate, shard) = (N / 2, 2) mesh: FSDP2 shards within each pair of ranks and replicates across the
  pairs (gradients reduce-scattered in a pair, all-reduced across pairs); each rank its own row.
- ``fsdp_x_cp``: a (dp, cp) = (N / 2, 2) mesh: FSDP2 over all ranks, each pair of ranks one row of 2 x `tokens` split.

Every rank holds `tokens` tokens of activations in every layout (tp / ep: the same ones). Throughput counts the
distinct tokens of a step over its median time; scaling efficiency = throughput / (N x the single GPU's). Peak memory
is the largest `torch.cuda.max_memory_allocated` over the ranks.

Models: ``anchor``, the 822M Kimi Linear config of `benchmarks/model.py` (6 KDA + 2 MLA layers, 64 experts top-8),
loaded from a random Kimi Linear checkpoint; ``k3_layer``, one Kimi K3 decoder layer (a KDA layer and a LatentMoE
layer at K3's widths, `experts` routed experts instead of 896 so that one GPU holds the baseline, vocabulary 32000);
``tiny``, a CPU-sized model for checking the script with gloo. bf16 weights on GPUs, fp32 on CPUs. Writes
OUTDIR/parallel.md and OUTDIR/parallel.json after each layout and prints the table last.
"""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

LAYOUTS = ("single", "fsdp2", "hsdp", "tp", "ep", "cp", "fsdp_x_cp")
MODELS = ("anchor", "k3_layer", "tiny")


def load_model_benchmark():
    """benchmarks/model.py, for the anchor config."""
    spec = importlib.util.spec_from_file_location("model_benchmark", Path(__file__).with_name("model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_config(name: str, experts: int):
    from kda_moe import KdaMoeTextConfig

    if name == "k3_layer":
        return KdaMoeTextConfig.kimi_k3(
            num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["sparse"], num_experts=experts,
            vocab_size=32000, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    return KdaMoeTextConfig(  # the test suite's tiny shapes, every feature on; 98 tokens split evenly under TP
        vocab_size=98, hidden_size=32, num_hidden_layers=5, linear_num_heads=2, linear_head_dim=8,
        num_attention_heads=2, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48,
        routed_expert_hidden_size=16, pad_token_id=0,
    )  # fmt: skip


def save_checkpoint(name: str, folder: Path, experts: int) -> None:
    """A random checkpoint of model `name` in `folder` (rank 0 writes it, every layout loads it)."""
    from kda_moe import KdaMoeForCausalLM

    torch.manual_seed(0)
    if name == "anchor":  # a Kimi Linear checkpoint, as benchmarks/model.py times it
        model_bench = load_model_benchmark()
        model_bench.kimi_linear_class()(model_bench.anchor_config()).save_pretrained(folder)
    else:
        KdaMoeForCausalLM(model_config(name, experts)).save_pretrained(folder)


def load(folder: Path, layout: str, world: int, device: torch.device, dtype: torch.dtype):
    """(model on `device` in training mode laid out as `layout`, the context-parallel group or None)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed import DistributedConfig

    from kda_moe import KdaMoeForCausalLM
    from kda_moe.compat import EXPERT_TOKEN_DISPATCH
    from kda_moe.distributed import context_parallel

    if layout in ("tp", "ep"):
        if layout == "tp":
            options = dict(tp_size=world)
        else:
            options = dict(ep_size=world, tp_plan={}) if EXPERT_TOKEN_DISPATCH else dict(tp_size=world, enable_expert_parallel=True)
        model = KdaMoeForCausalLM.from_pretrained(folder, dtype=dtype, distributed_config=DistributedConfig(**options))
        return model.train(), None
    model = KdaMoeForCausalLM.from_pretrained(folder, dtype=dtype).to(device).train()
    if layout == "single":  # the other ranks wait: balancing pools over nothing
        model.set_balancing_group(None)
        return model, None
    if layout == "cp":
        return context_parallel(model, dist.group.WORLD), dist.group.WORLD
    if layout == "fsdp_x_cp":
        mesh = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("dp", "cp"))
        shard_over = mesh._flatten("dp_cp")
    elif layout == "hsdp":
        shard_over = init_device_mesh(device.type, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        shard_over = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_over)
    fully_shard(model, mesh=shard_over)
    if layout != "fsdp_x_cp":
        return model, None
    return context_parallel(model, mesh), mesh.get_group("cp")


def training_step(model, layout: str, tokens: int, world: int, cp_group, device):
    """A closure running one training step of `layout` and the distinct tokens it trains on."""
    from kda_moe.distributed import shard_batch

    rank = dist.get_rank()
    rows_of_world = {"fsdp2": world, "hsdp": world, "cp": 1, "fsdp_x_cp": world // 2}.get(layout, 1)
    row_length = tokens * (dist.get_world_size(cp_group) if cp_group is not None else 1)
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(3, model.config.vocab_size, (rows_of_world, row_length), generator=generator)
    row = {"fsdp2": rank, "hsdp": rank, "fsdp_x_cp": rank // 2}.get(layout, 0)  # fsdp_x_cp: the mesh's dp index
    input_ids = rows[row : row + 1]
    batch = {"input_ids": input_ids, "labels": input_ids}
    if cp_group is not None:
        batch = shard_batch(batch, cp_group)
    batch = {name: value.to(device) if torch.is_tensor(value) else value for name, value in batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    # FSDP averages the gradients over all its ranks; a row's slices must add up instead: its loss counts cp times
    loss_scale = dist.get_world_size(cp_group) if layout == "fsdp_x_cp" else 1

    def step():
        (model(**batch).loss * loss_scale).backward()
        if layout == "cp":  # FSDP reduces the gradients itself; plain context parallelism sums them here
            for parameter in model.parameters():
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, rows_of_world * row_length


def timed(step, steps: int, device, together: bool) -> float:
    """Median seconds of `steps` steps after one warm-up step; `together`: every rank steps, each step starts at a
    barrier, and the slowest rank's median is returned on every rank."""
    times = []
    for index in range(steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        if together:
            dist.barrier()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index:
            times.append(time.perf_counter() - start)
    median = torch.tensor(sorted(times)[len(times) // 2])
    if together:
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def peak_memory(device, together: bool) -> float | None:
    """This rank's peak GB, or with `together` the largest over the ranks (None on CPUs)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 1e9, device=device)
    if together:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def run_layout(folder, layout, world, tokens, steps, device, dtype) -> dict:
    """{s, tok_s, peak_GB} of `layout`, on every rank. `single` runs on rank 0 while the other ranks wait."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    together = layout != "single"
    result = None
    if together or dist.get_rank() == 0:
        model, cp_group = load(folder, layout, world, device, dtype)
        step, distinct = training_step(model, layout, tokens, world, cp_group, device)
        seconds = timed(step, steps, device, together)
        result = dict(s=seconds, tok_s=distinct / seconds, peak_GB=peak_memory(device, together))
        del model, step
    shared = [result]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def table(results: dict, world: int) -> str:
    single = results.get("single", {}).get("tok_s")
    lines = ["| layout | GPUs | tokens/s | step s | peak GB per GPU | scaling efficiency vs 1 GPU |", "|---|---|---|---|---|---|"]
    for layout, r in results.items():
        gpus = 1 if layout == "single" else world
        efficiency = f"{r['tok_s'] / (gpus * single):.2f}" if single else "n/a"
        peak = "n/a" if r["peak_GB"] is None else f"{r['peak_GB']:.1f}"
        lines.append(f"| {layout} | {gpus} | {r['tok_s']:,.0f} | {r['s']:.3f} | {peak} | {efficiency} |")
    return "\n".join(lines)


def main(out, model="anchor", layouts=",".join(LAYOUTS), tokens=4096, steps=5, experts=64):
    if model not in MODELS:
        raise ValueError(f"model={model!r}: pick one of {', '.join(MODELS)}.")
    layouts = layouts.split(",")
    if unknown := [layout for layout in layouts if layout not in LAYOUTS]:
        raise ValueError(f"unknown layouts {unknown}: pick from {', '.join(LAYOUTS)}.")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if (paired := [layout for layout in layouts if layout in ("hsdp", "fsdp_x_cp")]) and world % 2:
        raise ValueError(f"{', '.join(paired)} pair the ranks: they need an even number of ranks, got {world}.")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    out = Path(out)
    folder = out / "checkpoint"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_checkpoint(model, folder, experts)
    dist.barrier()
    results = {}
    for layout in layouts:
        if rank == 0:
            print(f"{layout}: start", flush=True)
        results[layout] = run_layout(folder, layout, world, tokens, steps, device, dtype)
        if rank == 0:
            header = f"{world} ranks, {'GPU: ' + torch.cuda.get_device_name() if cuda else 'CPU (gloo)'}; model {model}"
            (out / "parallel.json").write_text(json.dumps(dict(world=world, model=model, tokens=tokens, results=results), indent=2))
            (out / "parallel.md").write_text(f"{header}, {tokens} tokens per rank\n\n{table(results, world)}\n")
    if rank == 0:
        print(table(results, world), flush=True)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    arguments = dict(arg.split("=", 1) for arg in sys.argv[2:])
    for name in ("tokens", "steps", "experts"):
        if name in arguments:
            arguments[name] = int(arguments[name])
    main(sys.argv[1], **arguments)
