"""Small helpers that hide differences between the transformers / huggingface_hub versions we support.

Every version switch of the package lives here, one small function or constant each. Supported: transformers 5.17
(huggingface_hub 1.x) up to the latest 5.x.
"""

import importlib
from dataclasses import fields as _dataclass_fields
from functools import wraps

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers.modeling_outputs import MoeModelOutputWithPast as _MoeModelOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg


class ConfigValidationError(StrictDataclassError, ValueError):
    """A bad config value.

    huggingface_hub's `@strict` wraps every failed check in a `StrictDataclassFieldValidationError` or
    `StrictDataclassClassValidationError`, and neither is a `ValueError` (1.x and 2.x alike). This class is both,
    so `except ValueError` and `except StrictDataclassError` each catch it; the message is the original one, which
    names the field.
    """


def finish_strict_config(cls):
    """Class decorator, applied *above* `@strict`, for our `PreTrainedConfig` subclasses.

    - Runs `cls._from_kimi_linear_keys(kwargs)` on the raw keyword arguments before the dataclass `__init__`, so
      published key spellings are turned into our field names while it is still known which keys the caller gave
      (the dataclass `__init__` fills every absent field with its default before `__post_init__` runs).
    - Re-raises `StrictDataclassError`s from `__init__`, `__setattr__` and `validate()` as `ConfigValidationError`.
    """
    init, setattr_, validate = cls.__init__, cls.__setattr__, cls.validate

    @wraps(init)
    def __init__(self, *args, **kwargs):
        normalize = getattr(type(self), "_from_kimi_linear_keys", None)
        if normalize is not None:
            kwargs = normalize(kwargs)
        try:
            init(self, *args, **kwargs)
        except ConfigValidationError:
            raise
        except StrictDataclassError as error:
            raise ConfigValidationError(str(error)) from error

    @wraps(setattr_)
    def __setattr__(self, name, value):
        try:
            setattr_(self, name, value)
        except ConfigValidationError:
            raise
        except StrictDataclassError as error:
            raise ConfigValidationError(str(error)) from error

    @wraps(validate)
    def validate_(self):
        try:
            validate(self)
        except ConfigValidationError:
            raise
        except StrictDataclassError as error:
            raise ConfigValidationError(str(error)) from error

    # `@strict` on a subclass refuses a `validate` it did not write unless it carries this mark.
    validate_.__is_defined_by_strict_decorator__ = True
    cls.__init__, cls.__setattr__, cls.validate = __init__, __setattr__, validate_
    return cls


# ---------------------------------------------------------------------------------------------------------------
# Expert plans. From 5.19 (which ships `transformers.distributed.expert_parallel`) experts are never tensor-parallel:
# the EP plan gives every rank whole experts (`grouped_gemm`) and `ep_dispatch_experts` brings them their tokens. Up to
# 5.18 tensor parallelism splits every expert's width (`packed_colwise` / `rowwise` + `moe_tp_experts`, which sums the
# partial outputs), and the EP plan gives every rank whole experts, `ep_router` masking the routes to other ranks'.
# ---------------------------------------------------------------------------------------------------------------

try:
    import transformers.distributed.expert_parallel  # noqa: F401

    EXPERT_TOKEN_DISPATCH = True  # `DistributedConfig(ep_size=N)` sends each token to its experts' ranks
    EXPERTS_TP_PLAN = {}
    EXPERTS_EP_PLAN = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
except ImportError:
    EXPERT_TOKEN_DISPATCH = False  # experts split by a TP plan (`tp_size=N, enable_expert_parallel=True`)
    EXPERTS_TP_PLAN = {
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
    }
    EXPERTS_EP_PLAN = {
        "layers.*.mlp.gate": "ep_router",
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts": "moe_tp_experts",
    }


# transformers 5.18+ lays out FSDP and tensor parallelism together from one `DistributedConfig` (a (fsdp, tp) mesh built
# by `initialize_distributed_mesh`); 5.17 applies the tensor-parallel plan alone when both sizes are set.
FSDP_WITH_TENSOR_PARALLEL = hasattr(
    importlib.import_module("transformers.distributed.utils"), "initialize_distributed_mesh"
)

