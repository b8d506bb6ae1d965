"""Tensor and expert parallelism of the text decoder through transformers' plans.

`from_pretrained(..., tp_plan="auto")` or `from_pretrained(..., distributed_config=DistributedConfig(...))` lays the
model out with the config's `base_model_tp_plan` / `base_model_ep_plan`. transformers' own styles shard the linear
layers (column-wise by head, `o_proj` row-wise with an all-reduce), MLA's `kv_a_proj_with_mqa` (whose rotary key feeds
every head) and the norms that see one rank's heads. A KDA layer also holds per-head tensors that are not linear
weights; the two styles registered here split them by head, so every rank runs the delta rule for its own heads:

- `kda_qkv_conv`, on the depthwise conv over the q | k | v channels (weight [3 * H * K, 1, W]): each third is split
  by head (`_StridedShard(0, split_factor=3)`), so a rank keeps the q | k | v channels of its own heads, in order;
- `kda_heads`, on the KDA module: splits `A_log` [H] and `dt_bias` [H * K] by head (`Shard(0)`) and runs the
  module's forward with its own and its conv's sharded parameters as local tensors, which the kernels take.

Importing this module registers both styles (transformers looks a plan's styles up by name).
"""

from contextlib import contextmanager

import torch
from torch import nn
from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard


@contextmanager
def local_parameters(*modules: nn.Module):
    """Within the block, the DTensor parameters of `modules` (not of their children) are this rank's local tensors;
    gradients flow back to the DTensors."""
    originals = [
        (module, name, param)
        for module in modules
        for name, param in module.named_parameters(recurse=False)
        if isinstance(param, DTensor)
    ]
    for module, name, param in originals:
        module._parameters[name] = param.to_local()
    try:
        yield
    finally:
        for module, name, param in originals:
            module._parameters[name] = param


def _shard(module: nn.Module, name: str, mesh, placement) -> None:
    """Replace `module.<name>` (a placeholder before loading) by a DTensor parameter with `placement` on `mesh`."""
    param = module._parameters.get(name)
    if param is not None:
        module._parameters[name] = nn.Parameter(
            distribute_tensor(param, mesh, [placement], src_data_rank=None), requires_grad=param.requires_grad
        )


class KdaQkvConvParallel(TensorParallelLayer):
    """The q | k | v depthwise conv weight [3 * H * K, 1, W], each third split by head."""

    def shard_param(self, module, param, mesh, **kwargs):
        _shard(module, param, mesh, _StridedShard(0, split_factor=3))


class KdaHeadsParallel(TensorParallelLayer):
    """A KDA layer's per-head parameters (`A_log`, `dt_bias`) split by head; the forward runs on local parameters.

    The plan names the attention module of every layer (`layers.*.self_attn`), MLA layers included: those hold no
    parameters of their own and are left as they are.
    """

    def shard_param(self, module, param, mesh, **kwargs):
        _shard(module, param, mesh, Shard(0))

    def install_forward(self, module, mesh, **kwargs):
        if not hasattr(module, "conv1d"):  # an MLA layer
            return module
        forward = module.forward

        def forward_on_local_parameters(*args, **kwargs):
            with local_parameters(module, module.conv1d):
                return forward(*args, **kwargs)

        module.forward = forward_on_local_parameters
        return module


if torch.distributed.is_available():
    ALL_PARALLEL_STYLES.register("kda_qkv_conv", KdaQkvConvParallel())
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
