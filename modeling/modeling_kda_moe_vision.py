"""The kda-moe vision tower and the multimodal model (K3 "MoonViT-V2" style).

Reading order: patch embedding -> interpolated 2D position table -> 2D rotary embedding -> attention over packed
images -> MLP -> vision block -> `KdaMoeVisionModel` (with the 2x2 patch merger) -> projector ->
`KdaMoeModel` (vision + projector + `KdaMoeTextModel`) -> `KdaMoeForConditionalGeneration`.

Images arrive flattened and packed: `pixel_values` [total_patches, channels * patch * patch] with the patches of each
image in row-major order, and `image_grid_thw` [num_images, 3] = (1, grid_h, grid_w) per image (the layout of
transformers' Qwen2-VL / Kimi-K2.5 processors, so their tooling recognises it). One forward of the tower attends
within each image only (block-diagonal, varlen attention), so several images packed together give exactly the
features each gives alone. Each merged patch (2x2 neighbours) becomes one `<|media_pad|>` token of the text.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling, MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.import_utils import is_tracing

from ..compat import accepts_legacy_cache_name, model_output, output_cache
from ..configuration import KdaMoeConfig, KdaMoeVisionConfig
from .modeling_kda_moe import (
    KdaMoePreTrainedModel,
    KdaMoeRMSNorm,
    KdaMoeTextModel,
    causal_lm_head,
    check_input_ids,
    eager_attention_forward,
    rotate_half,
)


@dataclass
class KdaMoeModelOutputWithPast(MoeModelOutputWithPast):
    r"""`MoeModelOutputWithPast` plus `image_hidden_states`: the projected image features of this forward
    ([num_merged_patches, text hidden]), or None when it saw no image."""

    image_hidden_states: torch.FloatTensor | None = None


@dataclass
class KdaMoeCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""`MoeCausalLMOutputWithPast` plus `image_hidden_states` (see `KdaMoeModelOutputWithPast`)."""

    image_hidden_states: torch.FloatTensor | None = None


def image_grid_sizes(image_grid_thw: torch.Tensor) -> list[tuple[int, int]]:
    """(grid_h, grid_w) per image of an `image_grid_thw` [num_images, 3] tensor (t = 1 for images)."""
    return [(int(h), int(w)) for _, h, w in image_grid_thw.tolist()]


# ----------------------------------------------------------------------------------------------------------------
# Patch embedding and the interpolated learnable 2D position table
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeVisionPatchEmbed(nn.Module):
    """A bias-free linear map of each flattened `channels x patch x patch` patch (= a stride-`patch` conv)."""

    def __init__(self, config: KdaMoeVisionConfig):
        super().__init__()
        self.proj = nn.Linear(config.num_channels * config.patch_size**2, config.hidden_size, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C * P * P] -> [N, D]."""
        return self.proj(pixel_values)


class KdaMoeVisionPositionEmbedding(nn.Module):
    """A learnable `[pos_emb_height, pos_emb_width, D]` table, bicubically resampled to every image's grid."""

    def __init__(self, config: KdaMoeVisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.pos_emb_height, config.pos_emb_width, config.hidden_size))

    def forward(self, grid_sizes: list[tuple[int, int]]) -> torch.Tensor:
        """-> [sum(h * w), D], row-major per image, in fp32-resampled then cast to the table's dtype."""
        table = self.weight.permute(2, 0, 1)[None].float()  # [1, D, Hp, Wp]
        resampled = {}
        for size in set(grid_sizes):
            if size == tuple(self.weight.shape[:2]):
                grid = table
            else:
                grid = F.interpolate(table, size=size, mode="bicubic", align_corners=False)
            resampled[size] = grid[0].flatten(1).transpose(0, 1)  # [h * w, D]
        return torch.cat([resampled[size] for size in grid_sizes]).to(self.weight.dtype)


