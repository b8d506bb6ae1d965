"""Checkpoint-layout conversions between Kimi Linear checkpoints and `KdaMoeForCausalLM`, both ways.

`KdaMoeForCausalLM.from_pretrained(folder)` reads three weight layouts; the renames and merges are transformers'
weight-conversion machinery, registered for our `model_type` at import:

- ours: loads as is;
- transformers' native `kimi_linear` model as it sits in memory (`save_pretrained(..., save_original_format=False)`):
  the forget gate is its own module (`self_attn.forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}`) and `A_log` is
  `[1, 1, H, 1]`;
- the published remote-code layout of `moonshotai/Kimi-Linear-48B-A3B`, which is also what
  `KimiLinearForCausalLM.save_pretrained` writes by default: flat `self_attn.{f_a_proj, f_b_proj, dt_bias, A_log}`,
  one depthwise conv per stream (`self_attn.{q,k,v}_conv1d.weight`, `[H*K, 1, W]` each), the MoE block under
  `block_sparse_moe.` (transformers' save puts the dense MLP there too), experts one module each
  (`experts.{j}.w1/w3/w2` = gate / up / down).

Per decoder layer, Kimi Linear name -> ours:

    self_attn.forget_gate.X                   -> self_attn.X             (X: f_a_proj, f_b_proj, dt_bias, A_log)
    block_sparse_moe.{gate, experts, shared_experts}.  -> mlp.{...}.
    block_sparse_moe.{gate,up,down}_proj.     -> mlp.{...}_proj.         (a dense MLP saved by transformers)
    self_attn.{q,k,v}_conv1d.weight           -> self_attn.conv1d.weight  q | k | v concatenated: [3*H*K, 1, W]
    experts.{j}.w1.weight, experts.{j}.w3.weight -> experts.gate_up_proj  [E, 2I, d] (gate rows, then up rows)
    experts.{j}.w2.weight                     -> experts.down_proj        [E, d, I]
    A_log [1, 1, H, 1]                        -> A_log [H]

The config side (`linear_attn_config`, `first_k_dense_replace`, `num_experts_per_token`, ...) is handled by
`KdaMoeTextConfig._from_kimi_linear_keys`.

Saving: `save_pretrained` (with transformers' default `save_original_format=True`) undoes the conversions a model
was loaded with, so a model loaded from a Kimi Linear layout writes that layout back, and one loaded from ours (or
built in memory: `KdaMoePreTrainedModel._weight_conversions` is empty) writes ours. `save_original_format=False`
always writes ours. Only the `A_log` key is the same in our layout and the published one, so a checkpoint of ours
also goes through `FlattenHeads` when loaded; its reverse restores `[1, 1, H, 1]` only for a model whose loading
used some other conversion, i.e. came from a Kimi Linear layout.
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


def loaded_from_kimi_linear(model) -> bool:
    """Whether `model` was loaded from a Kimi Linear layout: its loading used a conversion other than `A_log`'s."""
    return any(
        not isinstance(conversion, WeightConverter) or not isinstance(conversion.operations[0], FlattenHeads)
        for conversion in getattr(model, "_weight_conversions", None) or ()
    )


class FlattenHeads(ConversionOps):
    """`A_log` as Kimi Linear stores it, broadcast-ready `[1, 1, H, 1]` -> our `[H]`; an `[H]` tensor stays as it is."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor.reshape(-1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return BroadcastHeads()


class BroadcastHeads(ConversionOps):
    """The reverse of `FlattenHeads` when saving: `[H]` -> `[1, 1, H, 1]` for a model loaded from a Kimi Linear
    layout; a model loaded from ours keeps `[H]` (see the module docstring, "Saving")."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, model=None, **kwargs) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        if loaded_from_kimi_linear(model):
            tensor = tensor.reshape(1, 1, -1, 1)
        return {target_patterns[0]: tensor}

    @property
    def reverse_op(self) -> ConversionOps:
        return FlattenHeads()


def kimi_linear_conversions() -> list[WeightRenaming | WeightConverter]:
    """The transforms, in transformers' order: every matching renaming applies, then at most one converter.

    Saving runs them backwards, each target pattern becoming a regex: their dots are escaped, so `.mlp.gate.` never
    matches `.mlp.gate_proj.` nor `.experts.` `shared_experts.`; converter patterns leave out the parts of a name that
    renamings change, so both directions compose on every supported version.
    """
    return [
        WeightRenaming(r"self_attn\.forget_gate\.(f_a_proj|f_b_proj|dt_bias|A_log)", r"self_attn\.\1"),
        WeightRenaming(r"\.block_sparse_moe\.(gate|experts|shared_experts)\.", r"\.mlp\.\1\."),
        WeightRenaming(r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.", r"\.mlp\.\1\."),
        WeightConverter(
            source_patterns=["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"],
            target_patterns="self_attn.conv1d.weight",
            operations=[Concatenate(dim=0)],
        ),
        WeightConverter(
            source_patterns=[r"\.experts.*.w1.weight", r"\.experts.*.w3.weight"],
            target_patterns=r"\.experts\.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns=r"\.experts.*.w2.weight",
            target_patterns=r"\.experts\.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
        WeightConverter(source_patterns="A_log", target_patterns="A_log", operations=[FlattenHeads()]),
    ]


# Looked up by class name first, then by `config.model_type`: a Kimi Linear folder says `model_type: kimi_linear`, but
# loaded through our classes its config is a `KdaMoeTextConfig`, whose `model_type` is always ours. `overwrite=True`
# keeps a second import of the package (e.g. under another name) harmless.
register_checkpoint_conversion_mapping(KdaMoeTextConfig.model_type, kimi_linear_conversions(), overwrite=True)

__all__ = ["BroadcastHeads", "FlattenHeads", "kimi_linear_conversions", "loaded_from_kimi_linear"]