# transformers 5.18+ also lays out HSDP from one `DistributedConfig(dp_replicate_size=R, fsdp_size=F)`: FSDP2 over an
# (R, F) mesh, parameters sharded within a replica; 5.17 knows no replicate axis (HSDP by hand: `fully_shard` over a
# 2-D mesh).
HSDP_IN_DISTRIBUTED_CONFIG = "dp_replicate_size" in {
    field.name for field in _dataclass_fields(importlib.import_module("transformers.distributed").DistributedConfig)
}


# ---------------------------------------------------------------------------------------------------------------
# Modeling: cache argument / output names, linear-attention cache states, logits slicing
# ---------------------------------------------------------------------------------------------------------------

# transformers renamed the cache argument and output field `past_key_values` -> `cache` (5.24 has `cache`, 5.17
# `past_key_values`); generate() passes the name of its own version.
CACHE_NAME = "cache" if "cache" in {f.name for f in _dataclass_fields(_MoeModelOutputWithPast)} else "past_key_values"

if CACHE_NAME == "cache":

    def accepts_legacy_cache_name(forward):
        """Let a `forward(..., cache=...)` also take `past_key_values=`, with the FutureWarning that transformers' own
        models give for it (their `deprecate_kwarg`, the same removal version)."""
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

else:

    def accepts_legacy_cache_name(forward):
        """Let a `forward(..., cache=...)` also take `past_key_values=`, silently: it is the name this version's
        generate() and models use."""

        @wraps(forward)
        def wrapper(self, *args, **kwargs):
            if "past_key_values" in kwargs:
                legacy = kwargs.pop("past_key_values")
                kwargs["cache"] = legacy if kwargs.get("cache") is None else kwargs["cache"]
            return forward(self, *args, **kwargs)

        return wrapper


def model_output(output_class, *, cache=None, **values):
    """Build a transformers `ModelOutput`, storing the cache under this version's field name."""
    return output_class(**{CACHE_NAME: cache}, **values)


def output_cache(output):
    """The cache held by a transformers `ModelOutput` (or None)."""
    return getattr(output, CACHE_NAME, None)


def linear_attention_states(cache, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(conv_state, recurrent_state) of a linear-attention cache layer, or (None, None) before its first update.

    `Cache.get_conv_state` / `get_recurrent_state` exist from 5.21; before that the layer's dicts are read directly
    once `has_previous_state` is set.
    """
    if cache is None:
        return None, None
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)
    if layer_idx >= len(cache.layers) or not cache.has_previous_state(layer_idx):
        return None, None
    layer = cache.layers[layer_idx]
    return layer.conv_states[0], layer.recurrent_states[0]


def cached_token_count(cache) -> int | None:
    """Tokens a cache already holds (the length `generate()` reads from it), or None where the cache cannot tell.

    transformers 5.17 counts tokens on attention layers only, so `get_seq_length` of a cache of linear-attention
    layers alone (a pure-KDA model) raises; 5.25 counts on linear-attention layers too (see
    `store_linear_attention_states`).
    """
    try:
        return int(cache.get_seq_length())
    except ValueError:
        return None


def store_linear_attention_states(cache, layer_idx: int, conv_state, recurrent_state, new_tokens: int):
    """Store a KDA layer's final conv state ``[B, D, W]`` and recurrent state after a forward over ``new_tokens``
    tokens in a transformers cache the caller built (a `KdaMoeCache` takes them through its own layers).

    From 5.25 a linear-attention cache layer counts the tokens it has seen (its `get_seq_length`, which
    `generate()` reads from layer 0 to know how much of `input_ids` is already cached) by the width of each
    `update_conv_state` call: transformers' layers pass the new tokens' conv inputs there, ours the final state
    (our conv kernels produce it, and update it in place when decoding), so the count moves by ``new_tokens - W``
    more. Earlier versions count nothing on linear layers (`get_seq_length` reads the first attention layer).
    """
    cache.update_conv_state(conv_state, layer_idx, conv_kernel_size=conv_state.shape[-1])
    cache.update_recurrent_state(recurrent_state, layer_idx)
    seen = getattr(cache.layers[layer_idx], "cumulative_length_linear", None)
    if seen is not None:
        seen.add_(new_tokens - conv_state.shape[-1])


try:  # transformers >= 5.21
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The positions whose logits are needed: the last `logits_to_keep` (0 = all), or the given indices."""
        if isinstance(logits_to_keep, int):
            return hidden_states if logits_to_keep == 0 else hidden_states[:, -logits_to_keep:, :]
        return hidden_states[:, logits_to_keep, :]
