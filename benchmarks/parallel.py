"""Training throughput and memory per GPU of each multi-GPU layout, against one GPU of the same launch.

    torchrun --nproc-per-node N benchmarks/parallel.py OUTDIR [model=anchor|k3_layer|tiny] [layouts=a,b]
                                                      [tokens=4096] [steps=5] [experts=64] [frozen=none|experts]

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

The ``single`` layout also splits its step (`split_step`): forward, backward and optimizer seconds (medians over the
steps, the device synchronised at each phase boundary; the step's seconds are the same steps' start-to-end medians),
and bytes of the parameters, gradients, AdamW state, the tensors autograd saves for the backward (its saved-tensor
hooks, parameters left out) and, on GPUs, the peak of forward + backward over what was allocated before the forward
(saved activations, transients and the gradients as the backward writes them). The same figures, optimizer seconds
and peak aside, are given for every decoder layer, its attention (KDA or MLA) and its MLP (dense, or MoE / LatentMoE)
by module hooks (full backward hooks time the backward). A second table and ``single.phases`` / ``single.parts`` in the
json hold them.

``experts`` sets the routed experts of ``k3_layer`` and ``tiny`` (K3 has 896, top-16). At K3's widths a LatentMoE
expert holds 3 x 3072 x 3584 weights: 66 MB in bf16, about 264 MB with its gradient and two AdamW moments, so an H100
(80 GB) trains on the order of 200 experts next to the rest of the layer at 4096 tokens and an H200 about twice that.
``frozen=experts`` freezes the routed experts' weights (as when adapters are trained around them): they take no
gradient and no AdamW state, so that K3's 896 experts (59 GB in bf16) can run forward and backward on one GPU. The checkpoint
is written in the run's dtype (bf16 on GPUs); a run of the ``single`` layout alone writes none and builds the model
on the device (a 896-expert checkpoint would not fit the disk of a GPU machine lent here).
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


def save_checkpoint(name: str, folder: Path, experts: int, dtype: torch.dtype = torch.float32) -> None:
    """A random checkpoint of model `name` in `folder` (rank 0 writes it, every layout loads it); ours built and
    written in `dtype`, so that host memory and disk hold a many-expert layer once at the run's width."""
    if name == "anchor":  # a Kimi Linear checkpoint, as benchmarks/model.py times it
        torch.manual_seed(0)
        model_bench = load_model_benchmark()
        model_bench.kimi_linear_class()(model_bench.anchor_config()).save_pretrained(folder)
        return
    build_on_device(name, experts, torch.device("cpu"), dtype).save_pretrained(folder)


def build_on_device(name: str, experts: int, device: torch.device, dtype: torch.dtype):
    """Model `name` built with random weights directly on `device` in `dtype` (no checkpoint)."""
    from kda_moe import KdaMoeForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return KdaMoeForCausalLM(model_config(name, experts))
    finally:
        torch.set_default_dtype(default)


def freeze(model, frozen: str):
    """``frozen="experts"``: the routed experts' weights take no gradient (nor AdamW state)."""
    if frozen == "experts":
        for name, parameter in model.named_parameters():
            if ".mlp.experts." in name:
                parameter.requires_grad_(False)
    return model


def load(folder: Path | tuple[str, int], layout: str, world: int, device: torch.device, dtype: torch.dtype):
    """(model on `device` in training mode laid out as `layout`, the context-parallel group or None); `folder`: the
    checkpoint, or (model name, experts) to build the model on the device instead (the single layout)."""
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
    if isinstance(folder, tuple):
        model = build_on_device(*folder, device, dtype).train()
    else:
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
    """(forward, backward, optimizer_step) closures of one training step of `layout` (forward returns the loss that
    backward takes), the optimizer, and the distinct tokens a step trains on."""
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
    optimizer = torch.optim.AdamW([parameter for parameter in model.parameters() if parameter.requires_grad], lr=1e-5)

    # FSDP averages the gradients over all its ranks; a row's slices must add up instead: its loss counts cp times
    loss_scale = dist.get_world_size(cp_group) if layout == "fsdp_x_cp" else 1

    def forward():
        return model(**batch).loss * loss_scale

    def backward(loss):
        loss.backward()
        if layout == "cp":  # FSDP reduces the gradients itself; plain context parallelism sums them here
            for parameter in model.parameters():
                if parameter.grad is not None:
                    dist.all_reduce(parameter.grad)

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return (forward, backward, optimizer_step), optimizer, rows_of_world * row_length


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
    slowest = torch.tensor(median(times))
    if together:
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def peak_memory(device, together: bool) -> float | None:
    """This rank's peak GB, or with `together` the largest over the ranks (None on CPUs)."""
    if device.type != "cuda":
        return None
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 1e9, device=device)
    if together:
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def model_parts(model) -> dict:
    """{name: module} of every decoder layer, its attention and its MLP, named by kind ("layer 0", "layer 0 KDA",
    "layer 0 LatentMoE")."""
    config = model.config
    parts = {}
    for index, layer in enumerate(model.model.layers):
        attention = "KDA" if config.layer_types[index] == "linear_attention" else "MLA"
        if config.mlp_layer_types[index] == "dense":
            mlp = "dense MLP"
        else:
            mlp = "LatentMoE" if getattr(config, "routed_expert_hidden_size", None) else "MoE"
        parts[f"layer {index}"] = layer
        parts[f"layer {index} {attention}"] = layer.self_attn
        parts[f"layer {index} {mlp}"] = layer.mlp
    return parts


