"""Checkpoint-layout conversions between published checkpoints (Kimi Linear, Kimi K3) and our models, both ways.

`from_pretrained` reads four weight layouts; the renames and merges are transformers' weight-conversion machinery,
registered at import for our text, vision and multimodal `model_type`s (one table per sub-model, scoped to it):

- ours: loads as is;
- transformers' native `kimi_linear` model as it sits in memory (`save_pretrained(..., save_original_format=False)`):
  the forget gate is its own module (`self_attn.forget_gate.{f_a_proj, f_b_proj, dt_bias, A_log}`) and `A_log` is
  `[1, 1, H, 1]`;
- the published remote-code layout of `moonshotai/Kimi-Linear-48B-A3B`, which is also what
  `KimiLinearForCausalLM.save_pretrained` writes by default: flat `self_attn.{f_a_proj, f_b_proj, dt_bias, A_log}`,
  one depthwise conv per stream (`self_attn.{q,k,v}_conv1d.weight`, `[H*K, 1, W]` each), the MoE block under
  `block_sparse_moe.` (transformers' save puts the dense MLP there too), experts one module each
  (`experts.{j}.w1/w3/w2` = gate / up / down);
- the published Kimi K3 layout (`moonshotai/Kimi-K3`, `model_type: kimi_k3`): the Kimi Linear names under
  `language_model.model.` / `language_model.lm_head.`, plus the K3 parts below, the vision tower under
  `vision_tower.` and the projector under `mm_projector.`; routed experts may be stored mxfp4 by compressed-tensors (see
  `DequantizeMxfp4`).

Text decoder, published name -> ours (per layer unless said):

    self_attn.forget_gate.X                   -> self_attn.X             (X: f_a_proj, f_b_proj, dt_bias, A_log)
    block_sparse_moe.{gate, experts, shared_experts}.  -> mlp.{...}.
    block_sparse_moe.{gate,up,down}_proj.     -> mlp.{...}_proj.         (a dense MLP saved by transformers)
    block_sparse_moe.routed_expert_{down_proj, up_proj, norm}. -> mlp.latent_{...}.   (K3's LatentMoE)
    self_attention_res_{norm,proj}.           -> attn_res.{norm,proj}.   (K3's AttnRes; layer 0's are unused)
    mlp_res_{norm,proj}.                      -> mlp_res.{norm,proj}.
    output_attn_res_{norm,proj}. (model level) -> out_res.{norm,proj}.
    self_attn.{q,k,v}_conv1d.weight           -> self_attn.conv1d.weight  q | k | v concatenated: [3*H*K, 1, W]
    experts.{j}.w1.weight, experts.{j}.w3.weight -> experts.gate_up_proj  [E, 2I, d] (gate rows, then up rows)
    experts.{j}.w2.weight                     -> experts.down_proj        [E, d, I]
    A_log [1, 1, H, 1] (Kimi Linear), [128] fp32 zero-padded (K3)  -> A_log [H]

Vision tower and projector (K3). The released index's vision names are not public; K3's encoder descends from the
MoonViT of Kimi K2.5, and the loader assumes K3 keeps K2.5's names (those transformers' `kimi_k25` model reads),
minus the biases and LayerNorm biases that our bias-free, RMSNorm tower does not have, with the projector's final
norm as `mm_projector.post_norm`. Every name that rests on that assumption is in `moonvit_conversions` and
`kimi_k3_conversions`:

    vision_tower.patch_embed.proj.weight  [D, C, P, P] (a conv) -> vision_tower.patch_embed.proj.weight [D, C*P*P]
    vision_tower.patch_embed.pos_emb.weight                    -> vision_tower.pos_emb.weight
    vision_tower.encoder.blocks.N.{norm0, norm1}               -> vision_tower.blocks.N.{norm1, norm2}
    vision_tower.encoder.blocks.N.wqkv.weight  [3D, D]         -> vision_tower.blocks.N.attn.{q,k,v}_proj.weight
        (q and k rows permuted per head from MoonViT's complex-pair 2D RoPE to ours, see `MoonViTQkvToOurs`)
    vision_tower.encoder.blocks.N.wo                           -> vision_tower.blocks.N.attn.o_proj
    vision_tower.encoder.blocks.N.mlp.{fc0, fc1}               -> vision_tower.blocks.N.mlp.{fc1, fc2}
    vision_tower.encoder.final_layernorm                       -> vision_tower.post_norm
    mm_projector.{proj.0, proj.2, post_norm}                   -> multi_modal_projector.{linear_1, linear_2, norm}

Loading sharded: transformers reads each checkpoint tensor as this rank's part of the target parameter before the
conversions run. Tensor parallelism keeps the KDA conv, `A_log` and `dt_bias` whole (`distributed/tensor_parallel.py`);
under FSDP (`DistributedConfig(fsdp_size=...)`) the conversions that merge, split or trim a tensor (the q | k | v conv,
`A_log`, `wqkv`) gather the whole tensors from the ranks and keep this rank's shard of the result
(`distributed/sharded_loading.py`).

The config side is `KdaMoeTextConfig._from_kimi_linear_keys` (Kimi Linear keys) and
`KdaMoeConfig._from_kimi_linear_keys` (K3 keys); `KdaMoeTextConfig.to_kimi_linear_dict` and
`KdaMoeConfig.to_kimi_k3_dict` write them.

Saving: transformers' `save_pretrained` (with its default `save_original_format=True`) runs the reverse of the
conversions in `model._weight_conversions`. By default those are the ones the model was loaded with, so a model
loaded from a published layout writes that layout back, with the same weight names and its `config.json` spelling,
and one loaded from ours (or built in memory: `KdaMoePreTrainedModel._weight_conversions` is empty) writes ours.
`save_pretrained(..., layout=...)` swaps in the conversions of the layout asked for (`layout_conversions`) while
it saves; `quantize_experts="mxfp4"` swaps the mxfp4 expert converters in for the dense ones, whose reverse packs
the experts again (`RepackingConverter`). A few converters (`A_log`, the patch embedding) keep their key, so a
checkpoint of ours also goes through them; their reverse reads the layout being written from the conversions in
place (`checkpoint_layout`).
"""

