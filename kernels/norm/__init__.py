"""RMSNorms: the gated one on the KDA output (public entry point), and the check of a layer's input norm that the
decoding kernels apply to the rows they read."""

import torch

from ..backend import TRITON_AVAILABLE, resolve_backend
from .reference import gated_rms_norm as gated_rms_norm_reference

if TRITON_AVAILABLE:
    from .gated_rms_norm_kernel import gated_rms_norm_triton


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
    if resolve_backend(backend, x, gate, weight) == "triton":
        return gated_rms_norm_triton(x, gate, weight, eps)
    return gated_rms_norm_reference(x, gate, weight, eps)


def check_input_norm(hidden_states: torch.Tensor, input_norm: tuple[torch.Tensor, float] | None) -> None:
    """Raise, naming the fix, unless ``input_norm`` is None or (weight ``[d]``, eps) for hidden states ``[..., d]``."""
    if input_norm is not None and input_norm[0].shape != hidden_states.shape[-1:]:
        raise ValueError(
            f"input_norm's weight must be [d] = [{hidden_states.shape[-1]}] for hidden states "
            f"{tuple(hidden_states.shape)}, got {tuple(input_norm[0].shape)}: pass the weight of the RMSNorm over "
            "their last dimension."
        )


__all__ = ["check_input_norm", "gated_rms_norm"]
