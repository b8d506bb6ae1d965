"""Bias-free linear projections of a decoding step's few token rows, several weights in one launch."""

import torch
import torch.nn.functional as F

from ..backend import TRITON_AVAILABLE, resolve_backend
from ..norm import check_input_norm
from ..norm.reference import rms_norm
from .limits import MAX_PROJECTION_TOKENS, MAX_PROJECTIONS, fits_projection_kernel, split_groups

if TRITON_AVAILABLE:
    from .decode import decode_projections_triton


def decode_projections(hidden_states: torch.Tensor, weights: list[torch.Tensor], backend: str = "auto",
                       group_sizes: list[int] | None = None, input_norm: tuple[torch.Tensor, float] | None = None,
                       residual: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``[F.linear(hidden_states, w) for w in weights]``: hidden_states ``[N, d]``, weights ``[n_i, d]``; with
    ``group_sizes``, the products of each group of that many consecutive weights come out as one tensor, side by side
    (``[3, 1]`` for four weights: the first three's ``[N, n_0 + n_1 + n_2]``, then the fourth's). ``input_norm``
    (weight ``[d]``, eps): the rows go through that RMSNorm first (``norm.reference.rms_norm``); ``residual``
    ``[N, n_0]`` with one weight: added to its products (a pre-norm layer's first and last projections).

    On Triton one kernel computes all of them (``fits_projection_kernel``: up to ``MAX_PROJECTION_TOKENS`` rows and
    ``MAX_PROJECTIONS`` weights of the input's dtype, no autograd), with fp32 accumulation as cuBLAS, the norm and
    the residual add inside, and writes each group's products into one tensor; ``"auto"`` runs anything else as the
    norm, one F.linear per weight (and concatenation) and the add."""
    if not weights:
        raise ValueError("decode_projections needs at least one weight.")
    if group_sizes is not None and (sum(group_sizes) != len(weights) or min(group_sizes) < 1):
        raise ValueError(
            f"group_sizes must be positive and add up to the {len(weights)} weights, got {list(group_sizes)}."
        )
    check_input_norm(hidden_states, input_norm)
    _check_residual(hidden_states, weights, residual)
    extra = [t for t in (input_norm and input_norm[0], residual) if t is not None]
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, *weights, *extra))
    supported = fits_projection_kernel(hidden_states, weights) and not needs_grad
    if resolve_backend(backend, hidden_states, *weights, *extra, supported=supported) == "triton":
        return decode_projections_triton(hidden_states, weights, group_sizes, input_norm, residual)
    if input_norm is not None:
        hidden_states = rms_norm(hidden_states, *input_norm)
    products = [[F.linear(hidden_states, w) for w in group] for group in split_groups(weights, group_sizes)]
    outputs = [group[0] if len(group) == 1 else torch.cat(group, dim=-1) for group in products]
    return outputs if residual is None else [residual + outputs[0]]


def _check_residual(hidden_states: torch.Tensor, weights: list[torch.Tensor], residual: torch.Tensor | None):
    """Raise, naming the fix, unless the residual is None or ``[N, n_0]`` of the hidden states' dtype next to a
    single weight."""
    if residual is None:
        return
    expected = (*hidden_states.shape[:-1], weights[0].shape[0])
    if len(weights) != 1 or tuple(residual.shape) != expected or residual.dtype != hidden_states.dtype:
        raise ValueError(
            f"a residual is added to the products of one weight: {expected} in {hidden_states.dtype}; got it with "
            f"{len(weights)} weights, shaped {tuple(residual.shape)} in {residual.dtype}. Add it after the call "
            "for several weights."
        )


__all__ = ["MAX_PROJECTIONS", "MAX_PROJECTION_TOKENS", "decode_projections", "fits_projection_kernel"]