import math

import torch
import transformers
from transformers.conversion_mapping import get_model_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    ConversionOps,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
)

from ..configuration import KdaMoeConfig, KdaMoeTextConfig, KdaMoeVisionConfig
from ..distributed.sharded_loading import on_whole_tensors
from ..kernels.moe import MXFP4_GROUP, Mxfp4Weight

# K3 stores `A_log` zero-padded to a multiple of this many heads (96 real heads in 128 slots).
K3_HEAD_PAD = 128


def sub_config(config, key: str):
    """The text or vision config of `config` (itself when it is not the composite config)."""
    return getattr(config, key, config)


class KeepsKey(ConversionOps):
    """A conversion whose checkpoint key is the same in every layout: it also runs on our own checkpoints, so using
    it says nothing about the layout a model was loaded from."""


def checkpoint_layout(model) -> str:
    """The layout `save_pretrained` writes for `model`: the one the model was loaded from (ours for a model built in
    memory)."""
    used = [
        conversion
        for conversion in getattr(model, "_weight_conversions", None) or ()
        if not (isinstance(conversion, WeightConverter) and isinstance(conversion.operations[0], KeepsKey))
    ]
    if any(is_k3_only(conversion) for conversion in used):
        return "kimi_k3"
    return "kimi_linear" if used else "kda_moe"


class HeadsFromPublished(KeepsKey):
    """`A_log` as a published layout stores it -> our `[H]`: Kimi Linear's broadcast-ready `[1, 1, H, 1]`, K3's
    fp32 vector zero-padded to a multiple of 128 heads (the first H entries are the real heads).

    Tensor parallelism keeps `A_log` whole (the `kda_heads` style); FSDP shards it, and the conversion runs on the
    whole stored tensor (`on_whole_tensors`)."""

    @torch.no_grad()
    @on_whole_tensors
    def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        tensor = (tensors[0] if isinstance(tensors, list) else tensors).reshape(-1)
        heads = sub_config(config, "text_config").linear_num_heads
        if tensor.numel() < heads:
            raise ValueError(
                f"The checkpoint's `A_log` has {tensor.numel()} entries but the config has linear_num_heads={heads}; "
                "the config.json does not belong to these weights."
            )
        return {target_patterns[0]: tensor[:heads]}

    @property
    def reverse_op(self) -> ConversionOps:
        return HeadsToPublished()


