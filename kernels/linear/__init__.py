"""Bias-free linear projections of a decoding step's few token rows, several weights in one launch."""

import torch
import torch.nn.functional as F

from ..backend import TRITON_AVAILABLE, resolve_backend
from .limits import MAX_PROJECTION_TOKENS, MAX_PROJECTIONS, fits_projection_kernel, split_groups

if TRITON_AVAILABLE:
    from .decode import decode_projections_triton


def decode_projections(hidden_states: torch.Tensor, weights: list[torch.Tensor], backend: str = "auto",
                       group_sizes: list[int] | None = None) -> list[torch.Tensor]:
    """``[F.linear(hidden_states, w) for w in weights]``: hidden_states ``[N, d]``, weights ``[n_i, d]``; with
    ``group_sizes``, the products of each group of that many consecutive weights come out as one tensor, side by side
    (``[3, 1]`` for four weights: the first three's ``[N, n_0 + n_1 + n_2]``, then the fourth's).

    On Triton one kernel computes all of them (``fits_projection_kernel``: up to ``MAX_PROJECTION_TOKENS`` rows and
    ``MAX_PROJECTIONS`` weights of the input's dtype, no autograd), with fp32 accumulation as cuBLAS, and writes each
    group's products into one tensor; ``"auto"`` runs anything else as one F.linear per weight (and concatenates)."""
    if not weights:
        raise ValueError("decode_projections needs at least one weight.")
    if group_sizes is not None and (sum(group_sizes) != len(weights) or min(group_sizes) < 1):
        raise ValueError(
            f"group_sizes must be positive and add up to the {len(weights)} weights, got {list(group_sizes)}."
        )
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (hidden_states, *weights))
    supported = fits_projection_kernel(hidden_states, weights) and not needs_grad
    if resolve_backend(backend, hidden_states, *weights, supported=supported) == "triton":
        return decode_projections_triton(hidden_states, weights, group_sizes)
    products = [[F.linear(hidden_states, w) for w in group] for group in split_groups(weights, group_sizes)]
    return [group[0] if len(group) == 1 else torch.cat(group, dim=-1) for group in products]


__all__ = ["MAX_PROJECTIONS", "MAX_PROJECTION_TOKENS", "decode_projections", "fits_projection_kernel"]
