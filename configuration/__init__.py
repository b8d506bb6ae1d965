from .configuration_kda_moe import KdaMoeTextConfig

__all__ = ["KdaMoeTextConfig"]
