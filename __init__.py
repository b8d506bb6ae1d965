"""kda-moe: Kimi Delta Attention + gated MLA + Block AttnRes + LatentMoE for Hugging Face transformers.

Importing the package registers every class with the matching ``Auto*`` factory, so
``AutoConfig`` / ``AutoModelForCausalLM`` / ... resolve ``model_type="kda_moe_text"`` after ``import kda_moe``.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
)

# transformers 5.17 exports a torchvision-only placeholder as `transformers.AutoImageProcessor`; the class itself works.
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.image_processing_auto import AutoImageProcessor

from .configuration import KdaMoeConfig, KdaMoeTextConfig, KdaMoeVisionConfig
from .configuration.configuration_kda_moe_vision import KIMI_K3_MODEL_TYPE
from .modeling import (
    KdaMoeCache,
    KdaMoeForCausalLM,
    KdaMoeForConditionalGeneration,
    KdaMoeModel,
    KdaMoePreTrainedModel,
    KdaMoeStaticCache,
    KdaMoeTextModel,
    KdaMoeVisionModel,
    prefill_in_chunks,
    score_in_chunks,
)
from .processing import KdaMoeImageProcessor, KdaMoeProcessor

__version__ = "0.1.0"

AutoConfig.register(KdaMoeTextConfig.model_type, KdaMoeTextConfig, exist_ok=True)
AutoModel.register(KdaMoeTextConfig, KdaMoeTextModel, exist_ok=True)
AutoModelForCausalLM.register(KdaMoeTextConfig, KdaMoeForCausalLM, exist_ok=True)
AutoConfig.register(KdaMoeVisionConfig.model_type, KdaMoeVisionConfig, exist_ok=True)
AutoConfig.register(KdaMoeConfig.model_type, KdaMoeConfig, exist_ok=True)
# The published Kimi K3 folder (`model_type: kimi_k3`) loads into our multimodal model; `AutoConfig.register` insists on
# the class's own `model_type`, so the alias goes into the mapping itself.
CONFIG_MAPPING.register(KIMI_K3_MODEL_TYPE, KdaMoeConfig, exist_ok=True)
AutoModel.register(KdaMoeVisionConfig, KdaMoeVisionModel, exist_ok=True)
AutoModel.register(KdaMoeConfig, KdaMoeModel, exist_ok=True)
AutoModelForImageTextToText.register(KdaMoeConfig, KdaMoeForConditionalGeneration, exist_ok=True)
# A multimodal folder through AutoModelForCausalLM gives the whole generative model, as transformers does for Gemma 3
AutoModelForCausalLM.register(KdaMoeConfig, KdaMoeForConditionalGeneration, exist_ok=True)
AutoImageProcessor.register(KdaMoeConfig, slow_image_processor_class=KdaMoeImageProcessor, exist_ok=True)
AutoProcessor.register(KdaMoeConfig, KdaMoeProcessor, exist_ok=True)

__all__ = [
    "KdaMoeTextConfig",
    "KdaMoeCache",
    "KdaMoeStaticCache",
    "KdaMoePreTrainedModel",
    "KdaMoeTextModel",
    "KdaMoeForCausalLM",
    "KdaMoeVisionConfig",
    "KdaMoeConfig",
    "KdaMoeVisionModel",
    "KdaMoeModel",
    "KdaMoeForConditionalGeneration",
    "KdaMoeImageProcessor",
    "KdaMoeProcessor",
    "prefill_in_chunks",
    "score_in_chunks",
]
