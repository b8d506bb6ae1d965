"""Configuration of the kda-moe vision tower (`KdaMoeVisionConfig`) and of the multimodal model (`KdaMoeConfig`).

Every default and every validation of the vision tower, the projector and the image placeholder lives here;
modeling code trusts its config. The defaults are a small tower that runs on a laptop CPU;
`KdaMoeVisionConfig.moonvit()` builds the MoonViT-sized tower. Checks run as in `configuration_kda_moe`: a field's
own rule whenever it is set, rules that relate fields in `validate()` (constructor, model build, save).

`KdaMoeConfig` is a composite config (`model_type="kda_moe"`) with two sub-configs, `text_config`
(`KdaMoeTextConfig`) and `vision_config` (`KdaMoeVisionConfig`). transformers 5.17 reads the class attribute
`sub_configs`, 5.20+ `sub_configs_defaults`: both are declared, and the sub-configs are built from dicts / `None`
here, before the parent `__post_init__`, so both versions see config objects.

The published Kimi K3 `config.json` (`model_type: kimi_k3`) loads as it is: `KdaMoeConfig._from_kimi_linear_keys`
turns its spelling (a Kimi Linear `text_config`, a MoonViT `vision_config` in the `vt_*` spelling of Kimi K2.5
that also carries the projector settings, `media_placeholder_token_id`) into ours; `KdaMoeConfig.to_kimi_k3_dict`
writes it back (`save_pretrained(..., layout="kimi_k3")`).
"""

from huggingface_hub.dataclasses import strict, validated_field
from transformers.configuration_utils import PreTrainedConfig

from ..compat import CACHE_NAME, ConfigValidationError, finish_strict_config
from .configuration_kda_moe import (
    KdaMoeTextConfig,
    _invalid,
    at_least,
    non_negative,
    one_of,
    positive,
    probability,
    warn_about_misspelled_keys,
)

VISION_HIDDEN_ACTS = ("gelu_pytorch_tanh",)
PROJECTOR_HIDDEN_ACTS = ("gelu",)
# Id of `<|media_pad|>` in the tokenizer shipped in `kda_moe/processing/tokenizer/` (special tokens come first).
BUNDLED_IMAGE_TOKEN_ID = 6

KIMI_K3_MODEL_TYPE = "kimi_k3"
# `vision_config` keys of the Kimi K3 / K2.5 `config.json` -> `KdaMoeVisionConfig` fields.
MOONVIT_VISION_KEYS = {
    "vt_hidden_size": "hidden_size",
    "vt_intermediate_size": "intermediate_size",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "patch_size": "patch_size",
}
# Projector settings the published `vision_config` carries -> `KdaMoeConfig` fields.
MOONVIT_PROJECTOR_KEYS = {"projector_hidden_act": "projector_hidden_act", "projector_ln_eps": "projector_rms_norm_eps"}
# Published `vision_config` keys about video input (frames merged over time), which this model does not read.
MOONVIT_VIDEO_KEYS = ("init_pos_emb_time", "pos_emb_type", "video_attn_type", "merge_type", "mm_projector_type")


