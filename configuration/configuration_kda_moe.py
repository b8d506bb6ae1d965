"""Configuration of the kda-moe text decoder (Kimi Delta Attention + gated MLA + Block AttnRes + LatentMoE).

Every default and every validation of the text model lives here; modeling code trusts its config.
The defaults are a small model that runs on a laptop CPU with every feature switched on;
`KdaMoeTextConfig.kimi_k3()` builds the Kimi K3 shape. Configs in the layout of transformers' native
`kimi_linear` model and of the published Kimi Linear / Kimi K3 `config.json` load as they are
(see `KdaMoeTextConfig._from_kimi_linear_keys`); `KdaMoeTextConfig.to_kimi_linear_dict` writes the published
spelling back (`save_pretrained(..., layout="kimi_linear")`).

When each check runs:
- a field's own rule (its type, range or allowed values) runs whenever the field is set, in the constructor and on
  every later assignment (`config.num_experts_per_tok = 0` raises at once);
- rules that relate several fields (`num_experts_per_tok <= num_experts`, one `layer_types` entry per layer, ...) run
  at the end of the constructor, in `validate()`, when a model is built from the config and in `save_pretrained`,
  never on a single assignment, so an edit of several fields may pass through any order of intermediate states
  (`config.num_experts_per_tok = 16; config.num_experts = 64`).
Keys the constructor does not know are kept as attributes, as transformers does; one that looks like a misspelled
field (`num_expert_per_tok`) is reported with a warning that names the field.
"""

import dataclasses
import difflib
from collections.abc import Callable
from typing import Any

from huggingface_hub.dataclasses import strict, validated_field
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters
from transformers.utils import logging

from ..compat import CACHE_NAME, EXPERTS_EP_PLAN, EXPERTS_TP_PLAN, ConfigValidationError, finish_strict_config
from ..kernels.backend import BACKENDS as KERNEL_BACKENDS
from ..kernels.kda.tile_limits import SAFE_LOWER_BOUND
from ..kernels.moe.reference import MXFP4_GROUP

logger = logging.get_logger(__name__)

