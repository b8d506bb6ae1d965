"""Kernels of kda-moe: Triton kernels and a pure-PyTorch reference per op; ``backend`` picks per call."""

from .backend import BACKENDS, resolve_backend
from .conv import short_conv, short_conv_step
from .kda import kda_decode_step, kimi_delta_attention
from .norm import gated_rms_norm

__all__ = [
    "kimi_delta_attention",
    "kda_decode_step",
    "short_conv",
    "short_conv_step",
    "gated_rms_norm",
    "resolve_backend",
    "BACKENDS",
]