@finish_strict_config
@strict
class KdaMoeVisionConfig(PreTrainedConfig):
    r"""
    Configuration of [`KdaMoeVisionModel`]: a native-resolution ViT (MoonViT-V2 style).

    An image is cut into `patch_size` x `patch_size` patches on a grid whose sides are multiples of
    `spatial_merge_size`; each patch is embedded by a bias-free linear map, a learnable
    `pos_emb_height` x `pos_emb_width` position table is bicubically interpolated to the grid and added, and 2D RoPE
    (first half of every head rotated by the row, second half by the column) is applied inside attention. Several
    images are packed into one sequence with block-diagonal attention. Blocks: pre-norm RMSNorm, bias-free attention
    and GELU-tanh MLP. At the end, `spatial_merge_size` x `spatial_merge_size` neighbours are concatenated (the patch
    merger), giving `spatial_merge_size**2 * hidden_size` features per merged patch.

    Args:
        hidden_size, intermediate_size, num_hidden_layers, num_attention_heads: the usual sizes
            (`head_dim = hidden_size // num_attention_heads` must be a multiple of 4 for 2D RoPE).
        num_channels, patch_size: input channels and patch side in pixels.
        spatial_merge_size: side of the patch merger's window (2 = 2x2 neighbours -> one text token).
        pos_emb_height, pos_emb_width: size of the learnable position table (interpolated to every grid).
        rope_theta: base of the 2D rotary frequencies.
        hidden_act: MLP activation, `"gelu_pytorch_tanh"`.
        rms_norm_eps, initializer_range, attention_dropout: as in the text config.

    Example:

    ```python
    >>> from kda_moe import KdaMoeVisionConfig
    >>> config = KdaMoeVisionConfig()  # tiny
    >>> moonvit = KdaMoeVisionConfig.moonvit()
    ```
    """

    model_type = "kda_moe_vision"
    base_config_key = "vision_config"

    hidden_size: int = validated_field(at_least(1), default=64)
    intermediate_size: int = validated_field(at_least(1), default=128)
    num_hidden_layers: int = validated_field(at_least(1), default=2)
    num_attention_heads: int = validated_field(at_least(1), default=4)
    num_channels: int = validated_field(at_least(1), default=3)
    patch_size: int = validated_field(at_least(1), default=14)
    spatial_merge_size: int = validated_field(at_least(1), default=2)
    pos_emb_height: int = validated_field(at_least(1), default=16)
    pos_emb_width: int = validated_field(at_least(1), default=16)
    rope_theta: float | int = validated_field(positive, default=10000.0)
    hidden_act: str = validated_field(one_of(VISION_HIDDEN_ACTS), default="gelu_pytorch_tanh")
    rms_norm_eps: float | int = validated_field(positive, default=1e-5)
    initializer_range: float | int = validated_field(non_negative, default=0.02)
    attention_dropout: float | int = validated_field(probability, default=0.0)

    def __post_init__(self, **kwargs):
        warn_about_misspelled_keys(self, kwargs)
        super().__post_init__(**kwargs)

    @classmethod
    def moonvit(cls, **overrides) -> "KdaMoeVisionConfig":
        """The MoonViT-sized tower of Kimi VL / K2.5 (hidden 1152, 27 layers, 16 heads, MLP 4304, 64x64 table)."""
        values = {
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "pos_emb_height": 64,
            "pos_emb_width": 64,
        }
        values.update(overrides)
        return cls(**values)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # ----- rules that relate several fields

    def validate_head_dim(self):
        if self.hidden_size % self.num_attention_heads:
            raise _invalid(
                "num_attention_heads", self.num_attention_heads, f"must divide hidden_size={self.hidden_size}"
            )
        if self.head_dim % 4:
            raise _invalid(
                "hidden_size", self.hidden_size,
                f"gives head_dim={self.head_dim}; 2D RoPE needs head_dim = hidden_size / num_attention_heads to be a "
                "multiple of 4 (half of each head per image axis, rotated in pairs)",
            )  # fmt: skip


SUB_CONFIGS = {"text_config": KdaMoeTextConfig, "vision_config": KdaMoeVisionConfig}