ATTENTION_LAYER_TYPES = ("linear_attention", "full_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
HIDDEN_ACTS = ("silu", "situ")
ROUTER_BALANCING = ("quantile", "bias_sign", "none")
ROUTER_BIAS_UPDATES = ("backward", "optimizer_step")
ROUTED_EXPERT_FORMATS = ("dense", "mxfp4")
GATE_LOWER_BOUND_MIN = -SAFE_LOWER_BOUND  # further down, the chunked KDA kernel's diagonal tiles leave the GEMMs

# Kimi Linear semantics for the K3 features a Kimi Linear config does not mention.
KIMI_LINEAR_DEFAULTS = {
    "gate_lower_bound": None,
    "use_full_rank_gate": False,
    "mla_use_output_gate": False,
    "mla_use_nope": True,
    "hidden_act": "silu",
    "routed_expert_hidden_size": None,
    "latent_moe_use_norm": False,
    "attn_res_block_size": None,
    # Kimi Linear routes with the `e_score_correction_bias` of its checkpoint and does not train it here.
    "router_balancing": "none",
}
# `linear_attn_config` sub-keys of the published configs -> our fields.
LINEAR_ATTN_CONFIG_KEYS = {
    "num_heads": "linear_num_heads",
    "head_dim": "linear_head_dim",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
    "gate_lower_bound": "gate_lower_bound",
    "use_full_rank_gate": "use_full_rank_gate",
}
# Fields with no place in the published `config.json` layouts that still round-trip through the K3 `text_config`
# under their own names (our reader takes them as they are): how the K3 activation and router balancing are set.
K3_EXTRA_FIELDS = (
    "activation_situ_beta",
    "activation_situ_linear_beta",
    "router_balancing",
    "router_bias_update_rate",
    "router_balancing_bins",
    "router_balancing_iterations",
    "router_bias_update",
)
# Keys of Kimi Linear / DeepSeek configs that are derived here or have no meaning for this model.
DROPPED_KEYS = ("head_dim", "qk_head_dim", "num_key_value_heads", "pretraining_tp", "topk_method")


def default_layer_types(num_hidden_layers: int) -> list[str]:
    """MLA on every 4th layer (1-based 4, 8, ...) and on the last layer, KDA elsewhere.

    The rule of the published Kimi Linear (27 layers: MLA at 4, 8, ..., 24, 27) and Kimi K3 (93 layers: MLA at
    4, 8, ..., 92, 93, so 23 + 1 = 24 MLA layers, the last two among them) configs.
    """
    return [
        "full_attention" if (i + 1) % 4 == 0 or i == num_hidden_layers - 1 else "linear_attention"
        for i in range(num_hidden_layers)
    ]


def default_mlp_layer_types(num_hidden_layers: int, first_k_dense_replace: int = 1, moe_layer_freq: int = 1):
    """The first `first_k_dense_replace` layers dense, then LatentMoE (every `moe_layer_freq`-th layer, DeepSeek rule)."""
    return [
        "sparse" if i >= first_k_dense_replace and i % moe_layer_freq == 0 else "dense"
        for i in range(num_hidden_layers)
    ]


def _invalid(field: str, value: Any, allowed: str) -> ConfigValidationError:
    return ConfigValidationError(f"`{field}`={value!r} is invalid: {allowed}.")


# ----- field rules: `@strict` runs them after the field's type check, whenever the field is set


def rule(holds: Callable[[Any], bool], requirement: str) -> Callable[[Any], None]:
    """A field rule: raises `ValueError("must be <requirement>, got <value>")` unless `holds(value)`. None always
    passes (the field's type says whether it may be None)."""

    def check(value):
        if value is not None and not holds(value):
            raise ValueError(f"must be {requirement}, got {value!r}")

    return check


def at_least(minimum: int) -> Callable[[Any], None]:
    return rule(lambda value: value >= minimum, f">= {minimum}")


def one_of(choices: tuple[str, ...]) -> Callable[[Any], None]:
    return rule(lambda value: value in choices, f"one of {choices}")


def each_one_of(choices: tuple[str, ...]) -> Callable[[Any], None]:
    return rule(lambda values: all(value in choices for value in values), f"a list of entries from {choices}")


positive = rule(lambda value: value > 0, "> 0")
non_negative = rule(lambda value: value >= 0, ">= 0")
probability = rule(lambda value: 0 <= value < 1, "in [0, 1)")


# ----- keys that look like misspelled fields

# Keys transformers writes into a `config.json` (5.x, and the 4.x releases whose checkpoints are still around) or
# reads from a config's keyword arguments, besides the dataclass fields: never reported as misspelled fields.
TRANSFORMERS_CONFIG_KEYS = frozenset(
    """
    add_cross_attention attn_implementation auto_map bad_words_ids begin_suppress_tokens cross_attention_hidden_size
    decoder_start_token_id diversity_penalty do_sample early_stopping encoder_no_repeat_ngram_size
    experts_implementation exponential_decay_length_penalty finetuning_task forced_bos_token_id forced_eos_token_id
    is_decoder length_penalty max_length min_length model_type name_or_path no_repeat_ngram_size num_beam_groups
    num_beams num_labels num_return_sequences output_attentions output_scores per_layer_config prefix pruned_heads
    remove_invalid_values repetition_penalty return_dict_in_generate rope_scaling rope_theta sep_token_id
    suppress_tokens task_specific_params temperature tf_legacy_loss tie_encoder_decoder tokenizer_class top_k top_p
    torch_dtype torchscript typical_p use_bfloat16
    """.split()
)


def warn_about_misspelled_keys(config: PreTrainedConfig, keys) -> None:
    """Warn about each of `keys` (constructor keywords that are no field of `config`) that looks like a misspelled
    field: such a key is kept as an attribute no model code reads, so the setting it was meant for is silently lost."""
    names = [field.name for field in dataclasses.fields(config)] + list(config.attribute_map)
    for key in keys:
        if key.startswith("_") or key in TRANSFORMERS_CONFIG_KEYS:
            continue
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.85)
        if close:
            logger.warning(
                f"{type(config).__name__} got the unknown key `{key}`: did you mean `{close[0]}`? Unknown keys are "
                f"kept as attributes that the model never reads, so `{close[0]}` keeps its value "
                f"{getattr(config, close[0])!r}; pass `{close[0]}` instead."
            )


