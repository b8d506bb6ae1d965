"""Modeling: the text decoder (`modeling_kda_moe.py`) and checkpoint-layout conversions (`conversion.py`)."""

from . import conversion  # noqa: F401  (registers the Kimi Linear checkpoint conversions for our model_type)
from .modeling_kda_moe import KdaMoeCache, KdaMoeForCausalLM, KdaMoePreTrainedModel, KdaMoeTextModel
from .modeling_kda_moe_vision import (
    KdaMoeForConditionalGeneration,
    KdaMoeModel,
    KdaMoeMultimodalPreTrainedModel,
    KdaMoeVisionModel,
    KdaMoeVisionPreTrainedModel,
)

__all__ = [
    "KdaMoeCache",
    "KdaMoePreTrainedModel",
    "KdaMoeTextModel",
    "KdaMoeForCausalLM",
    "KdaMoeVisionPreTrainedModel",
    "KdaMoeVisionModel",
    "KdaMoeMultimodalPreTrainedModel",
    "KdaMoeModel",
    "KdaMoeForConditionalGeneration",
]