# ----------------------------------------------------------------------------------------------------------------
# 2D rotary embedding: first half of each head rotated by the patch row, second half by the column
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeVisionRotaryEmbedding(nn.Module):
    def __init__(self, config: KdaMoeVisionConfig):
        super().__init__()
        self.inv_freq = nn.Buffer(self.compute_inv_freq(config), persistent=False)  # [head_dim / 4]

    @staticmethod
    def compute_inv_freq(config: KdaMoeVisionConfig) -> torch.Tensor:
        axis_dim = config.head_dim // 2  # rotary width per image axis
        return 1.0 / (config.rope_theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float) / axis_dim))

    @torch.no_grad()
    def forward(self, grid_sizes: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """-> cos, sin [N, head_dim] (fp32): `[row angles | row angles | col angles | col angles]`."""
        positions = []
        for h, w in grid_sizes:
            rows = torch.arange(h, device=device).repeat_interleave(w)
            cols = torch.arange(w, device=device).repeat(h)
            positions.append(torch.stack([rows, cols], dim=-1))
        positions = torch.cat(positions).float()  # [N, 2]
        freqs = positions[..., None] * self.inv_freq.to(device)  # [N, 2, head_dim / 4]
        emb = torch.cat([freqs, freqs], dim=-1).flatten(1)  # [N, head_dim]
        return emb.cos(), emb.sin()


def apply_2d_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [1, H, N, head_dim], cos/sin [N, head_dim]: RoPE on each half of the head separately, in fp32."""
    dtype = x.dtype
    x = x.float()
    rotated = rotate_half(x.unflatten(-1, (2, -1))).flatten(-2)  # rotate_half within the row half and the col half
    return (x * cos + rotated * sin).to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# Attention over packed images (block-diagonal), MLP, block
# ----------------------------------------------------------------------------------------------------------------


def block_diagonal_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, N, N]: 0 inside each image's block, the dtype's minimum elsewhere."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    image_index = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    same_image = image_index[:, None] == image_index[None, :]
    mask = torch.zeros(same_image.shape, dtype=dtype, device=cu_seqlens.device)
    return mask.masked_fill_(~same_image, torch.finfo(dtype).min)[None, None]


class KdaMoeVisionAttention(nn.Module):
    """Bias-free multi-head attention with 2D RoPE; packed images never attend to each other.

    Flash attention runs varlen over `cu_seqlens`; the other implementations (eager, sdpa) get a block-diagonal
    additive mask, so every image is attended exactly as if it were alone.
    """

    def __init__(self, config: KdaMoeVisionConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.num_key_value_groups = 1
        self.is_causal = False
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq_len = hidden_states.shape[0]
        head_shape = (1, seq_len, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(head_shape).transpose(1, 2)  # [1, H, N, hd]
        key = self.k_proj(hidden_states).view(head_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(head_shape).transpose(1, 2)
        query = apply_2d_rotary_pos_emb(query, *position_embeddings)
        key = apply_2d_rotary_pos_emb(key, *position_embeddings)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        if "flash" in (self.config._attn_implementation or ""):
            kwargs.update(
                cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens, max_length_q=max_seqlen, max_length_k=max_seqlen
            )
            attention_mask = None
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            is_causal=False,
            **kwargs,
        )  # [1, N, H, hd]
        return self.o_proj(attn_output.reshape(seq_len, -1)), attn_weights


class KdaMoeVisionMLP(nn.Module):
    def __init__(self, config: KdaMoeVisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act_fn(self.fc1(hidden_states)))


class KdaMoeVisionBlock(GradientCheckpointingLayer):
    """Pre-norm ViT block: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`."""

    def __init__(self, config: KdaMoeVisionConfig):
        super().__init__()
        self.norm1 = KdaMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = KdaMoeVisionAttention(config)
        self.norm2 = KdaMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = KdaMoeVisionMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        update, _ = self.attn(
            self.norm1(hidden_states),
            position_embeddings=position_embeddings,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            attention_mask=attention_mask,
            **kwargs,
        )
        hidden_states = hidden_states + update
        return hidden_states + self.mlp(self.norm2(hidden_states))


# ----------------------------------------------------------------------------------------------------------------
# Vision tower
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeVisionPreTrainedModel(PreTrainedModel):
    config: KdaMoeVisionConfig
    config_class = KdaMoeVisionConfig
    base_model_prefix = "vision_tower"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["KdaMoeVisionBlock"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = False

    def __init__(self, config, *inputs, **kwargs):
        config.validate()  # the rules relating fields: an edit after the config was built is checked here
        super().__init__(config, *inputs, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, KdaMoeVisionPositionEmbedding):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, KdaMoeVisionRotaryEmbedding):  # a non-persistent buffer: rebuilt at every load
            init.copy_(module.inv_freq, module.compute_inv_freq(self.config))


class KdaMoeVisionModel(KdaMoeVisionPreTrainedModel):
    """Patch embedding + interpolated position table -> blocks (2D RoPE, packed images) -> RMSNorm -> 2x2 merger.

    Returns `last_hidden_state` [total_patches, D] and `pooler_output` [total_patches / merge**2, merge**2 * D],
    the concatenated neighbours of every merged patch (row-major over each image's merged grid).
    """

    def __init__(self, config: KdaMoeVisionConfig):
        super().__init__(config)
        self.merge_size = config.spatial_merge_size
        self.patch_embed = KdaMoeVisionPatchEmbed(config)
        self.pos_emb = KdaMoeVisionPositionEmbedding(config)
        self.rotary_emb = KdaMoeVisionRotaryEmbedding(config)
        self.blocks = nn.ModuleList([KdaMoeVisionBlock(config) for _ in range(config.num_hidden_layers)])
        self.post_norm = KdaMoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def check_inputs(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> None:
        config = self.config
        patch_dim = config.num_channels * config.patch_size**2
        if image_grid_thw is None:
            raise ValueError(
                "`pixel_values` came without `image_grid_thw`; pass both as returned by KdaMoeProcessor / "
                "KdaMoeImageProcessor (the grid says where one packed image ends and the next begins)."
            )
        if pixel_values.ndim != 2 or pixel_values.shape[-1] != patch_dim:
            raise ValueError(
                f"`pixel_values` must be [total_patches, {patch_dim}] (flattened {config.num_channels}x"
                f"{config.patch_size}x{config.patch_size} patches, as KdaMoeImageProcessor returns them), got "
                f"{tuple(pixel_values.shape)}."
            )
        if image_grid_thw.ndim != 2 or image_grid_thw.shape[-1] != 3 or (image_grid_thw[:, 0] != 1).any():
            raise ValueError(f"`image_grid_thw` must be [num_images, 3] rows (1, grid_h, grid_w), got {image_grid_thw}.")
        if (image_grid_thw[:, 1:] % self.merge_size).any() or (image_grid_thw[:, 1:] < 1).any():
            raise ValueError(
                f"every grid side in `image_grid_thw` must be a positive multiple of spatial_merge_size="
                f"{self.merge_size}, got {image_grid_thw.tolist()}; resize images with KdaMoeImageProcessor."
            )
        total = int(image_grid_thw.prod(-1).sum())
        if total != pixel_values.shape[0]:
            raise ValueError(
                f"`image_grid_thw` describes {total} patches but `pixel_values` holds {pixel_values.shape[0]}; "
                "pass the pixel values and grids of the same images."
            )
        # One NaN / Inf turns every logit of its sample into NaN. Reading the result on the host is skipped while
        # tracing (torch.compile, CUDA-graph capture).
        if is_tracing(pixel_values):
            return
        finite = pixel_values.isfinite().all(-1)  # [total_patches]
        if not finite.all():
            bad = [i for i, image in enumerate(finite.split(image_grid_thw.prod(-1).tolist())) if not image.all()]
            raise ValueError(
                f"`pixel_values` of image(s) {bad} (0-based, in `image_grid_thw` order) hold NaN or Inf. Check how "
                "those images were loaded and normalised; KdaMoeImageProcessor returns finite values."
            )

    def merge_patches(self, hidden_states: torch.Tensor, grid_sizes: list[tuple[int, int]]) -> torch.Tensor:
        """[N, D] row-major per image -> [N / m**2, m**2 * D]: each m x m window concatenated (rows, then columns)."""
        m = self.merge_size
        merged = []
        for image, (h, w) in zip(hidden_states.split([h * w for h, w in grid_sizes]), grid_sizes):
            windows = image.view(h // m, m, w // m, m, -1).permute(0, 2, 1, 3, 4)  # [h/m, w/m, m, m, D]
            merged.append(windows.reshape((h // m) * (w // m), -1))
        return torch.cat(merged)

    def forward(
        self,
        pixel_values: torch.Tensor,
        image_grid_thw: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPooling:
        self.check_inputs(pixel_values, image_grid_thw)
        grid_sizes = image_grid_sizes(image_grid_thw)
        pixel_values = pixel_values.to(self.patch_embed.proj.weight.dtype)
        hidden_states = self.patch_embed(pixel_values) + self.pos_emb(grid_sizes)

        lengths = torch.tensor([h * w for h, w in grid_sizes], device=hidden_states.device)
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        max_seqlen = int(lengths.max())
        attention_mask = None
        if "flash" not in (self.config._attn_implementation or ""):
            attention_mask = block_diagonal_mask(cu_seqlens, hidden_states.dtype)
        position_embeddings = self.rotary_emb(grid_sizes, hidden_states.device)

        for block in self.blocks:
            hidden_states = block(
                hidden_states,
                position_embeddings=position_embeddings,
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                attention_mask=attention_mask,
                **kwargs,
            )
        hidden_states = self.post_norm(hidden_states)
        return BaseModelOutputWithPooling(
            last_hidden_state=hidden_states, pooler_output=self.merge_patches(hidden_states, grid_sizes)
        )


# ----------------------------------------------------------------------------------------------------------------
# Projector
# ----------------------------------------------------------------------------------------------------------------


class KdaMoeMultiModalProjector(nn.Module):
    """Merged patch -> text hidden size: `Linear -> GELU -> Linear -> RMSNorm`, no biases."""

    def __init__(self, config: KdaMoeConfig):
        super().__init__()
        self.linear_1 = nn.Linear(config.merged_hidden_size, config.projector_hidden_size, bias=False)
        self.act = ACT2FN[config.projector_hidden_act]
        self.linear_2 = nn.Linear(config.projector_hidden_size, config.text_config.hidden_size, bias=False)
        self.norm = KdaMoeRMSNorm(config.text_config.hidden_size, eps=config.projector_rms_norm_eps)

    def forward(self, merged_patches: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear_2(self.act(self.linear_1(merged_patches))))


# ----------------------------------------------------------------------------------------------------------------
# Multimodal model and generation head
# ----------------------------------------------------------------------------------------------------------------

class KdaMoeMultimodalPreTrainedModel(KdaMoePreTrainedModel):
    """Shared base of `KdaMoeModel` / `KdaMoeForConditionalGeneration`: the text model's conventions (stateful
    hybrid cache, fp32 router / decay parameters) plus the vision blocks; sub-models initialise their own weights."""

    config: KdaMoeConfig
    config_class = KdaMoeConfig
    base_model_prefix = "model"
    input_modalities = ("image", "text")
    _no_split_modules = ["KdaMoeDecoderLayer", "KdaMoeVisionBlock"]
    _checkpoint_conversion_mapping = {}

    def _remote_code_classes(self) -> dict[str, type]:
        return {
            "AutoConfig": KdaMoeConfig,
            "AutoModel": KdaMoeModel,
            "AutoModelForImageTextToText": KdaMoeForConditionalGeneration,
        }

    def _init_weights(self, module):
        # Only the modules the composite owns land here (projector, lm_head): the vision tower and the text model
        # are `PreTrainedModel`s and initialise their own. Linear std = text_config.initializer_range.
        PreTrainedModel._init_weights(self, module)


class KdaMoeModel(KdaMoeMultimodalPreTrainedModel):
    """Vision tower -> projector -> image features scattered over the `<|media_pad|>` tokens -> `KdaMoeTextModel`."""

    def __init__(self, config: KdaMoeConfig):
        super().__init__(config)
        self.vision_tower = KdaMoeVisionModel._from_config(config.vision_config)
        self.multi_modal_projector = KdaMoeMultiModalProjector(config)
        self.language_model = KdaMoeTextModel._from_config(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    @can_return_tuple
    def get_image_features(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs: Unpack[TransformersKwargs]
    ) -> BaseModelOutputWithPooling:
        """Vision tower + projector. `pooler_output` is a tuple with one [merged patches, text hidden] tensor per
        image; `last_hidden_state` is the tower's output before merging."""
        vision_outputs = self.vision_tower(pixel_values, image_grid_thw, **kwargs)
        image_embeds = self.multi_modal_projector(vision_outputs.pooler_output)
        split_sizes = (image_grid_thw.prod(-1) // self.config.vision_config.spatial_merge_size**2).tolist()
        vision_outputs.pooler_output = image_embeds.split(split_sizes)
        return vision_outputs

    def get_placeholder_mask(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: where the `<|media_pad|>` tokens are (from `input_ids`, else by matching their embedding)."""
        if input_ids is not None:
            return input_ids == self.config.image_token_id
        token = torch.tensor(self.config.image_token_id, device=inputs_embeds.device)
        return (inputs_embeds == self.get_input_embeddings()(token)).all(-1)

    @can_return_tuple
    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> KdaMoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            check_input_ids(input_ids, self.config.text_config.vocab_size)  # the text model sees embeddings only
            inputs_embeds = self.get_input_embeddings()(input_ids)

        placeholders = self.get_placeholder_mask(input_ids, inputs_embeds)
        # counted on the host, so compiled code (a decoding step) skips the checks that read the count
        num_placeholders = None if is_tracing(inputs_embeds) else int(placeholders.sum())
        image_embeds = None
        if pixel_values is not None:
            image_embeds = torch.cat(self.get_image_features(pixel_values, image_grid_thw).pooler_output)
            image_embeds = image_embeds.to(inputs_embeds.device, inputs_embeds.dtype)
            if num_placeholders is not None and num_placeholders != image_embeds.shape[0]:
                raise ValueError(
                    f"The text has {num_placeholders} `<|media_pad|>` placeholder tokens (id "
                    f"{self.config.image_token_id}) but the {len(image_grid_thw)} image(s) give {image_embeds.shape[0]} "
                    f"merged patches (grids {image_grid_thw.tolist()}). Build the inputs with KdaMoeProcessor, which "
                    "expands one `<|media_pad|>` per image into exactly its merged-patch count."
                )
            inputs_embeds = inputs_embeds.masked_scatter(placeholders[..., None], image_embeds)
        elif num_placeholders and (cache is None or cache.get_seq_length() == 0):
            # Only checked at prefill: a model may sample the placeholder id itself while decoding.
            raise ValueError(
                f"The text has {num_placeholders} `<|media_pad|>` image placeholder tokens but no `pixel_values` were "
                "given; pass the images (KdaMoeProcessor(images=..., text=...)) or remove the placeholders."
            )

        outputs = self.language_model(
            input_ids=None,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        return model_output(
            KdaMoeModelOutputWithPast,
            last_hidden_state=outputs.last_hidden_state,
            cache=output_cache(outputs),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            image_hidden_states=image_embeds,
        )


class KdaMoeForConditionalGeneration(KdaMoeMultimodalPreTrainedModel, GenerationMixin):
    """`KdaMoeModel` + `lm_head`. Generation reuses the text model's hybrid cache; images are encoded only at
    prefill (generate() drops `pixel_values` from every later step)."""

    _tied_weights_keys = {"lm_head.weight": "model.language_model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: KdaMoeConfig):
        super().__init__(config)
        self.model = KdaMoeModel(config)
        self.vocab_size = config.text_config.vocab_size
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.text_config.vocab_size, bias=False)
        self.post_init()

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, **kwargs):
        return self.model.get_image_features(pixel_values, image_grid_thw, **kwargs)

    @can_return_tuple
    @accepts_legacy_cache_name
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> KdaMoeCausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            **kwargs,
        )
        logits, loss = causal_lm_head(self, outputs.last_hidden_state, labels, logits_to_keep, kwargs)
        return model_output(
            KdaMoeCausalLMOutputWithPast,
            loss=loss,
            logits=logits,
            cache=output_cache(outputs),
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            image_hidden_states=outputs.image_hidden_states,
        )


__all__ = [
    "KdaMoeVisionPreTrainedModel",
    "KdaMoeVisionModel",
    "KdaMoeMultimodalPreTrainedModel",
    "KdaMoeModel",
    "KdaMoeForConditionalGeneration",
]
