from .configuration_kda_moe import KdaMoeTextConfig
from .configuration_kda_moe_vision import KdaMoeConfig, KdaMoeVisionConfig

__all__ = ["KdaMoeTextConfig", "KdaMoeVisionConfig", "KdaMoeConfig"]
