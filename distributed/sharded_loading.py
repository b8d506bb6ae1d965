"""Checkpoint conversions that see whole tensors when the model loads sharded.

`from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...))` shards the parameters (DTensors, `Shard(0)`
over the FSDP ranks) before the weights load, and transformers reads each checkpoint tensor as this rank's rows of it
(the rows its shard of the target parameter takes) before the checkpoint's conversions run. That is right where a
conversion keeps rows in place (renames, experts stacked, the patch embedding flattened) and wrong where it merges,
splits or trims along the sharded dim: the published `{q,k,v}_conv1d` weights concatenated into one conv, Kimi Linear's
`A_log` [1, 1, H, 1], K3's `A_log` zero-padded to 128 heads, MoonViT's fused `wqkv` split into q, k, v.

`on_whole_tensors` wraps such a conversion: it gathers the whole checkpoint tensors from the rows every rank read,
converts them as one process does, and keeps this rank's shard of each result. The tensors are small (a K3 KDA layer's
conv and `A_log`: about 150k values; a MoonViT block's `wqkv`: 4M) and are gathered once, at load.

`check_shards_load` refuses, before any weight is read, a layout whose shards transformers' loader cannot read.
"""

import functools

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def sharded_parameter(model, name: str | None) -> DTensor | None:
    """The parameter `name` of `model` where it is a DTensor that some rank holds only part of, else None."""
    if model is None or not name:
        return None
    try:
        parameter = model.get_parameter(name)
    except AttributeError:  # a checkpoint name (the save direction)
        return None
    if not isinstance(parameter, DTensor) or all(isinstance(p, Replicate) for p in parameter.placements):
        return None
    return parameter


def gather_along(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The tensor whose consecutive pieces along `dim` the ranks of `group` hold, in rank order (pieces may differ in
    length, an empty one included)."""
    ranks = dist.get_world_size(group)
    length = torch.tensor([tensor.shape[dim]], device=tensor.device)
    lengths = [torch.empty_like(length) for _ in range(ranks)]
    dist.all_gather(lengths, length, group=group)
    lengths = [int(n) for n in lengths]
    padding = list(tensor.shape)
    padding[dim] = max(lengths) - tensor.shape[dim]
    padded = torch.cat([tensor, tensor.new_zeros(padding)], dim).contiguous()
    pieces = [torch.empty_like(padded) for _ in range(ranks)]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([piece.narrow(dim, 0, n) for piece, n in zip(pieces, lengths)], dim)


def whole_checkpoint_tensor(rows: torch.Tensor, parameter: DTensor) -> torch.Tensor:
    """The checkpoint tensor of which transformers read `rows` on this rank for the sharded `parameter`: cut by each
    of the parameter's `Shard` placements, outermost mesh dim first, so gathered innermost first."""
    mesh = parameter.device_mesh
    for mesh_dim in reversed(range(mesh.ndim)):
        placement = parameter.placements[mesh_dim]
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"This rank read an interleaved part ({placement!r}) of a checkpoint tensor that a published layout "
                "stores unlike our parameter, and its conversion cannot put the parts together again. Convert the "
                "checkpoint in one process first (`from_pretrained(folder).save_pretrained(converted, "
                "layout='kda_moe')`) and load the converted folder."
            )
        rows = gather_along(rows, placement.dim % parameter.ndim, mesh.get_group(mesh_dim))
    return rows


def on_whole_tensors(convert):
    """Decorates a `ConversionOps.convert` so that, where its first target is a sharded parameter of the model, it
    converts the whole checkpoint tensors (`whole_checkpoint_tensor`) and returns this rank's shard of each target
    parameter. Unsharded targets (one process, tensor parallelism's whole `kda_heads` tensors, saving) pass through.

    Every rank of the parameter's mesh converts the same tensors in the same order (transformers converts in the
    checkpoint's key order), so the gathers match up."""

    @functools.wraps(convert)
    def convert_whole(self, input_dict, source_patterns, target_patterns, **kwargs):
        model, full_layer_name = kwargs.get("model"), kwargs.get("full_layer_name") or ""
        # transformers names each result by the part of the first target's name around its pattern
        prefix, found, suffix = full_layer_name.partition(target_patterns[0])
        first = sharded_parameter(model, full_layer_name) if found else None
        if first is None:
            return convert(self, input_dict, source_patterns, target_patterns, **kwargs)
        whole = {
            pattern: [whole_checkpoint_tensor(t, first) for t in tensors]
            if isinstance(tensors, list)
            else whole_checkpoint_tensor(tensors, first)
            for pattern, tensors in input_dict.items()
        }
        converted = convert(self, whole, source_patterns, target_patterns, **kwargs)
        shards = {}
        for pattern, tensor in converted.items():
            parameter = model.get_parameter(prefix + pattern + suffix)
            shards[pattern] = distribute_tensor(
                tensor, parameter.device_mesh, parameter.placements, src_data_rank=None
            ).to_local()
        return shards

    return convert_whole


def dim_sharded_twice(parameter: DTensor) -> int | None:
    """The dim of `parameter` that two mesh dims split (FSDP over a tensor-parallel split, its FSDP placement a
    `_StridedShard`), or None."""
    dims = [placement.dim % parameter.ndim for placement in parameter.placements if hasattr(placement, "dim")]
    return next((dim for dim in dims if dims.count(dim) > 1), None)


def check_shards_load(model) -> None:
    """Refuse a layout that leaves a rank no row of a parameter that FSDP shards over a tensor-parallel split.

    transformers' loader reads such a shard as a list of row ranges and fails on an empty list (an IndexError in
    `DtensorShardOperation`), although FSDP itself trains with empty shards. It happens where a tensor-parallel rank
    holds fewer rows than there are FSDP ranks, e.g. `b_proj` (one row a KDA head) with linear_num_heads < tp_size *
    fsdp_size. Every rank takes part (one all-gather over the default group) and raises the same error.
    """
    twice_sharded = [
        (name, parameter)
        for name, parameter in model.named_parameters()
        if isinstance(parameter, DTensor) and dim_sharded_twice(parameter) is not None
    ]
    if not twice_sharded:
        return
    empty_here = [name for name, parameter in twice_sharded if parameter.to_local().numel() == 0]
    empty_per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(empty_per_rank, empty_here)
    ranks = [rank for rank, names in enumerate(empty_per_rank) if names]
    if not ranks:
        return
    names = sorted({name for names in empty_per_rank for name in names})
    parameter = model.get_parameter(names[0])
    mesh = parameter.device_mesh
    dim = dim_sharded_twice(parameter)
    others = f" and {len(names) - 1} more parameters" if len(names) > 1 else ""
    raise ValueError(
        f"This layout leaves ranks {ranks} without any row of `{names[0]}`{others}: its {parameter.shape[dim]} rows "
        f"(dim {dim}) are split over the mesh {dict(zip(mesh.mesh_dim_names or range(mesh.ndim), mesh.shape))} as "
        f"{list(parameter.placements)}, and transformers {transformers.__version__} cannot load an empty shard of a "
        "tensor-parallel parameter that FSDP also shards. Choose a tp_size and fsdp_size whose product divides "
        f"{parameter.shape[dim]}, and add data-parallel ranks with dp_replicate_size (HSDP) rather than a larger "
        "fsdp_size."
    )