class Clock:
    """Marks on the device's timeline: CUDA events on GPUs (read once the step has synchronised), host time on CPUs."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


def tensor_bytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def median(values):
    return sorted(values)[len(values) // 2] if values else None


def split_step(model, phases, optimizer, steps: int, device) -> dict:
    """The single layout's step, split: {s, fwd_s, bwd_s, opt_s (medians of `steps` steps after a warm-up step, the
    device synchronised at each phase boundary), param_bytes, grad_bytes, optim_bytes, saved_bytes (the warm-up step),
    fwd_bwd_peak_bytes (GPUs, the largest over the timed steps; None on CPUs), peak_GB (since the last reset of the
    peak statistics), parts: {name: the same figures but the optimizer's and the peak}} of `model_parts(model)`."""
    forward, backward, optimizer_step = phases
    cuda = device.type == "cuda"
    parts, clock = model_parts(model), Clock(device)
    marks = {name: {} for name in parts}
    stack = []  # the parts whose forward is running, outermost first
    saved = {name: {} for name in ("model", *parts)}  # storage address -> bytes the forward keeps for the backward
    parameter_storages = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            for name in ("model", *stack):
                saved[name][storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(name, module):
        def enter(module, args):
            stack.append(name)
            marks[name]["f0"] = clock.mark()

        def leave(module, args, output):
            stack.remove(name)
            marks[name]["f1"] = clock.mark()

        return [
            module.register_forward_pre_hook(enter), module.register_forward_hook(leave),
            module.register_full_backward_pre_hook(lambda module, grad_out: marks[name].update(b0=clock.mark())),
            module.register_full_backward_hook(lambda module, grad_in, grad_out: marks[name].update(b1=clock.mark())),
        ]  # fmt: skip

    def sync():
        if cuda:
            torch.cuda.synchronize()

    handles = [handle for name, module in parts.items() for handle in hooks(name, module)]
    times = {key: [] for key in ("s", "fwd_s", "bwd_s", "opt_s")}
    part_times = {name: {"fwd_s": [], "bwd_s": []} for name in parts}
    grads, peak, fwd_bwd_peak = {}, 0, 0
    for index in range(steps + 1):
        sync()
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        for name in marks:
            marks[name].clear()
        start = time.perf_counter()
        if index:
            loss = forward()
        else:  # the warm-up step counts what the forward saves (the hooks' host work stays out of the timed steps)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss = forward()
        sync()
        forward_end = time.perf_counter()
        backward(loss)
        del loss
        sync()
        backward_end = time.perf_counter()
        if index and cuda:
            fwd_bwd_peak = max(fwd_bwd_peak, torch.cuda.max_memory_allocated() - before)
        if not index:
            grads = {id(p): tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None}
        optimizer_step()
        sync()
        end = time.perf_counter()
        if index:
            spans = (end - start, forward_end - start, backward_end - forward_end, end - backward_end)
            for key, value in zip(times, spans):
                times[key].append(value)
            for name, mark in marks.items():
                for key, (first, last) in (("fwd_s", ("f0", "f1")), ("bwd_s", ("b0", "b1"))):
                    if first in mark and last in mark:
                        part_times[name][key].append(clock.seconds(mark[first], mark[last]))
    for handle in handles:
        handle.remove()
    if cuda:
        peak = max(peak, torch.cuda.max_memory_allocated())

    def state_bytes(parameter) -> int:  # AdamW's tensors on the parameter's device (a step count on the host aside)
        state = optimizer.state.get(parameter, {})
        return sum(tensor_bytes(v) for v in state.values() if torch.is_tensor(v) and v.device == parameter.device)

    def memory(parameters, name) -> dict:
        parameters = list(parameters)
        return dict(
            param_bytes=sum(tensor_bytes(p) for p in parameters),
            grad_bytes=sum(grads.get(id(p), 0) for p in parameters),
            optim_bytes=sum(state_bytes(p) for p in parameters),
            saved_bytes=sum(saved[name].values()),
        )  # fmt: skip

    result = {key: median(values) for key, values in times.items()}
    result.update(memory(model.parameters(), "model"), fwd_bwd_peak_bytes=fwd_bwd_peak if cuda else None)
    result.update(peak_GB=peak / 1e9 if cuda else None, parts={})
    for name, module in parts.items():
        result["parts"][name] = {key: median(values) for key, values in part_times[name].items()}
        result["parts"][name].update(memory(module.parameters(), name))
    return result


def run_layout(folder, layout, world, tokens, steps, device, dtype, frozen) -> dict:
    """{s, tok_s, peak_GB} of `layout`, on every rank; `single` adds `split_step`'s figures and runs on rank 0 while
    the other ranks wait."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    together = layout != "single"
    result = None
    if together or dist.get_rank() == 0:
        model, cp_group = load(folder, layout, world, device, dtype)
        phases, optimizer, distinct = training_step(freeze(model, frozen), layout, tokens, world, cp_group, device)
        if together:
            forward, backward, optimizer_step = phases

            def step():
                backward(forward())
                optimizer_step()

            seconds = timed(step, steps, device, together)
            result = dict(s=seconds, tok_s=distinct / seconds, peak_GB=peak_memory(device, together))
            del step
        else:
            split = split_step(model, phases, optimizer, steps, device)
            result = dict(split, tok_s=distinct / split["s"])
        del model, phases, optimizer
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


def size(count) -> str:
    if count is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def split_table(single: dict) -> str:
    """The single layout's step by phase and by part: milliseconds and bytes."""
    lines = [
        "| part | forward ms | backward ms | optimizer ms | parameters | gradients | AdamW state | saved for backward "
        "| forward + backward peak |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    milliseconds = lambda s: "n/a" if s is None else f"{s * 1e3:.2f}"
    for name, r in [("model", single), *single["parts"].items()]:
        lines.append(
            f"| {name} | {milliseconds(r['fwd_s'])} | {milliseconds(r['bwd_s'])} | {milliseconds(r.get('opt_s'))} "
            f"| {size(r['param_bytes'])} | {size(r['grad_bytes'])} | {size(r['optim_bytes'])} "
            f"| {size(r['saved_bytes'])} "
            f"| {size(r.get('fwd_bwd_peak_bytes'))} |"
        )  # fmt: skip
    return "\n".join(lines)


def tables(results: dict, world: int) -> str:
    text = table(results, world)
    if "single" in results:
        text += "\n\nThe single layout's step by phase and by decoder layer:\n\n" + split_table(results["single"])
    return text


def main(out, model="anchor", layouts=",".join(LAYOUTS), tokens=4096, steps=5, experts=64, frozen="none"):
    if model not in MODELS:
        raise ValueError(f"model={model!r}: pick one of {', '.join(MODELS)}.")
    if frozen not in ("none", "experts"):
        raise ValueError(f"frozen={frozen!r}: pick none or experts.")
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
    # every layout loads one checkpoint; the single layout alone builds the model on the device (the anchor config
    # is defined as a Kimi Linear checkpoint)
    folder = (model, experts) if layouts == ["single"] and model != "anchor" else out / "checkpoint"
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if isinstance(folder, Path):
            save_checkpoint(model, folder, experts, dtype)
    dist.barrier()
    results = {}
    for layout in layouts:
        if rank == 0:
            print(f"{layout}: start", flush=True)
        results[layout] = run_layout(folder, layout, world, tokens, steps, device, dtype, frozen)
        if rank == 0:
            routed = "" if model == "anchor" else f", {experts} routed experts"  # the anchor config fixes its own
            header = (f"{world} ranks, {'GPU: ' + torch.cuda.get_device_name() if cuda else 'CPU (gloo)'}; model "
                      f"{model}{routed}{', routed experts frozen' if frozen == 'experts' else ''}")
            report = dict(world=world, model=model, experts=experts, frozen=frozen, tokens=tokens, results=results)
            (out / "parallel.json").write_text(json.dumps(report, indent=2))
            (out / "parallel.md").write_text(f"{header}, {tokens} tokens per rank\n\n{tables(results, world)}\n")
    if rank == 0:
        print(tables(results, world), flush=True)
    dist.destroy_process_group()
    return results


if __name__ == "__main__":
    arguments = dict(arg.split("=", 1) for arg in sys.argv[2:])
    for name in ("tokens", "steps", "experts"):
        if name in arguments:
            arguments[name] = int(arguments[name])
    main(sys.argv[1], **arguments)
