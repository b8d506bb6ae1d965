"""Peak host memory while loading a sharded checkpoint, against the checkpoint's size, and the Kimi K3 device plan.

    python benchmarks/load_memory.py [--size-mb 400] [--workdir DIR] [--plan]

Writes a random model of about `--size-mb` (fp32, mostly routed experts; `memory_test_config`) as safetensors shards of
at most 50 MB with their index, then loads it once per way of loading, each in fresh processes:

- `plain`: `from_pretrained(folder)`;
- `offload`: `from_pretrained(folder, device_map="auto", max_memory={"cpu": half the checkpoint},
  offload_folder=...)`: the decoder layers that do not fit stay on disk;
- `tp2`: `from_pretrained(folder, distributed_config=DistributedConfig(...))` on 2 gloo ranks: dense modules split by
  the tensor-parallel plan, routed experts by the expert-parallel plan (by the tensor-parallel one on transformers
  before 5.19, which has no expert-parallel dispatch on one TP group).

Each process reports the growth of its peak resident set from before the load to after it has read every parameter it
holds (Linux: the peak is reset through /proc/self/clear_refs, then read as `VmHWM`), the bytes of those parameters (a
rank's local shards) and the logits of a fixed prompt, which must equal the plain load's.
The table prints MB, one row per process. `--plan` builds Kimi K3 (text and multimodal) on the meta device and prints
the per-device GB of accelerate's `infer_auto_device_map` onto 8 x 141 GB devices, 4 TB of CPU memory and disk (bf16
weights).
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

MB = 10**6
GB = 10**9
WORLD_SIZE = 2
VOCAB_SIZE = 1024
EXPERT_WIDTH, LATENT = 256, 128


def memory_test_config(size_mb: float):
    """4 layers (KDA, KDA, MLA, MLA; the first MLP dense), hidden 256, AttnRes and LatentMoE on, with as many routed
    experts (an even number, so they split over 2 ranks) as bring the fp32 checkpoint to about `size_mb`."""
    from kda_moe import KdaMoeTextConfig

    expert_bytes = 3 * EXPERT_WIDTH * LATENT * 4
    sparse_layers = 3
    num_experts = max(4, 2 * round(size_mb * MB / (expert_bytes * sparse_layers * 2)))
    return KdaMoeTextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_num_heads=4,
        linear_head_dim=32,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=num_experts,
        num_experts_per_tok=2,
        num_shared_experts=1,
        moe_intermediate_size=EXPERT_WIDTH,
        intermediate_size=512,
        routed_expert_hidden_size=LATENT,
        attn_res_block_size=2,
        kernel_backend="torch",
    )


def write_checkpoint(folder: Path, size_mb: float) -> int:
    """A random model of about `size_mb` saved in 50 MB shards; returns the checkpoint's bytes."""
    from kda_moe import KdaMoeForCausalLM

    torch.manual_seed(0)
    model = KdaMoeForCausalLM(memory_test_config(size_mb))
    model.save_pretrained(folder, max_shard_size="50MB")
    return sum(path.stat().st_size for path in folder.glob("*.safetensors"))


def parallel_layout() -> dict:
    """The `DistributedConfig` arguments of the `tp2` load: TP for the dense modules, EP for the experts (5.19+)."""
    from kda_moe.compat import EXPERT_TOKEN_DISPATCH

    if EXPERT_TOKEN_DISPATCH:
        return dict(tp_size=WORLD_SIZE, ep_size=WORLD_SIZE)
    return dict(tp_size=WORLD_SIZE)


def prompt() -> torch.Tensor:
    return torch.randint(1, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))


