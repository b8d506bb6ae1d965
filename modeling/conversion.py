"""Checkpoint-layout conversions: load Kimi Linear checkpoints into `KdaMoeForCausalLM`, save in our own layout.

`KdaMoeForCausalLM.from_pretrained(folder)` reads three weight layouts (SPEC, "Checkpoint formats"); the renames
and merges are transformers' weight-conversion machinery, registered for our `model_type` at import:

- ours: loads as is (only `A_log` passes through a no-op reshape);
- transformers' native `kimi_linear` model as it sits in memory (`save_pretrained(..., save_original_format=False)`):
  the forget gate is its own module (`self_attn.forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}`) and `A_log` is
  `[1, 1, H, 1]`;
- the published remote-code layout of `moonshotai/Kimi-Linear-48B-A3B`, which is also what
  `KimiLinearForCausalLM.save_pretrained` writes by default (it reverts transformers' own `kimi_linear` mapping):
  flat `self_attn.{f_a_proj, f_b_proj, dt_bias, A_log}`, one depthwise conv per stream
  (`self_attn.{q,k,v}_conv1d.weight`, `[H*K, 1, W]` each), the MoE block under `block_sparse_moe.` (transformers'
  save puts the dense MLP there too), experts one module each (`experts.{j}.w1/w3/w2` = gate / up / down).

Per decoder layer, published / native name -> ours:

    self_attn.forget_gate.X                 -> self_attn.X               (X: f_a_proj, f_b_proj, dt_bias, A_log)
    block_sparse_moe.                       -> mlp.
    self_attn.{q,k,v}_conv1d.weight         -> self_attn.conv1d.weight   q | k | v concatenated: [3*H*K, 1, W]
    mlp.experts.{j}.w1.weight, .w3.weight   -> mlp.experts.gate_up_proj  [E, 2I, d] (gate rows, then up rows)
    mlp.experts.{j}.w2.weight               -> mlp.experts.down_proj     [E, d, I]
    self_attn.A_log [1, 1, H, 1]            -> self_attn.A_log [H]

The config side (`linear_attn_config`, `first_k_dense_replace`, `num_experts_per_token`, ...) is handled by
`KdaMoeTextConfig._from_kimi_linear_keys`.

Saving: transformers reverts the conversions a model was loaded with (`save_pretrained(save_original_format=True)`,
the default), and for a model built from scratch it reverts every conversion registered for its `model_type`. Ours
are load-only: their reverse matches no key, so `save_pretrained` always writes our own layout and a saved folder
reloads through any code path (also `trust_remote_code=True`) without conversion.
"""

import torch
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
)

from ..configuration import KdaMoeTextConfig


class FlattenHeads(ConversionOps):
    """`A_log` stored broadcast-ready as `[1, 1, H, 1]` (Kimi Linear) -> our `[H]`; an `[H]` tensor stays as it is."""

    @torch.no_grad()
    def convert(
        self,
        input_dict: dict[str, list[torch.Tensor]],
        source_patterns: list[str],
        target_patterns: list[str],
        **kwargs,
    ) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor.reshape(-1)}


class _KeepOurLayoutOnSave(WeightRenaming):
    """The reverse of a load-only transform: matches no key, so saving leaves our parameter names as they are."""

    __slots__ = ()

    def __init__(self, *args, **kwargs):  # also when transformers copies it (`copy(source_patterns, target_patterns)`)
        super().__init__(source_patterns="kda_moe_keeps_its_layout", target_patterns="kda_moe_keeps_its_layout")

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        return source_key, None


class LoadOnlyRenaming(WeightRenaming):
    """A `WeightRenaming` applied when loading only (see the module docstring, "Saving")."""

    __slots__ = ()

    def reverse_transform(self) -> WeightRenaming:
        return _KeepOurLayoutOnSave()


class LoadOnlyConverter(WeightConverter):
    """A `WeightConverter` applied when loading only (see the module docstring, "Saving")."""

    __slots__ = ()

    def reverse_transform(self) -> WeightRenaming:
        return _KeepOurLayoutOnSave()


def kimi_linear_conversions() -> list[WeightRenaming | WeightConverter]:
    """The transforms, in transformers' order: every matching renaming applies, then at most one converter."""
    return [
        LoadOnlyRenaming(source_patterns=r"self_attn\.forget_gate\.", target_patterns="self_attn."),
        LoadOnlyRenaming(source_patterns=r"\.block_sparse_moe\.", target_patterns=".mlp."),
        LoadOnlyConverter(
            source_patterns=["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"],
            target_patterns="self_attn.conv1d.weight",
            operations=[Concatenate(dim=0)],
        ),
        LoadOnlyConverter(
            source_patterns=["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],
            target_patterns="mlp.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        LoadOnlyConverter(
            source_patterns="mlp.experts.*.w2.weight",
            target_patterns="mlp.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
        LoadOnlyConverter(
            source_patterns="self_attn.A_log",
            target_patterns="self_attn.A_log",
            operations=[FlattenHeads()],
        ),
    ]


# Looked up by class name first, then by `config.model_type`: a Kimi Linear folder says `model_type: kimi_linear`, but
# loaded through our classes its config is a `KdaMoeTextConfig`, whose `model_type` is always ours. `overwrite=True`
# keeps a second import of the package (e.g. under another name) harmless.
register_checkpoint_conversion_mapping(KdaMoeTextConfig.model_type, kimi_linear_conversions(), overwrite=True)

__all__ = ["FlattenHeads", "LoadOnlyConverter", "LoadOnlyRenaming", "kimi_linear_conversions"]