class HeadsToPublished(KeepsKey):
    """The reverse of `HeadsFromPublished` for the layout being written: `[1, 1, H, 1]` (Kimi Linear), fp32 zero-padded
    to a multiple of 128 (K3), `[H]` (ours)."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, model=None, **kwargs) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        layout = checkpoint_layout(model)
        if layout == "kimi_linear":
            tensor = tensor.reshape(1, 1, -1, 1)
        elif layout == "kimi_k3":
            padded = -(-tensor.numel() // K3_HEAD_PAD) * K3_HEAD_PAD
            tensor = torch.nn.functional.pad(tensor.float(), (0, padded - tensor.numel()))
        return {target_patterns[0]: tensor}

    @property
    def reverse_op(self) -> ConversionOps:
        return HeadsFromPublished()


class PatchEmbedFromConv(KeepsKey):
    """The patch embedding stored as a stride-P conv `[D, C, P, P]` (K3) -> our linear map `[D, C*P*P]` (the
    processor flattens each patch channel-major, as the conv reads it); a `[D, C*P*P]` tensor stays as it is."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        return {target_patterns[0]: tensor.flatten(1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return PatchEmbedToConv()


class PatchEmbedToConv(KeepsKey):
    """The reverse of `PatchEmbedFromConv`: `[D, C, P, P]` when writing the K3 layout."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, model=None, config=None, **kwargs):
        (tensors,) = input_dict.values()
        tensor = tensors[0] if isinstance(tensors, list) else tensors
        if checkpoint_layout(model) == "kimi_k3":
            vision = sub_config(config, "vision_config")
            tensor = tensor.reshape(tensor.shape[0], vision.num_channels, vision.patch_size, vision.patch_size)
        return {target_patterns[0]: tensor}

    @property
    def reverse_op(self) -> ConversionOps:
        return PatchEmbedFromConv()


def moonvit_rope_permutation(head_dim: int) -> torch.Tensor:
    """Row order that turns MoonViT's rotary layout of one head into ours: `ours = moonvit[permutation]`.

    MoonViT rotates complex pairs `(2p, 2p + 1)`, pair `2i` by the column angle of frequency i and pair `2i + 1` by
    the row angle; ours rotates the first half of the head by the row, the second by the column, each half in
    `rotate_half` order (all real parts, then all imaginary parts), the same frequencies in the same order.
    """
    # MoonViT index of (frequency i, axis a: 0 = column, 1 = row, part c: 0 = real, 1 = imaginary) is 4i + 2a + c;
    # ours orders (axis: row first, part, frequency).
    moonvit = torch.arange(head_dim).view(head_dim // 4, 2, 2)  # [i, a, c]
    return moonvit.flip(1).permute(1, 2, 0).reshape(-1)


class MoonViTQkvToOurs(ConversionOps):
    """`wqkv` `[3D, D]` -> q, k, v `[D, D]` each, with the rows of q and k permuted per head into our rotary layout
    (`moonvit_rope_permutation`); whole `wqkv` where FSDP shards q, k, v (`on_whole_tensors`)."""

    def __init__(self, inverse: bool = False):
        self.inverse = inverse

    @torch.no_grad()
    @on_whole_tensors
    def convert(self, input_dict, source_patterns, target_patterns, config=None, **kwargs):
        vision = sub_config(config, "vision_config")
        permutation = moonvit_rope_permutation(vision.head_dim)
        if self.inverse:
            permutation = torch.argsort(permutation)

        def permute_heads(weight):  # [H * hd, D]
            return weight.view(vision.num_attention_heads, vision.head_dim, -1)[:, permutation].reshape(weight.shape)

        if self.inverse:
            q, k, v = (input_dict[pattern] for pattern in source_patterns)
            q, k, v = (tensor[0] if isinstance(tensor, list) else tensor for tensor in (q, k, v))
            return {target_patterns[0]: torch.cat([permute_heads(q), permute_heads(k), v])}
        (tensors,) = input_dict.values()
        q, k, v = (tensors[0] if isinstance(tensors, list) else tensors).chunk(3)
        return dict(zip(target_patterns, (permute_heads(q), permute_heads(k), v)))

    @property
    def reverse_op(self) -> ConversionOps:
        return MoonViTQkvToOurs(inverse=not self.inverse)


class ConcatenateWhole(Concatenate):
    """`Concatenate` of the whole checkpoint tensors where FSDP shards the target (`on_whole_tensors`): each rank's
    rows of the published `{q,k,v}_conv1d` weights are not its shard of our one conv."""

    convert = on_whole_tensors(Concatenate.convert)


class DequantizeMxfp4(ConversionOps):
    """Routed experts stored mxfp4 by compressed-tensors -> dense weights, one per expert, before they are merged; or,
    for experts kept mxfp4 (`routed_expert_format="mxfp4"`: uint8 parameters), each expert's packed rows as they are,
    every row's scales after its packed bytes (`kernels.moe.Mxfp4Weight.from_rows`).

    Format `mxfp4-pack-quantized`: `weight_packed` `[out, in / 2]` uint8 (two E2M1 values a byte) and `weight_scale`
    `[out, in / 32]` uint8 (one E8M0 power of two per 32 weights). The values are decoded by compressed-tensors' own
    compressor for that format, with the scheme of the config group whose targets name the experts.

    Why not transformers' compressed-tensors quantizer: with a checkpoint's own settings it prepares the model with
    `apply_quantization_config` / `compress_model`, which give packed parameters to the `nn.Linear` modules its
    targets match; our routed experts are fused `[E, 2I, l]` / `[E, l, I]` parameters of one module, so the packed
    tensors would have nowhere to land. The config keeps the checkpoint's `quantization_config` as
    `routed_expert_quantization`, where transformers does not look, and the expert converters dequantize here.
    """

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, config=None, model=None, full_layer_name=None, **kwargs):
        compressor, scheme = mxfp4_codec(getattr(config, "routed_expert_quantization", None))
        parameter = model.get_parameter(full_layer_name)
        kept_packed = parameter.dtype == torch.uint8
        if kept_packed and scheme.weights.group_size != MXFP4_GROUP:
            raise ValueError(
                f"Experts kept mxfp4 take one scale per {MXFP4_GROUP} weights, but the checkpoint's "
                f"quantization_config groups {scheme.weights.group_size}; load them with routed_expert_format='dense'."
            )
        check_whole_scale_groups(parameter, full_layer_name, scheme.weights.group_size, kept_packed)
        dtype = parameter.dtype  # the loader keeps a converter's output dtype

        def expert_rows(packed, scale):  # one expert's [out, in / 2] values and [out, in / 32] scales
            # The loader casts every checkpoint tensor to the parameter's dtype; bytes are integers < 256, which
            # fp32 / bf16 / fp16 hold exactly, so the cast back is lossless.
            packed, scale = packed.to(torch.uint8), scale.to(torch.uint8)
            if kept_packed:
                return torch.cat([packed, scale], dim=-1)
            return compressor.decompress({"weight_packed": packed, "weight_scale": scale}, scheme)["weight"].to(dtype)

        return {
            packed_pattern: [expert_rows(p, s) for p, s in zip(input_dict[packed_pattern], input_dict[scale_pattern])]
            for packed_pattern, scale_pattern in zip(source_patterns[::2], source_patterns[1::2])
        }


def check_whole_scale_groups(
    parameter: torch.Tensor, name: str, group_size: int, kept_packed: bool = False
) -> None:
    """Refuse an expert parameter sharded inside its scale groups, before its mxfp4 weights are decoded.

    The loader hands each rank its slice of the stored `weight_packed` / `weight_scale` before `DequantizeMxfp4` runs,
    so a parameter sharded along its input features (the last dim; transformers <= 5.18's tensor-parallel plan splits
    `down_proj`'s intermediate dim) must leave every rank whole groups of `group_size` weights. Experts kept packed
    hold a row's bytes and its scales side by side, so no split of their last dim is whole groups."""
    if not hasattr(parameter, "placements"):  # a whole tensor on every rank
        return
    last = parameter.ndim - 1
    pieces = math.prod(
        parameter.device_mesh.size(mesh_dim)
        for mesh_dim, placement in enumerate(parameter.placements)
        if getattr(placement, "dim", None) in (last, -1)
    )
    if kept_packed and pieces > 1:
        raise ValueError(
            f"`{name}` holds mxfp4 experts kept packed (routed_expert_format='mxfp4'), whose rows cannot be split over "
            f"{pieces} ranks; load them with routed_expert_format='dense' for tensor parallelism."
        )
    features = parameter.shape[last]
    if not kept_packed and features % (pieces * group_size):
        raise ValueError(
            f"`{name}` splits its {features} input features over {pieces} ranks ({features / pieces:g} a rank), but the "
            f"checkpoint stores the routed experts mxfp4 with one scale per {group_size} weights, and transformers "
            f"{transformers.__version__} hands every rank its slice of the packed weights before they are decoded: "
            f"each rank needs a multiple of {group_size}. Use a tensor-parallel size that divides "
            f"{features // group_size} ({features} / {group_size}), place the experts whole with expert parallelism "
            "(`enable_expert_parallel=True`), or install transformers >= 5.19, whose tensor-parallel plan keeps every "
            "expert whole."
        )


def require_compressed_tensors() -> None:
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "mxfp4 routed experts are read and written by compressed-tensors; `pip install kda-moe[k3]` (or "
            "`pip install compressed-tensors`)."
        ) from error