@finish_strict_config
@strict
class KdaMoeConfig(PreTrainedConfig):
    r"""
    Configuration of [`KdaMoeModel`] / [`KdaMoeForConditionalGeneration`]: vision tower + projector + text decoder.

    Args:
        text_config (`KdaMoeTextConfig` or `dict`, *optional*): the decoder; default `KdaMoeTextConfig()`.
        vision_config (`KdaMoeVisionConfig` or `dict`, *optional*): the tower; default `KdaMoeVisionConfig()`.
        image_token_id (`int`): id of `<|media_pad|>`; each merged patch replaces one such token. The default is
            its id in the tokenizer shipped with the package.
        projector_hidden_size (`int`, *optional*): width of the projector's hidden layer
            (`Linear(spatial_merge_size**2 * vision hidden, projector_hidden_size) -> GELU -> Linear(-> text hidden)
            -> RMSNorm`); default = the merged width `spatial_merge_size**2 * vision_config.hidden_size`.
        projector_hidden_act: `"gelu"`.
        projector_rms_norm_eps: eps of the projector's final RMSNorm.
        tie_word_embeddings (`bool`, *optional*): tie `lm_head` to the input embeddings; default = the text config's.
        routed_expert_quantization (`dict`, *optional*): the compressed-tensors `quantization_config` of a K3
            checkpoint whose routed experts are stored mxfp4; they are dequantized while loading, or kept packed with
            `text_config.routed_expert_format="mxfp4"` (see `kda_moe.modeling.conversion.DequantizeMxfp4`). Kept
            under this name so transformers' own quantizer, which expects the experts as `nn.Linear` modules, stays
            out of the way.

    Example:

    ```python
    >>> from kda_moe import KdaMoeConfig, KdaMoeForConditionalGeneration
    >>> config = KdaMoeConfig(text_config={"hidden_size": 128}, vision_config={"num_hidden_layers": 2})
    >>> model = KdaMoeForConditionalGeneration(config)
    ```
    """

    model_type = "kda_moe"
    keys_to_ignore_at_inference = [CACHE_NAME]  # the output field Trainer must not gather
    sub_configs = SUB_CONFIGS  # transformers 5.17
    sub_configs_defaults = SUB_CONFIGS  # transformers >= 5.20 (turned into `SubConfigSpec`s by the parent class)

    text_config: dict | PreTrainedConfig | None = None
    vision_config: dict | PreTrainedConfig | None = None
    image_token_id: int = validated_field(at_least(0), default=BUNDLED_IMAGE_TOKEN_ID)
    projector_hidden_size: int | None = validated_field(at_least(1), default=None)
    projector_hidden_act: str = validated_field(one_of(PROJECTOR_HIDDEN_ACTS), default="gelu")
    projector_rms_norm_eps: float | int = validated_field(positive, default=1e-5)
    tie_word_embeddings: bool | None = None
    routed_expert_quantization: dict | None = None

    def __post_init__(self, **kwargs):
        warn_about_misspelled_keys(self, kwargs)
        for key, config_class in SUB_CONFIGS.items():
            value = getattr(self, key)
            if value is None:
                value = config_class()
            elif isinstance(value, dict):
                value = dict(value)
                model_type = value.get("model_type", config_class.model_type)
                if model_type == config_class.model_type:
                    value.pop("model_type", None)
                elif key != "text_config" or model_type != "kimi_linear":  # the text config reads Kimi Linear's
                    raise _invalid(
                        f"{key}.model_type", model_type, f"a kda-moe `{key}` has model_type {config_class.model_type!r}"
                    )
                value = config_class(**value)
            elif not isinstance(value, config_class):
                raise _invalid(key, type(value).__name__, f"must be a dict, None or a {config_class.__name__}")
            setattr(self, key, value)
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = self.text_config.tie_word_embeddings
        if self.projector_hidden_size is None:
            self.projector_hidden_size = self.merged_hidden_size
        super().__post_init__(**kwargs)

    @classmethod
    def _from_kimi_linear_keys(cls, kwargs: dict) -> dict:
        """Turn the keyword arguments of a published Kimi K3 `config.json` (`model_type: kimi_k3`) into ours; other
        keyword arguments pass unchanged. Called on the raw kwargs of every `__init__`.

        `media_placeholder_token_id` -> `image_token_id`; the `vision_config` in MoonViT's spelling (`vt_*`,
        `init_pos_emb_*`, `merge_kernel_size`) -> `KdaMoeVisionConfig` fields, and the projector settings it carries
        (`projector_hidden_act`, `projector_ln_eps`) -> ours; its video keys are dropped (this model reads images
        only); `quantization_config` (mxfp4 routed experts) -> `routed_expert_quantization`. The `text_config` keeps
        the Kimi Linear spelling, which `KdaMoeTextConfig` reads itself.
        """
        if kwargs.get("model_type") != KIMI_K3_MODEL_TYPE:
            return kwargs
        kwargs = dict(kwargs)
        del kwargs["model_type"]
        kwargs.pop("auto_map", None)  # points at Kimi's remote code, not at ours
        if "quantization_config" in kwargs:
            kwargs.setdefault("routed_expert_quantization", kwargs.pop("quantization_config"))
        if "media_placeholder_token_id" in kwargs:
            kwargs.setdefault("image_token_id", kwargs.pop("media_placeholder_token_id"))
        vision = kwargs.get("vision_config")
        if not isinstance(vision, dict):
            return kwargs
        vision = {MOONVIT_VISION_KEYS.get(key, key): value for key, value in vision.items()}
        for key in (*MOONVIT_VIDEO_KEYS, "model_type", "_attn_implementation"):
            vision.pop(key, None)
        for key, field in MOONVIT_PROJECTOR_KEYS.items():
            if key in vision:
                kwargs.setdefault(field, vision.pop(key))
        merge = vision.pop("merge_kernel_size", None)
        if merge is not None:
            if len(set(merge)) != 1:
                raise _invalid("vision_config.merge_kernel_size", merge, "the patch merger takes square windows, e.g. [2, 2]")
            vision["spatial_merge_size"] = merge[0]
        text = kwargs.get("text_config")
        widths = {
            "mm_hidden_size": (vision.pop("mm_hidden_size", None), vision.get("hidden_size"), "vt_hidden_size"),
            "text_hidden_size": (
                vision.pop("text_hidden_size", None), text.get("hidden_size") if isinstance(text, dict) else None,
                "text_config.hidden_size",
            ),
        }  # fmt: skip
        for key, (value, expected, source) in widths.items():
            if value is not None and expected is not None and value != expected:
                raise _invalid(f"vision_config.{key}", value, f"must equal {source}={expected}")
        kwargs["vision_config"] = vision
        return kwargs

    def to_kimi_k3_dict(self, quantization_config: dict | None = None) -> dict:
        """This config in the published Kimi K3 `config.json` spelling, which `_from_kimi_linear_keys` reads back: the
        `text_config` in Kimi Linear's (`KdaMoeTextConfig.to_kimi_linear_dict(k3_features=True)`), the
        `vision_config` in MoonViT's (`vt_*`, `init_pos_emb_*`, `merge_kernel_size`, the projector settings; the tower's
        other fields under their own names), `media_placeholder_token_id`, and `quantization_config` when given (the
        routed experts written mxfp4). K3's projector is as wide as a merged patch; another width raises."""
        if self.projector_hidden_size != self.merged_hidden_size:
            raise ValueError(
                f"The Kimi K3 config.json cannot express projector_hidden_size={self.projector_hidden_size}: K3's "
                f"projector is as wide as a merged patch ({self.merged_hidden_size}). Save this model in our layout "
                "(`save_pretrained(folder, layout='kda_moe')`)."
            )
        vision = self.vision_config
        moonvit = {published: getattr(vision, field) for published, field in MOONVIT_VISION_KEYS.items()}
        moonvit.update(
            merge_kernel_size=[vision.spatial_merge_size] * 2,
            mm_hidden_size=vision.hidden_size,
            text_hidden_size=self.text_config.hidden_size,
            **{published: getattr(self, field) for published, field in MOONVIT_PROJECTOR_KEYS.items()},
            **{field: getattr(vision, field) for field in ("num_channels", "rope_theta", "hidden_act", "rms_norm_eps")},
        )
        published = {
            "model_type": KIMI_K3_MODEL_TYPE,
            "architectures": ["KimiK3ForConditionalGeneration"],
            "media_placeholder_token_id": self.image_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": self.text_config.to_kimi_linear_dict(k3_features=True),
            "vision_config": moonvit,
        }
        if quantization_config is not None:
            published["quantization_config"] = quantization_config
        return published

    @property
    def merged_hidden_size(self) -> int:
        """Width of one merged patch: `spatial_merge_size**2` concatenated vision features."""
        return self.vision_config.spatial_merge_size**2 * self.vision_config.hidden_size

    # ----- rules that relate several fields (the sub-configs' own rules included)

    def validate_composition(self):
        # named to run first: `@strict` runs the `validate_*` methods in name order, and the others read sub-configs
        for key, config_class in SUB_CONFIGS.items():
            value = getattr(self, key)
            if not isinstance(value, config_class):
                raise _invalid(key, type(value).__name__, f"must be a {config_class.__name__} once the config is built")
            try:
                value.validate()
            except ValueError as error:
                raise ConfigValidationError(f"`{key}`: {error}") from error

    def validate_image_token(self):
        vocab_size = self.text_config.vocab_size
        if not 0 <= self.image_token_id < vocab_size:
            raise _invalid(
                "image_token_id", self.image_token_id,
                f"must be a token id in [0, text_config.vocab_size={vocab_size}) (the id of `<|media_pad|>` in the "
                "tokenizer); raise text_config.vocab_size or set image_token_id to the tokenizer's id",
            )  # fmt: skip
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            ids = getattr(self.text_config, name)
            ids = ids if isinstance(ids, list) else [ids]
            if self.image_token_id in ids:
                raise _invalid(
                    "image_token_id", self.image_token_id, f"collides with text_config.{name}; use a distinct token id"
                )

    def validate_projector(self):
        if self.projector_hidden_size is None:
            raise _invalid(
                "projector_hidden_size", None,
                f"must be an int once the config is built (the merged width is {self.merged_hidden_size})",
            )  # fmt: skip


__all__ = ["KdaMoeVisionConfig", "KdaMoeConfig"]