def resident_bytes(field: str) -> int:
    """`VmRSS` (now) or `VmHWM` (peak since the last reset) of this process, from /proc/self/status (Linux)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024  # kB


def reset_peak_rss() -> int:
    """Start a new peak resident set (Linux's `clear_refs` 5); returns the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return resident_bytes("VmRSS")


def local_parameters(model) -> list[torch.Tensor]:
    """The parameters this process holds: a rank's local shards of DTensors, none of those offloaded (meta)."""
    from torch.distributed.tensor import DTensor

    locals_ = [param.to_local() if isinstance(param, DTensor) else param for param in model.parameters()]
    return [local for local in locals_ if local.device.type != "meta"]


def load_and_measure(rank: int, mode: str, folder: str, workdir: str) -> None:
    """One process of one way of loading: load, measure, run the prompt, write `workdir/{mode}_rank{rank}.pt`."""
    torch.set_num_threads(1)
    import kda_moe  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if mode == "tp2":
        import torch.distributed as dist
        from transformers.distributed import DistributedConfig

        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
        dist.init_process_group("gloo", init_method=f"file://{workdir}/{mode}_store", rank=rank, world_size=WORLD_SIZE)
        kwargs["distributed_config"] = DistributedConfig(**parallel_layout())
    elif mode == "offload":
        checkpoint = sum(path.stat().st_size for path in Path(folder).glob("*.safetensors"))
        kwargs.update(device_map="auto", max_memory={"cpu": checkpoint // 2}, offload_folder=f"{workdir}/offload")
    before = reset_peak_rss()
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    held = local_parameters(model)
    with torch.no_grad():
        for param in held:  # read every byte: parameters that still map the checkpoint file become resident
            param.sum()
    growth = resident_bytes("VmHWM") - before
    with torch.no_grad():
        logits = model(prompt()).logits
    parameter_bytes = sum(param.numel() * param.element_size() for param in held)
    result = dict(mode=mode, rank=rank, peak_growth=growth, parameter_bytes=parameter_bytes, logits=logits)
    if mode == "offload":
        result["devices"] = sorted(set(model.hf_device_map.values()), key=str)
    torch.save(result, f"{workdir}/{mode}_rank{rank}.pt")
    if mode == "tp2":
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def measure(folder: Path, workdir: Path, modes=("plain", "offload", "tp2")) -> list[dict]:
    """Every way of loading in `modes`, in fresh processes; one result per process."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results = []
    for mode in modes:
        ranks = WORLD_SIZE if mode == "tp2" else 1
        (workdir / f"{mode}_store").unlink(missing_ok=True)  # a file store is for one process group
        mp.spawn(load_and_measure, args=(mode, str(folder), str(workdir)), nprocs=ranks, join=True)
        results += [torch.load(workdir / f"{mode}_rank{rank}.pt") for rank in range(ranks)]
    return results


def table(results: list[dict], checkpoint_bytes: int) -> str:
    plain = next(r["logits"] for r in results if r["mode"] == "plain")
    lines = [
        f"checkpoint: {checkpoint_bytes / MB:.0f} MB",
        "| load | rank | peak RSS growth (MB) | growth / checkpoint | parameters held (MB) | logits vs plain |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        error = (r["logits"] - plain).abs().max().item()
        lines.append(
            f"| {r['mode']} | {r['rank']} | {r['peak_growth'] / MB:.0f} | {r['peak_growth'] / checkpoint_bytes:.2f} | "
            f"{r['parameter_bytes'] / MB:.0f} | {error:.1e} |"
        )
    return "\n".join(lines)


def kimi_k3_device_plan(devices: int = 8, device_bytes: int = 141 * GB) -> dict[str, dict]:
    """Kimi K3 built on the meta device (text model and multimodal model), placed by `infer_auto_device_map` onto
    `devices` accelerators of `device_bytes` each, then CPU and disk, in bf16.

    Returns name -> {"model", "device_map", "bytes" (per device), "total" (bytes of the whole model)}."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    from kda_moe import (
        KdaMoeConfig,
        KdaMoeForCausalLM,
        KdaMoeForConditionalGeneration,
        KdaMoeTextConfig,
        KdaMoeVisionConfig,
    )

    text = KdaMoeTextConfig.kimi_k3()
    models = {
        "text": (KdaMoeForCausalLM, text),
        "multimodal": (
            KdaMoeForConditionalGeneration,
            KdaMoeConfig(text_config=text, vision_config=KdaMoeVisionConfig.moonvit()),
        ),
    }
    max_memory = {**{index: device_bytes for index in range(devices)}, "cpu": 4000 * GB, "disk": 10**16}
    plans = {}
    for name, (model_class, config) in models.items():
        with torch.device("meta"):
            model = model_class(config)
        device_map = infer_auto_device_map(
            model, max_memory=max_memory, no_split_module_classes=model._no_split_modules, dtype=torch.bfloat16
        )
        sizes = compute_module_sizes(model, dtype=torch.bfloat16)
        per_device = {}
        for module, device in device_map.items():
            per_device[device] = per_device.get(device, 0) + sizes[module]
        plans[name] = dict(model=model, device_map=device_map, bytes=per_device, total=sizes[""])
    return plans


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=400)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--plan", action="store_true", help="print the Kimi K3 device plan instead")
    args = parser.parse_args()
    if args.plan:
        for name, plan in kimi_k3_device_plan().items():
            print(f"{name}: {plan['total'] / GB:.0f} GB of bf16 weights")
            print(json.dumps({str(device): round(size / GB, 1) for device, size in plan["bytes"].items()}))
        return
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="load_memory_"))
    checkpoint_bytes = write_checkpoint(workdir / "model", args.size_mb)
    print(table(measure(workdir / "model", workdir), checkpoint_bytes))


if __name__ == "__main__":
    sys.exit(main())
