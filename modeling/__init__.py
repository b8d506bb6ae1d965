"""Modeling: the text decoder (`modeling_kda_moe.py`) and checkpoint-layout conversions (`conversion.py`)."""

from .conversion import kimi_linear_conversions  # noqa: F401  (importing it registers the Kimi Linear conversions)
from .modeling_kda_moe import (
    KdaMoeCache,
    KdaMoeForCausalLM,
    KdaMoePreTrainedModel,
    KdaMoeStaticCache,
    KdaMoeTextModel,
)
from .modeling_kda_moe_vision import (
    KdaMoeForConditionalGeneration,
    KdaMoeModel,
    KdaMoeMultimodalPreTrainedModel,
    KdaMoeVisionModel,
    KdaMoeVisionPreTrainedModel,
)

__all__ = [
    "KdaMoeCache",
    "KdaMoeStaticCache",
    "KdaMoePreTrainedModel",
    "KdaMoeTextModel",
    "KdaMoeForCausalLM",
    "KdaMoeVisionPreTrainedModel",
    "KdaMoeVisionModel",
    "KdaMoeMultimodalPreTrainedModel",
    "KdaMoeModel",
    "KdaMoeForConditionalGeneration",
]
