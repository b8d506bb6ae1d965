"""kda-moe: Kimi Delta Attention + gated MLA + Block AttnRes + LatentMoE for Hugging Face transformers.

Importing the package registers every class with the matching ``Auto*`` factory, so
``AutoConfig`` / ``AutoModelForCausalLM`` / ... resolve ``model_type="kda_moe_text"`` after ``import kda_moe``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration import KdaMoeTextConfig
from .modeling import KdaMoeForCausalLM, KdaMoePreTrainedModel, KdaMoeTextModel

__version__ = "0.1.0"

AutoConfig.register(KdaMoeTextConfig.model_type, KdaMoeTextConfig, exist_ok=True)
AutoModel.register(KdaMoeTextConfig, KdaMoeTextModel, exist_ok=True)
AutoModelForCausalLM.register(KdaMoeTextConfig, KdaMoeForCausalLM, exist_ok=True)

__all__ = ["KdaMoeTextConfig", "KdaMoePreTrainedModel", "KdaMoeTextModel", "KdaMoeForCausalLM"]
