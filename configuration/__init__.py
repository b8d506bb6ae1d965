from .configuration_kda_moe import KdaMoeTextConfig, default_layer_types, default_mlp_layer_types
from .configuration_kda_moe_vision import KdaMoeConfig, KdaMoeVisionConfig

__all__ = ["KdaMoeTextConfig", "KdaMoeVisionConfig", "KdaMoeConfig", "default_layer_types", "default_mlp_layer_types"]
