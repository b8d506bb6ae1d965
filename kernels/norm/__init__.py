"""Gated RMSNorm: public entry point."""

import torch

from ..backend import resolve_backend, triton_op
from . import reference

try:  # registers the Triton kernel; machines without Triton (CPU wheels of torch) keep the reference
    from . import gated_rms_norm_kernel  # noqa: F401
except ImportError:
    pass


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, backend: str = "auto"
) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight * sigmoid(gate)`` in fp32. x, gate: ``[..., D]``;
    weight: ``[D]``. Returns ``[..., D]`` in x.dtype."""
    if gate.shape != x.shape or weight.shape != x.shape[-1:]:
        raise ValueError(
            f"gate must have the shape of x {tuple(x.shape)} and weight be [D] = [{x.shape[-1]}], "
            f"got {tuple(gate.shape)} and {tuple(weight.shape)}."
        )
    if resolve_backend(backend, x, gate, weight, op="gated_rms_norm") == "triton":
        return triton_op("gated_rms_norm")(x, gate, weight, eps)
    return reference.gated_rms_norm(x, gate, weight, eps)


__all__ = ["gated_rms_norm"]