def mxfp4_codec(quantization: dict | None):
    """(compressed-tensors compressor, scheme) of the routed experts for a checkpoint's `quantization_config`."""
    if quantization is None:
        raise ValueError(
            "The checkpoint stores routed experts packed (`weight_packed` / `weight_scale`) but its config.json has no "
            "`quantization_config`; the config does not belong to these weights."
        )
    require_compressed_tensors()
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(quantization)
    schemes = [group for group in config.config_groups.values() if any("experts" in target for target in group.targets)]
    if len(schemes) != 1:
        raise ValueError(
            "Expected exactly one compressed-tensors config group whose targets name the routed experts, got "
            f"{[group.targets for group in config.config_groups.values()]}."
        )
    (scheme,) = schemes
    return BaseCompressor.get_value_from_registry(scheme.format or config.format), scheme


# Spellings loading accepts that no layout writer produces: transformers' in-memory forget-gate module, and the dense
# MLP under `block_sparse_moe.` (transformers' save puts it there; the published folders keep it under `mlp.`, which
# transformers reads too).
FORGET_GATE_MODULE = r"self_attn\.forget_gate\.(f_a_proj|f_b_proj|dt_bias|A_log)"
DENSE_MLP_UNDER_MOE = r"\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\."


def kimi_linear_conversions() -> list[WeightRenaming | WeightConverter]:
    """The text decoder's transforms, in transformers' order: every matching renaming applies, then at most one
    converter. Kimi Linear's come first, then K3's (`is_k3_only`).

    Saving runs them backwards, each target pattern becoming a regex: their dots are escaped, so `.mlp.gate.` never
    matches `.mlp.gate_proj.` nor `.experts.` `shared_experts.`; converter patterns leave out the parts of a name that
    renamings change, so both directions compose on every supported version.
    """
    return [
        WeightRenaming(FORGET_GATE_MODULE, r"self_attn\.\1"),
        WeightRenaming(r"\.block_sparse_moe\.(gate|experts|shared_experts)\.", r"\.mlp\.\1\."),
        WeightRenaming(DENSE_MLP_UNDER_MOE, r"\.mlp\.\1\."),
        WeightRenaming(r"\.block_sparse_moe\.routed_expert_(down_proj|up_proj|norm)\.", r"\.mlp\.latent_\1\."),
        WeightRenaming(r"\.self_attention_res_(norm|proj)\.", r"\.attn_res\.\1\."),
        WeightRenaming(r"\.mlp_res_(norm|proj)\.", r"\.mlp_res\.\1\."),
        WeightRenaming(r"output_attn_res_(norm|proj)\.", r"out_res\.\1\."),
        WeightConverter(
            source_patterns=["self_attn.q_conv1d.weight", "self_attn.k_conv1d.weight", "self_attn.v_conv1d.weight"],
            target_patterns="self_attn.conv1d.weight",
            operations=[ConcatenateWhole(dim=0)],
        ),
        # mxfp4 first: converters are tried in order, and on transformers 5.17 `w1.weight` also matches `w1.weight_packed`
        *mxfp4_expert_converters(),
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
        WeightConverter(source_patterns="A_log", target_patterns="A_log", operations=[HeadsFromPublished()]),
    ]


