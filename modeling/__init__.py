"""Modeling: the text decoder (`modeling_kda_moe.py`), checkpoint-layout conversions (`conversion.py`) and long prompts
in chunks without generate() (`chunked_prefill.py`)."""

from .chunked_prefill import prefill_in_chunks, score_in_chunks
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
    "prefill_in_chunks",
    "score_in_chunks",
]
