"""Modeling: the text decoder (`modeling_kda_moe.py`) and checkpoint-layout conversions (`conversion.py`)."""

from .modeling_kda_moe import KdaMoeForCausalLM, KdaMoePreTrainedModel, KdaMoeTextModel

__all__ = ["KdaMoePreTrainedModel", "KdaMoeTextModel", "KdaMoeForCausalLM"]
