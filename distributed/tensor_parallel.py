"""Tensor and expert parallelism of the text decoder through transformers' plans.

`from_pretrained(..., tp_plan="auto")` or `from_pretrained(..., distributed_config=DistributedConfig(...))` lays the
model out with the config's `base_model_tp_plan` / `base_model_ep_plan`. transformers' own styles shard the linear
layers (column-wise by head, `o_proj` row-wise with an all-reduce), MLA's `kv_a_proj_with_mqa` (whose rotary key feeds
every head) and the norms that see one rank's heads. A KDA layer also holds per-head tensors that are not linear
weights: `A_log` [H], `dt_bias` [H * K] and the depthwise conv over the q | k | v channels (weight [3 * H * K, 1, W]).
The `kda_heads` style registered here keeps them whole on every rank and runs the layer's forward on this rank's heads
of each, so every rank runs the delta rule for its own heads.

Why whole rather than sharded: transformers cuts each checkpoint tensor to the rank's slice of its parameter, by the
parameter's placement, *before* the checkpoint's conversions run. That is right for a tensor stored as the parameter is,
and wrong for these three in the published layouts: Kimi Linear's `A_log` [1, 1, H, 1], K3's `A_log` zero-padded to
128 heads, and the separate `{q,k,v}_conv1d` weights that make up our conv (each a third of it, not a strided slice).
Held whole, they load and convert as in one process, whatever the layout. They are small (a K3 layer's: about 160k
values), and as for `o_norm` (replicated, seeing one rank's heads) the gradients of their slices are summed over the
ranks, so the ranks keep identical copies through training.

Importing this module registers the style (transformers looks a plan's styles up by name).

FSDP x TP (`DistributedConfig(fsdp_size=..., tp_size=...)`) needs transformers 5.18+; 5.17 would lay out the
tensor-parallel plan alone from such a config, and `check_fsdp_with_tensor_parallel` refuses it there.
"""

from contextlib import contextmanager

import torch
import transformers
from torch import nn
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

from ..compat import FSDP_WITH_TENSOR_PARALLEL

# A KDA layer's per-head tensors -> the blocks of heads each holds (the conv: q | k | v, each split by head).
PER_HEAD_TENSORS = {"A_log": 1, "dt_bias": 1, "conv1d.weight": 3}


class _SumGradientOverRanks(torch.autograd.Function):
    """Identity whose backward sums the gradient over `group`: each rank reads only its own heads of a tensor that
    every rank holds whole, so each rank's gradient covers only those heads."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def heads_of_rank(whole: torch.Tensor, blocks: int, rank: int, ranks: int) -> torch.Tensor:
    """The rows of `whole` [blocks * N, ...] that rank `rank` of `ranks` owns: its part of each block, in order."""
    parts = whole.view(blocks, ranks, -1, *whole.shape[1:])  # [blocks, ranks, N / ranks, ...]
    return parts[:, rank].flatten(0, 1)


@contextmanager
def own_heads(attention: nn.Module, mesh):
    """Within the block, the per-head tensors of a KDA layer (`PER_HEAD_TENSORS`) are this rank's heads of them;
    their gradients reach the whole parameters, summed over the ranks of `mesh`."""
    rank, ranks, group = mesh.get_local_rank(), mesh.size(), mesh.get_group()
    originals = []
    for name, blocks in PER_HEAD_TENSORS.items():
        module_name, _, param_name = name.rpartition(".")
        module = attention.get_submodule(module_name)
        whole = module._parameters[param_name]
        originals.append((module, param_name, whole))
        module._parameters[param_name] = heads_of_rank(_SumGradientOverRanks.apply(whole, group), blocks, rank, ranks)
    try:
        yield
    finally:
        for module, param_name, whole in originals:
            module._parameters[param_name] = whole


class KdaHeadsParallel(TensorParallelLayer):
    """A KDA layer's per-head tensors held whole on every rank; its forward runs on this rank's heads of them.

    The plan names the attention module of every layer (`layers.*.self_attn`), MLA layers included: those hold no
    per-head tensors and are left as they are.
    """

    def install_forward(self, module, mesh, **kwargs):
        if not hasattr(module, "conv1d"):  # an MLA layer
            return module
        if module.num_heads % mesh.size():
            raise ValueError(
                f"Tensor parallelism over {mesh.size()} ranks splits the KDA heads evenly, but linear_num_heads="
                f"{module.num_heads}; choose a tensor-parallel size that divides it."
            )
        forward = module.forward

        def forward_on_own_heads(*args, **kwargs):
            with own_heads(module, mesh):
                return forward(*args, **kwargs)

        module.forward = forward_on_own_heads
        return module


if torch.distributed.is_available():
    ALL_PARALLEL_STYLES.register("kda_heads", KdaHeadsParallel())


def data_parallel_group_of_mesh(model: nn.Module):
    """The group of ranks that hold different tokens in a model laid out by transformers (its FSDP / HSDP axes), or
    None where every rank of the mesh holds the same tokens (tensor parallelism alone, expert parallelism over a shared
    batch)."""
    mesh_manager = getattr(model, "_mesh_manager", None)  # transformers 5.19+: the dense mesh's axes
    mesh = mesh_manager.get_mesh(("dp_replicate", "fsdp")) if mesh_manager is not None else model._device_mesh
    axes = mesh.mesh_dim_names or ()  # 5.17 names no axis of a tensor-parallel mesh
    names = [name for name in axes if name in ("dp_replicate", "fsdp") and mesh[name].size() > 1]
    if not names:
        return None
    return mesh[names[0]].get_group() if len(names) == 1 else mesh[tuple(names)]._flatten().get_group()


def check_fsdp_with_tensor_parallel(distributed_config) -> None:
    """Refuse FSDP and tensor parallelism together where transformers lays out only one of them from a
    `DistributedConfig` (5.17: the tensor-parallel plan alone, over the first tp_size ranks)."""
    if distributed_config is None or FSDP_WITH_TENSOR_PARALLEL:
        return
    tp_size, fsdp_size = distributed_config.tp_size or 1, distributed_config.fsdp_size or 1
    if tp_size > 1 and fsdp_size > 1:
        raise ValueError(
            f"transformers {transformers.__version__} lays out tensor parallelism or FSDP from a DistributedConfig, "
            f"not both (tp_size={tp_size}, fsdp_size={fsdp_size}). Install transformers >= 5.18, or lay the model out "
            "yourself: `mesh = init_device_mesh(device, (fsdp_size, tp_size), mesh_dim_names=('fsdp', 'tp'))`, "
            "`from_pretrained(..., tp_plan='auto', device_mesh=mesh)`, `fully_shard` every decoder layer and then the "
            "model over `mesh['fsdp']`, and `model.set_balancing_group(mesh['fsdp'].get_group())`."
        )
