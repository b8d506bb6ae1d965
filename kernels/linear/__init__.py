"""Bias-free linear projections of a decoding step's few token rows, several weights in one launch."""

import torch
import torch.nn.functional as F

from ..backend import TRITON_AVAILABLE, resolve_backend
from .limits import MAX_PROJECTION_TOKENS, MAX_PROJECTIONS, fits_projection_kernel

if TRITON_AVAILABLE:
    from .decode import decode_projections_triton


def decode_projections(hidden_states: torch.Tensor, weights: list[torch.Tensor], backend: str = "auto"):
    """``[F.linear(hidden_states, w) for w in weights]``: hidden_states ``[N, d]``, weights ``[n_i, d]``.

    On Triton one kernel computes all of them (``fits_projection_kernel``: up to ``MAX_PROJECTION_TOKENS`` rows and
    ``MAX_PROJECTIONS`` weights of the input's dtype, no autograd), with fp32 accumulation as cuBLAS; ``"auto"`` runs
    anything else as one F.linear per weight."""
    if not weights:
        raise ValueError("decode_projections needs at least one weight.")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, *weights))
    supported = fits_projection_kernel(hidden_states, weights) and not needs_grad
    if resolve_backend(backend, hidden_states, *weights, supported=supported) == "triton":
        return decode_projections_triton(hidden_states, weights)
    return [F.linear(hidden_states, w) for w in weights]


__all__ = ["MAX_PROJECTIONS", "MAX_PROJECTION_TOKENS", "decode_projections", "fits_projection_kernel"]
