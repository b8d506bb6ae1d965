"""Short causal depthwise convolution (the q/k/v conv of KDA): public entry points."""

import torch

from ..backend import TRITON_AVAILABLE, resolve_backend
from .reference import ACTIVATIONS
from .reference import short_conv as short_conv_reference, short_conv_step as short_conv_step_reference

if TRITON_AVAILABLE:
    from .causal_conv import short_conv_step_triton, short_conv_triton


def _check_inputs(x, weight, state, activation, batch_dims, state_batch, name):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    if x.dim() != batch_dims + 1 or weight.dim() != 2 or weight.shape[0] != x.shape[-1]:
        layout = "[B, T, C]" if batch_dims == 2 else "[B, C]"
        raise ValueError(
            f"x must be {layout} and weight [C, W] with the same C, got {tuple(x.shape)} and {tuple(weight.shape)}."
        )
    expected = (state_batch, x.shape[-1], weight.shape[1] - 1)
    if state is not None and state.shape != expected:
        raise ValueError(f"{name} must be {expected} ([batch or sequences, C, W-1]), got {tuple(state.shape)}.")


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    activation: str | None = "silu",
    backend: str = "auto",
):
    """Causal depthwise conv + activation. x: ``[B, T, C]``; weight: ``[C, W]``; states
    ``[B, C, W-1]`` (``[N, C, W-1]`` with cu_seqlens ``[N+1]``, B == 1).
    Returns ``(y [B, T, C] in x.dtype, final_state or None)``."""
    N = x.shape[0]
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens needs packed inputs with batch size 1, got B = {x.shape[0]}; pass x as [1, total_tokens, C]."
            )
        N = len(cu_seqlens) - 1
    _check_inputs(x, weight, initial_state, activation, 2, N, "initial_state")
    kwargs = dict(
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, activation=activation
    )
    if resolve_backend(backend, x, weight) == "triton":
        return short_conv_triton(x, weight, **kwargs)
    return short_conv_reference(x, weight, **kwargs)


def short_conv_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: str | None = "silu", backend: str = "auto"
) -> torch.Tensor:
    """One decoding step. x: ``[B, C]``; weight: ``[C, W]``; state: ``[B, C, W-1]`` updated IN PLACE
    (fixed address). Returns y ``[B, C]`` in x.dtype."""
    _check_inputs(x, weight, state, activation, 1, x.shape[0], "state")
    if resolve_backend(backend, x, weight, state) == "triton":
        return short_conv_step_triton(x, weight, state, activation)
    return short_conv_step_reference(x, weight, state, activation)


__all__ = ["short_conv", "short_conv_step"]