@finish_strict_config
@strict
class KdaMoeTextConfig(PreTrainedConfig):
    r"""
    Configuration of [`KdaMoeTextModel`] / [`KdaMoeForCausalLM`]: a decoder whose layers mix tokens with Kimi Delta
    Attention (KDA) or gated Multi-head Latent Attention (MLA) and channels with a dense SiTU-GLU MLP or a LatentMoE.

    Layout:
        vocab_size, hidden_size, num_hidden_layers: the usual sizes.
        layer_types (`list[str]`, *optional*): per layer `"linear_attention"` (KDA) or `"full_attention"` (MLA).
            Defaults to MLA on every 4th layer and on the last one. Published configs may give
            `linear_attn_config={"kda_layers": [...], "full_attn_layers": [...]}` (1-based) instead.
        mlp_layer_types (`list[str]`, *optional*): per layer `"dense"` or `"sparse"` (LatentMoE). Defaults to the
            first layer dense (or the first `first_k_dense_replace` layers, when that key is given), the rest sparse.
    KDA:
        linear_num_heads, linear_head_dim: heads H and head dim K (= V) of the KDA layers.
        linear_conv_kernel_dim: kernel of the causal depthwise short convolution on q, k, v.
        gate_lower_bound (`float` or `None`): `None` = Kimi Linear decay `-exp(A_log) * softplus(z)`; a float in
            [-5.9, 0) = bounded decay `lower_bound * sigmoid(exp(A_log) * z)` (K3 uses -5.0).
        use_full_rank_gate: output gate `g_proj: d -> H*K` (K3) instead of the rank-K `g_b(g_a(x))` (Kimi Linear).
    MLA:
        num_attention_heads, q_lora_rank (`None` = no query compression), kv_lora_rank, qk_nope_head_dim,
        qk_rope_head_dim, v_head_dim: DeepSeek-V3 shapes. `qk_head_dim = qk_nope_head_dim + qk_rope_head_dim`.
        mla_use_nope: the rope slice of q/k is not rotated (no positional encoding).
        mla_use_output_gate: `attn * sigmoid(g_proj(x))` before `o_proj`.
        rope_parameters (`RopeParameters`): used only when `mla_use_nope=False`; default
            `{"rope_type": "default", "rope_theta": 10000.0}`.
    MoE:
        num_experts, num_experts_per_tok, num_shared_experts, moe_intermediate_size (expert width),
        intermediate_size (dense layers), routed_expert_hidden_size (`None` = experts at full hidden width, else
        the latent width `l` of the down/up projections around the routed experts), latent_moe_use_norm,
        routed_scaling_factor, moe_renormalize, n_group / topk_group (group-limited top-k),
        router_balancing (`"quantile"`, `"bias_sign"` or `"none"`), router_bias_update_rate (the gamma of
        `"bias_sign"`), router_balancing_bins (histogram bins of the data-parallel quantile estimate),
        router_balancing_iterations (damped Quantile Balancing passes per training step on the step's batch),
        router_bias_update (when the new bias is applied: `"backward"`, once each training backward has gone through
        the router; `"optimizer_step"`, at the next step of a torch optimizer, as the mean of the biases of the
        micro-batches since the last one, so that every micro-batch of a gradient-accumulation step routes alike),
        routed_expert_format (`"dense"`: the routed experts' weights in the model's dtype; `"mxfp4"`: kept as K3
        stores them, E2M1 values two a byte and one E8M0 scale per 32 weights, 4.25 bits a weight, frozen; the
        Triton backend dequantizes them in registers inside its grouped GEMMs, the PyTorch one per call).
    Activation:
        hidden_act (`"situ"` = SiTU-GLU, `"silu"` = SwiGLU), activation_situ_beta (b1 > 0),
        activation_situ_linear_beta (b2 > 0 caps the up branch with `b2 * tanh(up / b2)`; `None` = no cap).
    Other:
        attn_res_block_size (`int` or `None`): Block Attention Residuals block size; `None` = plain residuals.
        kernel_backend: `"auto"` (Triton on CUDA tensors, torch elsewhere), `"triton"` or `"torch"`.
        fused_linear_cross_entropy: a training forward with labels computes the loss a chunk of tokens at a time
            from the last hidden states and `lm_head`'s weight, and returns `logits=None` (the [tokens, vocab] logits
            are never built); `False` returns the logits and computes the loss from them.

    Example:

    ```python
    >>> from kda_moe.configuration import KdaMoeTextConfig
    >>> config = KdaMoeTextConfig()  # tiny, every feature on
    >>> k3 = KdaMoeTextConfig.kimi_k3()
    ```
    """

    model_type = "kda_moe_text"
    keys_to_ignore_at_inference = [CACHE_NAME]  # the output field Trainer must not gather
    # Tensor parallelism: every projection whose output is per head is column-sharded (a rank keeps whole heads),
    # a KDA layer runs on its heads of the conv and per-head tensors (`kda_heads`: `distributed/tensor_parallel.py`),
    # o_proj is row-sharded with an all-reduce; low-rank inputs (f_a, g_a, q_a, kv_a) stay replicated.
    base_model_tp_plan = {
        # KDA
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.f_b_proj": "colwise",
        "layers.*.self_attn.b_proj": "colwise",
        "layers.*.self_attn.g_b_proj": "colwise",
        "layers.*.self_attn": "kda_heads",
        "layers.*.self_attn.o_norm": "replicated_with_grad_allreduce",
        # MLA (q_proj, g_proj and o_proj are shared with KDA's names)
        "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise",
        "layers.*.self_attn.g_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        # dense MLP and shared experts
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        **EXPERTS_TP_PLAN,
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attn_res_blocks", "attention_mask"], ["hidden_states", "attn_res_blocks"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    base_model_ep_plan = EXPERTS_EP_PLAN
    attribute_map = {
        # spellings of the published Kimi Linear / Kimi K3 configs and of transformers' `kimi_linear`
        "num_experts_per_token": "num_experts_per_tok",
        "num_expert_group": "n_group",
        "model_max_length": "max_position_embeddings",
        "norm_topk_prob": "moe_renormalize",
        "n_shared_experts": "num_shared_experts",
        # DeepSeek / Mixtral spellings
        "num_local_experts": "num_experts",
        "n_routed_experts": "num_experts",
    }

    vocab_size: int = validated_field(at_least(1), default=1024)
    hidden_size: int = validated_field(at_least(1), default=256)
    num_hidden_layers: int = validated_field(at_least(1), default=4)
    layer_types: list[str] | None = validated_field(each_one_of(ATTENTION_LAYER_TYPES), default=None)
    mlp_layer_types: list[str] | None = validated_field(each_one_of(MLP_LAYER_TYPES), default=None)
    rms_norm_eps: float | int = validated_field(positive, default=1e-5)
    tie_word_embeddings: bool = False
    initializer_range: float | int = validated_field(non_negative, default=0.02)
    max_position_embeddings: int = validated_field(at_least(1), default=8192)
    use_cache: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    attention_dropout: float | int = validated_field(probability, default=0.0)
    output_router_logits: bool = False

    # KDA
    linear_num_heads: int = validated_field(at_least(1), default=4)
    linear_head_dim: int = validated_field(at_least(1), default=32)
    linear_conv_kernel_dim: int = validated_field(at_least(1), default=4)
    gate_lower_bound: float | int | None = validated_field(
        rule(
            lambda bound: GATE_LOWER_BOUND_MIN <= bound < 0,
            f"None (Kimi Linear decay) or in [{GATE_LOWER_BOUND_MIN}, 0), e.g. -5.0 (K3)",
        ),
        default=-5.0,
    )
    use_full_rank_gate: bool = True

    # gated MLA
    num_attention_heads: int = validated_field(at_least(1), default=4)
    q_lora_rank: int | None = validated_field(at_least(1), default=64)
    kv_lora_rank: int = validated_field(at_least(1), default=32)
    qk_nope_head_dim: int = validated_field(at_least(1), default=16)
    qk_rope_head_dim: int = validated_field(
        [at_least(1), rule(lambda dim: dim % 2 == 0, "even (rotary dims come in pairs)")], default=8
    )
    v_head_dim: int = validated_field(at_least(1), default=16)
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    rope_parameters: RopeParameters | dict | None = None

    # LatentMoE
    num_experts: int = validated_field(at_least(1), default=8)
    num_experts_per_tok: int = validated_field(at_least(1), default=2)
    num_shared_experts: int = validated_field(at_least(0), default=1)
    moe_intermediate_size: int = validated_field(at_least(1), default=64)
    intermediate_size: int = validated_field(at_least(1), default=512)
    routed_expert_hidden_size: int | None = validated_field(at_least(1), default=128)
    latent_moe_use_norm: bool = True
    routed_scaling_factor: float | int = validated_field(positive, default=1.0)
    moe_renormalize: bool = True
    n_group: int = validated_field(at_least(1), default=1)
    topk_group: int = validated_field(at_least(1), default=1)
    router_balancing: str = validated_field(one_of(ROUTER_BALANCING), default="quantile")
    router_bias_update_rate: float | int = validated_field(non_negative, default=1e-3)
    router_balancing_bins: int = validated_field(at_least(2), default=1024)
    router_balancing_iterations: int = validated_field(at_least(1), default=8)
    router_bias_update: str = validated_field(one_of(ROUTER_BIAS_UPDATES), default="backward")
    routed_expert_format: str = validated_field(one_of(ROUTED_EXPERT_FORMATS), default="dense")

    # activation
    hidden_act: str = validated_field(one_of(HIDDEN_ACTS), default="situ")
    activation_situ_beta: float | int = validated_field(positive, default=4.0)
    activation_situ_linear_beta: float | int | None = validated_field(positive, default=25.0)

    attn_res_block_size: int | None = validated_field(at_least(1), default=2)
    kernel_backend: str = validated_field(one_of(KERNEL_BACKENDS), default="auto")
    fused_linear_cross_entropy: bool = True

    def __post_init__(self, **kwargs):
        warn_about_misspelled_keys(self, kwargs)
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        if self.mlp_layer_types is None:
            self.mlp_layer_types = default_mlp_layer_types(self.num_hidden_layers)
        # RoPE: standard v5 handling (legacy `rope_theta` / `rope_scaling` kwargs are folded in by the parent)
        super().__post_init__(**kwargs)

    def __setattr__(self, name, value):
        # An `attribute_map` spelling is checked by the rules of the field it stands for.
        super().__setattr__(self.attribute_map.get(name, name), value)

    @property
    def qk_head_dim(self) -> int:
        """Width of an MLA query / key head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """The rotary width, which transformers' RoPE helpers read as `head_dim` (as in deepseek_v3 / kimi_linear)."""
        return self.qk_rope_head_dim

    @classmethod
    def _from_kimi_linear_keys(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Turn keyword arguments in a published layout into ours; called on the raw kwargs of every `__init__`.

        Handles the `attribute_map` spellings (`num_experts_per_token`, `num_expert_group`, `model_max_length`, ...),
        the remote-code `linear_attn_config` (1-based `kda_layers` / `full_attn_layers`, `num_heads`, `head_dim`,
        `short_conv_kernel_size`, and K3's `gate_lower_bound` / `use_full_rank_gate`), `first_k_dense_replace` /
        `moe_layer_freq`, `moe_router_activation_func` and `use_grouped_topk`. For a Kimi Linear config
        (`model_type="kimi_linear"` or a `linear_attn_config`), the K3 features it does not set take their Kimi
        Linear values (`KIMI_LINEAR_DEFAULTS`); keys it does set (the K3 release uses the same layout) win.
        """
        kwargs = dict(kwargs)
        model_type = kwargs.pop("model_type", cls.model_type)
        linear_attn_config = kwargs.pop("linear_attn_config", None)
        is_kimi_linear = model_type == "kimi_linear" or linear_attn_config is not None
        if is_kimi_linear:
            kwargs.pop("auto_map", None)  # points at Kimi's remote code, not at ours

        for alias, field in cls.attribute_map.items():
            if alias in kwargs:
                value = kwargs.pop(alias)
                if field in kwargs and kwargs[field] != value:
                    raise ConfigValidationError(
                        f"`{field}`={kwargs[field]!r} and its alias `{alias}`={value!r} disagree; give only one."
                    )
                kwargs[field] = value
        for key in DROPPED_KEYS:
            kwargs.pop(key, None)

        activation = kwargs.pop("moe_router_activation_func", "sigmoid")
        if activation != "sigmoid":
            raise _invalid("moe_router_activation_func", activation, "the router scores with 'sigmoid' only")
        if kwargs.pop("use_grouped_topk", True) is False:
            kwargs.setdefault("n_group", 1)
            kwargs.setdefault("topk_group", 1)
        if kwargs.get("num_nextn_predict_layers", None) == 0:
            kwargs.pop("num_nextn_predict_layers")

        num_hidden_layers = kwargs.get("num_hidden_layers", cls.__dataclass_fields__["num_hidden_layers"].default)
        first_k_dense_replace = kwargs.pop("first_k_dense_replace", None)
        moe_layer_freq = kwargs.pop("moe_layer_freq", 1)
        if kwargs.get("mlp_layer_types") is None and (first_k_dense_replace is not None or moe_layer_freq != 1):
            first_k = 1 if first_k_dense_replace is None else first_k_dense_replace
            if not isinstance(first_k, int) or not 0 <= first_k <= num_hidden_layers:
                raise _invalid("first_k_dense_replace", first_k, f"must be an int in [0, {num_hidden_layers}]")
            if not isinstance(moe_layer_freq, int) or moe_layer_freq < 1:
                raise _invalid("moe_layer_freq", moe_layer_freq, "must be an int >= 1")
            kwargs["mlp_layer_types"] = default_mlp_layer_types(num_hidden_layers, first_k, moe_layer_freq)

        if linear_attn_config is not None:
            for key, field in LINEAR_ATTN_CONFIG_KEYS.items():
                if key in linear_attn_config:
                    kwargs.setdefault(field, linear_attn_config[key])
            kda, full = linear_attn_config.get("kda_layers"), linear_attn_config.get("full_attn_layers")
            if kwargs.get("layer_types") is None and (kda is not None or full is not None):
                kwargs["layer_types"] = cls._layer_types_from_one_based(num_hidden_layers, kda or [], full or [])

        if is_kimi_linear:
            for field, value in KIMI_LINEAR_DEFAULTS.items():
                kwargs.setdefault(field, value)
        return kwargs

    def to_kimi_linear_dict(self, k3_features: bool = False) -> dict[str, Any]:
        """This config in the published Kimi Linear `config.json` spelling (`moonshotai/Kimi-Linear-48B-A3B`: 1-based
        `linear_attn_config` layer lists, `first_k_dense_replace`, `num_experts_per_token`, ...), which transformers'
        `KimiLinearConfig` and the published remote code read; `_from_kimi_linear_keys` reads it back.

        `k3_features=True` writes the `text_config` of a Kimi K3 `config.json`: the same keys plus K3's
        (`gate_lower_bound` / `use_full_rank_gate` in `linear_attn_config`, `mla_use_output_gate`,
        `routed_expert_hidden_size`, `latent_moe_use_norm`, `attn_res_block_size`) and `K3_EXTRA_FIELDS`. Without it, a
        K3 feature Kimi Linear lacks raises, naming it.
        """
        cannot = []
        if not k3_features:
            cannot += [
                f"{field}={getattr(self, field)!r} (Kimi Linear: {value!r})"
                for field, value in KIMI_LINEAR_DEFAULTS.items()
                if field != "router_balancing" and getattr(self, field) != value  # balancing only acts in training
            ]
        types = self.mlp_layer_types
        first_k_dense = types.index("sparse") if "sparse" in types else self.num_hidden_layers
        if types != default_mlp_layer_types(self.num_hidden_layers, first_k_dense):
            cannot.append(f"mlp_layer_types={types} (published: the first k layers dense, the rest sparse)")
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        if not self.mla_use_nope and rope_type != "default":
            cannot.append(f"rope_parameters={self.rope_parameters} (published: `rope_theta` of the default RoPE)")
        if cannot:
            layout = "Kimi K3" if k3_features else "Kimi Linear"
            raise ValueError(
                f"The {layout} config.json cannot express {'; '.join(cannot)}. Save this model in our layout "
                "(`save_pretrained(folder, layout='kda_moe')`)"
                + ("." if k3_features else " or in the Kimi K3 layout (`layout='kimi_k3'`).")
            )
        linear_attn_config = {
            "kda_layers": [i + 1 for i, kind in enumerate(self.layer_types) if kind == "linear_attention"],
            "full_attn_layers": [i + 1 for i, kind in enumerate(self.layer_types) if kind == "full_attention"],
            "num_heads": self.linear_num_heads,
            "head_dim": self.linear_head_dim,
            "short_conv_kernel_size": self.linear_conv_kernel_dim,
        }
        published = {
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "initializer_range": self.initializer_range,
            "model_max_length": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": self.use_cache,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "linear_attn_config": linear_attn_config,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": self.mla_use_nope,
            "rope_theta": (self.rope_parameters or {}).get("rope_theta", 10000.0),
            "first_k_dense_replace": first_k_dense,
            "moe_layer_freq": 1,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_tok,
            "num_shared_experts": self.num_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "routed_scaling_factor": self.routed_scaling_factor,
            "use_grouped_topk": True,
            "num_expert_group": self.n_group,
            "topk_group": self.topk_group,
            "num_nextn_predict_layers": 0,
        }
        if k3_features:
            linear_attn_config["gate_lower_bound"] = self.gate_lower_bound
            linear_attn_config["use_full_rank_gate"] = self.use_full_rank_gate
            for field in ("mla_use_output_gate", "routed_expert_hidden_size", "latent_moe_use_norm", "attn_res_block_size"):
                published[field] = getattr(self, field)
            published.update({field: getattr(self, field) for field in K3_EXTRA_FIELDS})
            del published["architectures"]  # a sub-config of the K3 model, not a model of its own
        dtype = self.to_dict().get("dtype")
        if dtype is not None:
            published["dtype"] = dtype
        return published

    @staticmethod
    def _layer_types_from_one_based(num_hidden_layers: int, kda_layers, full_attn_layers) -> list[str]:
        layer_types = [None] * num_hidden_layers
        for numbers, layer_type in ((kda_layers, "linear_attention"), (full_attn_layers, "full_attention")):
            for number in numbers:
                if not isinstance(number, int) or not 1 <= number <= num_hidden_layers:
                    raise _invalid(
                        "linear_attn_config", {"kda_layers": kda_layers, "full_attn_layers": full_attn_layers},
                        f"layer numbers are 1-based and must lie in [1, {num_hidden_layers}], got {number!r}",
                    )
                if layer_types[number - 1] is not None:
                    raise _invalid("linear_attn_config", number, "a layer is listed twice in kda_layers/full_attn_layers")
                layer_types[number - 1] = layer_type
        missing = [i + 1 for i, layer_type in enumerate(layer_types) if layer_type is None]
        if missing:
            raise _invalid(
                "linear_attn_config", missing, "these 1-based layers are in neither kda_layers nor full_attn_layers"
            )
        return layer_types

    @classmethod
    def kimi_k3(cls, **overrides) -> "KdaMoeTextConfig":
        """The Kimi K3 text decoder: 93 layers (69 KDA + 24 gated MLA), 896 experts, ~2.78T total / ~105B active.

        Layer rule (`default_layer_types`): MLA at 1-based layers 4, 8, ..., 92 and 93 (the last two are MLA),
        KDA elsewhere; layer 1 dense, the other 92 LatentMoE. MLA heads (96) and the dense width (33792) follow
        third-party K3 configs; with them the parameter count is 2.78T total and 105.4B activated per token
        (`tests/test_configuration.py::k3_parameter_counts`).
        """
        k3 = {
            "vocab_size": 163840,
            "hidden_size": 7168,
            "num_hidden_layers": 93,
            "max_position_embeddings": 1048576,
            "pad_token_id": 163839,
            "bos_token_id": 163584,
            "eos_token_id": 163586,
            "linear_num_heads": 96,
            "linear_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "num_attention_heads": 96,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "mla_use_output_gate": True,
            "num_experts": 896,
            "num_experts_per_tok": 16,
            "num_shared_experts": 2,
            "moe_intermediate_size": 3072,
            "intermediate_size": 33792,
            "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True,
            "routed_scaling_factor": 1.0,
            "moe_renormalize": True,
            "n_group": 1,
            "topk_group": 1,
            "router_balancing": "quantile",
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "attn_res_block_size": 12,
        }
        k3.update(overrides)
        return cls(**k3)

    # ----- rules that relate several fields (`validate()`: after `__post_init__`, when a model is built, on save)

    def validate_layer_type(self):
        for field in ("layer_types", "mlp_layer_types"):
            layer_types = getattr(self, field)
            if layer_types is None or len(layer_types) != self.num_hidden_layers:
                raise _invalid(
                    field, layer_types,
                    f"needs one entry per layer, num_hidden_layers={self.num_hidden_layers}; set `{field}` along with "
                    f"num_hidden_layers (`kda_moe.configuration.default_{field}(num_hidden_layers)` gives the default)",
                )  # fmt: skip

    def validate_latent_width(self):
        latent = self.routed_expert_hidden_size
        if latent is not None and latent > self.hidden_size:
            raise _invalid(
                "routed_expert_hidden_size", latent, f"must be None or in [1, hidden_size={self.hidden_size}]"
            )

    def validate_routed_expert_format(self):
        if self.routed_expert_format != "mxfp4":
            return
        widths = {"moe_intermediate_size": self.moe_intermediate_size,
                  "routed_expert_hidden_size": self.routed_expert_hidden_size or self.hidden_size}
        for field, width in widths.items():
            if width % MXFP4_GROUP:
                raise _invalid(
                    "routed_expert_format", "mxfp4",
                    f"mxfp4 experts keep one scale per {MXFP4_GROUP} weights along each input row, so the experts' "
                    f"input widths must be multiples of {MXFP4_GROUP}; {field} (the width of an expert's input) is "
                    f"{width}; use routed_expert_format='dense'",
                )  # fmt: skip

    def validate_routing(self):
        if self.num_experts_per_tok > self.num_experts:
            raise _invalid(
                "num_experts_per_tok", self.num_experts_per_tok, f"must be in [1, num_experts={self.num_experts}]"
            )
        if self.num_experts % self.n_group:
            raise _invalid("n_group", self.n_group, f"must divide num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            raise _invalid("topk_group", self.topk_group, f"must be <= n_group={self.n_group}")
        reachable = self.topk_group * (self.num_experts // self.n_group)
        if self.num_experts_per_tok > reachable:
            raise _invalid(
                "num_experts_per_tok", self.num_experts_per_tok,
                f"exceeds the {reachable} experts of topk_group={self.topk_group} groups; raise topk_group",
            )  # fmt: skip


__all__ = ["KdaMoeTextConfig"]