class DequantizingConverter(WeightConverter):
    """A converter whose first op dequantizes: saving reverses the dense converter it stands for, so a model loaded
    from mxfp4 experts writes them unquantized under the dense names (`experts.j.w1.weight`, ...), unless the class
    repacks (`RepackingConverter`)."""

    __slots__ = ()
    repacks = False

    def reverse_transform(self) -> WeightConverter:
        dense = WeightConverter(
            source_patterns=[p.removesuffix("_packed") for p in self._original_source_patterns if p.endswith("_packed")],
            target_patterns=self._original_target_patterns,
            operations=self.operations[1:],
        )
        dense.scope_prefix, dense.base_model_prefix = self.scope_prefix, self.base_model_prefix
        reverse = dense.reverse_transform()
        if self.repacks:
            reverse.operations.append(QuantizeMxfp4())
        return reverse


class RepackingConverter(DequantizingConverter):
    """`DequantizingConverter` whose reverse packs each expert's weights back to mxfp4
    (`save_pretrained(..., layout="kimi_k3", quantize_experts="mxfp4")`)."""

    __slots__ = ()
    repacks = True


class QuantizeMxfp4(ConversionOps):
    """Per-expert dense weights -> mxfp4 `weight_packed` / `weight_scale`, by compressed-tensors: the group scales
    from its `calculate_qparams`, the packing by its compressor for the format (`mxfp4_codec`), with the config's
    `routed_expert_quantization` or, for a model that was not loaded mxfp4, `mxfp4_quantization_config()`. Experts
    kept mxfp4 (uint8 rows) are split into their bytes and scales as they are."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, config=None, full_layer_name=None, **kwargs):
        from compressed_tensors.quantization.utils.helpers import calculate_qparams

        quantization = getattr(config, "routed_expert_quantization", None) or mxfp4_quantization_config()
        compressor, scheme = mxfp4_codec(quantization)
        group = scheme.weights.group_size
        # The loader expands the converter's keys into full names with the part of `full_layer_name` around a key it
        # contains; "weight_packed" is in none of them, so the full names are built here.
        layer_name = full_layer_name.replace("*.", "0.")
        prefix, _, suffix = next(layer_name.partition(key) for key in input_dict if key in layer_name)
        packed = {}
        for key, tensors in input_dict.items():
            weight = tensors[0] if isinstance(tensors, list) else tensors  # [out, in], or [out, in / 2 + in / 32] bytes
            if weight.dtype == torch.uint8:
                compressed = dict(zip(("weight_packed", "weight_scale"), Mxfp4Weight.from_rows(weight)))
            else:
                groups = weight.float().view(weight.shape[0], -1, group)
                scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
                compressed = compressor.compress(
                    {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}, scheme
                )
            for part in ("packed", "scale"):
                packed[f"{prefix}{key}{suffix}_{part}"] = compressed[f"weight_{part}"].contiguous()
        return packed


def mxfp4_quantization_config() -> dict:
    """The `quantization_config` of K3's routed experts: compressed-tensors' `MXFP4A16` preset (E2M1 weights, one
    E8M0 scale per 32, activations unquantized) on the experts only, format `mxfp4-pack-quantized`."""
    require_compressed_tensors()
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme("MXFP4A16", [r"re:.*block_sparse_moe\.experts\..*"])
    scheme.format = MXFP4_FORMAT
    config = QuantizationConfig(
        config_groups={"group_0": scheme}, format=MXFP4_FORMAT, quantization_status="compressed"
    )
    return config.model_dump(mode="json")


MXFP4_FORMAT = "mxfp4-pack-quantized"


def mxfp4_expert_converters() -> list[WeightConverter]:
    """K3's routed experts stored mxfp4: dequantized per expert (`DequantizeMxfp4`), then merged as dense ones are."""
    return [
        DequantizingConverter(
            source_patterns=[rf"\.experts.*.{w}.weight_{part}" for w in ("w1", "w3") for part in ("packed", "scale")],
            target_patterns=r"\.experts\.gate_up_proj",
            operations=[DequantizeMxfp4(), MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        DequantizingConverter(
            source_patterns=[r"\.experts.*.w2.weight_packed", r"\.experts.*.w2.weight_scale"],
            target_patterns=r"\.experts\.down_proj",
            operations=[DequantizeMxfp4(), MergeModulelist(dim=0)],
        ),
    ]


def moonvit_conversions() -> list[WeightRenaming | WeightConverter]:
    """The vision tower's transforms (scoped to `vision_tower.`), K2.5's MoonViT names -> ours. Every source is
    anchored at the start of the tower's key, so a renamed key (`blocks.N.norm1.`) is never renamed again
    (`encoder.blocks.N.norm1.` -> `norm2`), in either direction."""
    block = r"^encoder\.blocks\.(\d+)\."
    return [
        WeightRenaming(block + r"norm0\.", r"blocks\.\1\.norm1\."),
        WeightRenaming(block + r"norm1\.", r"blocks\.\1\.norm2\."),
        WeightRenaming(block + r"wo\.", r"blocks\.\1\.attn\.o_proj\."),
        WeightRenaming(block + r"mlp\.fc0\.", r"blocks\.\1\.mlp\.fc1\."),
        WeightRenaming(block + r"mlp\.fc1\.", r"blocks\.\1\.mlp\.fc2\."),
        WeightRenaming(block + r"wqkv\.", r"blocks\.\1\.wqkv\."),
        WeightRenaming(r"^encoder\.final_layernorm\.", r"post_norm\."),
        WeightRenaming(r"^patch_embed\.pos_emb\.", r"pos_emb\."),
        WeightConverter(
            source_patterns="wqkv.weight",
            target_patterns=["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"],
            operations=[MoonViTQkvToOurs()],
        ),
        WeightConverter(
            source_patterns="patch_embed.proj.weight",
            target_patterns="patch_embed.proj.weight",
            operations=[PatchEmbedFromConv()],
        ),
    ]


def kimi_k3_conversions() -> list[WeightRenaming]:
    """The multimodal model's own transforms: K3's top-level prefixes -> ours (the sub-models' names are converted by
    their own tables, scoped to `model.language_model.` / `model.vision_tower.`)."""
    return [
        WeightRenaming(r"^language_model\.model\.", r"model\.language_model\."),
        WeightRenaming(r"^language_model\.lm_head\.", r"lm_head\."),
        WeightRenaming(r"^vision_tower\.", r"model\.vision_tower\."),
        WeightRenaming(r"^mm_projector\.proj\.0\.", r"model\.multi_modal_projector\.linear_1\."),
        WeightRenaming(r"^mm_projector\.proj\.2\.", r"model\.multi_modal_projector\.linear_2\."),
        WeightRenaming(r"^mm_projector\.post_norm\.", r"model\.multi_modal_projector\.norm\."),
    ]


# Source patterns of the transforms only the K3 layout uses (Kimi Linear's text layout uses the others).
K3_ONLY_SOURCES = frozenset(
    pattern
    for conversions in (kimi_k3_conversions(), moonvit_conversions(), kimi_linear_conversions()[3:7], mxfp4_expert_converters())
    for conversion in conversions
    for pattern in conversion._original_source_patterns
)


def is_k3_only(conversion) -> bool:
    return conversion._original_source_patterns[0] in K3_ONLY_SOURCES


LAYOUTS = ("kda_moe", "kimi_linear", "kimi_k3")
QUANTIZED_EXPERT_FORMATS = ("mxfp4",)


def layout_conversions(model, layout: str, quantize_experts: str | None = None) -> list[WeightTransform]:
    """The transforms whose reverse `save_pretrained` runs to write `model` in `layout`: the model's registered
    tables, scoped to its sub-models as loading scopes them, less the spellings only loading reads (the forget-gate
    module, the dense MLP under `block_sparse_moe.`), K3's parts for Kimi Linear, and the mxfp4 or the dense expert
    converters (`quantize_experts`). Raises, naming the part, where `layout` cannot express the model."""
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown checkpoint layout {layout!r}; choose one of {LAYOUTS}.")
    if quantize_experts is not None:
        if quantize_experts not in QUANTIZED_EXPERT_FORMATS:
            raise ValueError(
                f"Unknown expert quantization {quantize_experts!r}; choose one of {QUANTIZED_EXPERT_FORMATS}."
            )
        if layout != "kimi_k3":
            raise ValueError(
                f"quantize_experts={quantize_experts!r} is a format of the Kimi K3 layout; pass layout='kimi_k3'."
            )
        require_compressed_tensors()
    multimodal = isinstance(model.config, KdaMoeConfig)
    if layout == "kimi_linear" and multimodal:
        raise ValueError(
            "The Kimi Linear layout is a text model and cannot express this model's vision tower and projector; write "
            "layout='kimi_k3', or save the text decoder alone."
        )
    if layout == "kimi_k3" and not multimodal:
        raise ValueError(
            f"The Kimi K3 layout is the multimodal model (`language_model.` / `vision_tower.` / `mm_projector.`); a "
            f"{type(model).__name__} has no vision tower. Write layout='kimi_linear' or 'kda_moe'."
        )
    if layout == "kda_moe":
        return []
    mxfp4 = {pattern for converter in mxfp4_expert_converters() for pattern in converter._original_source_patterns}
    dense_experts = {pattern.removesuffix("_packed") for pattern in mxfp4 if pattern.endswith("_packed")}
    skipped = {FORGET_GATE_MODULE, DENSE_MLP_UNDER_MOE} | (dense_experts if quantize_experts else mxfp4)
    if layout == "kimi_linear":
        skipped |= K3_ONLY_SOURCES
    conversions = []
    for conversion in get_model_conversion_mapping(model, add_legacy=False):
        if conversion._original_source_patterns[0] in skipped:
            continue
        if isinstance(conversion, DequantizingConverter):
            repacking = RepackingConverter(
                conversion._original_source_patterns, conversion._original_target_patterns, conversion.operations
            )
            repacking.scope_prefix, repacking.base_model_prefix = conversion.scope_prefix, conversion.base_model_prefix
            conversion = repacking
        conversions.append(conversion)
    return conversions


def layout_config_dict(model, layout: str, quantize_experts: str | None = None) -> dict | None:
    """`config.json` of `model` in a published `layout` (None for ours, which transformers writes itself)."""
    if layout == "kimi_linear":
        return model.config.to_kimi_linear_dict()
    if layout == "kimi_k3":
        quantization = None
        if quantize_experts is not None:
            quantization = model.config.routed_expert_quantization or mxfp4_quantization_config()
        return model.config.to_kimi_k3_dict(quantization_config=quantization)
    return None


# Looked up by class name first, then by `config.model_type`: a Kimi Linear folder says `model_type: kimi_linear`, but
# loaded through our classes its config is a `KdaMoeTextConfig`, whose `model_type` is always ours. `overwrite=True`
# keeps a second import of the package (e.g. under another name) harmless.
register_checkpoint_conversion_mapping(KdaMoeTextConfig.model_type, kimi_linear_conversions(), overwrite=True)
register_checkpoint_conversion_mapping(KdaMoeVisionConfig.model_type, moonvit_conversions(), overwrite=True)
register_checkpoint_conversion_mapping(KdaMoeConfig.model_type, kimi_k3_conversions(), overwrite=True)

__all__ = [
    "LAYOUTS",
    "checkpoint_layout",
    "layout_config_dict",
    "layout_conversions",
    "mxfp4_quantization_config",
    "kimi_k3_conversions",
    "kimi_linear_conversions",
    "moonvit_conversions",
    "moonvit_rope_permutation",
]
