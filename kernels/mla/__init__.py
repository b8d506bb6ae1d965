"""Absorbed-MLA decode attention: every head of a few new tokens against the shared latent cache."""

import torch

from ..backend import TRITON_AVAILABLE, resolve_backend
from .limits import KERNEL_DTYPES
from .reference import mla_decode_attention as mla_decode_attention_reference

if TRITON_AVAILABLE:
    from .decode import mla_decode_attention_triton

# New tokens per sequence up to which the model decodes through ``mla_decode_attention`` (decoding steps, assisted and
# prompt-lookup windows); longer forwards (prefill) are attention over many queries, left to the attention interface.
MLA_DECODE_MAX_TOKENS = 16


def _check_inputs(q_latent, q_rope, latent, k_rope, attention_mask):
    if q_latent.dim() != 4 or latent.dim() != 4 or latent.shape[1] != 1:
        raise ValueError(
            f"q_latent must be [B, H, T, L] and latent [B, 1, S, L], got {tuple(q_latent.shape)} and "
            f"{tuple(latent.shape)}."
        )
    B, H, T, L = q_latent.shape
    S = latent.shape[2]
    if latent.shape != (B, 1, S, L) or q_rope.shape[:3] != (B, H, T) or k_rope.shape != (B, 1, S, q_rope.shape[-1]):
        raise ValueError(
            f"expected latent [B, 1, S, L] = [{B}, 1, S, {L}], q_rope [B, H, T, R] = [{B}, {H}, {T}, R] and k_rope "
            f"[B, 1, S, R] with the same S and R, got latent {tuple(latent.shape)}, q_rope {tuple(q_rope.shape)} and "
            f"k_rope {tuple(k_rope.shape)}."
        )
    if T > S:
        raise ValueError(f"the cache must hold the {T} new tokens it is attended with, got S = {S} positions.")
    if attention_mask is not None:
        broadcastable = attention_mask.dim() == 4 and all(
            n in (1, full) for n, full in zip(attention_mask.shape, (B, H, T, S))
        )
        if not broadcastable or not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
            raise ValueError(
                f"attention_mask must be a bool or float 4-D mask that broadcasts to [B, H, T, S] = {(B, H, T, S)}, "
                f"got {attention_mask.dtype} {tuple(attention_mask.shape)}."
            )


def mla_decode_backend(backend: str, latent: torch.Tensor, *tensors: torch.Tensor | None) -> str:
    """The backend ``mla_decode_attention`` runs on for a cache ``latent`` and other inputs ``tensors``: ``"auto"``
    takes the Triton kernel for CUDA tensors of a dtype it reads, without autograd to record."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (latent, *tensors))
    return resolve_backend(backend, latent, *tensors, supported=latent.dtype in KERNEL_DTYPES and not grad)


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """MLA attention in the absorbed form for T new tokens per sequence: one-head MQA of every head over the latent
    cache, keys ``latent | k_rope`` and values ``latent``; query token t sees cache positions ``<= S - T + t`` where
    ``attention_mask`` allows (bool: True keeps a position; float: added to the scores). The Triton kernel reads each
    cache tile once for a block of heads and splits long caches over programs.

    q_latent: ``[B, H, T, L]`` (the non-rotary query with ``W_UK`` folded in); q_rope: ``[B, H, T, R]``; latent:
    ``[B, 1, S, L]``; k_rope: ``[B, 1, S, R]``; attention_mask: None or 4-D, broadcastable to ``[B, H, T, S]``.
    Returns ``[B, T, H, L]`` in the cache's dtype (apply ``W_UV`` next); fp32 accumulation. A query that sees no
    position gets zeros. Decoding only: the kernel has no backward."""
    _check_inputs(q_latent, q_rope, latent, k_rope, attention_mask)
    if mla_decode_backend(backend, latent, q_latent, q_rope, k_rope, attention_mask) == "triton":
        return mla_decode_attention_triton(q_latent, q_rope, latent, k_rope, attention_mask, scale=scale)
    return mla_decode_attention_reference(q_latent, q_rope, latent, k_rope, attention_mask, scale)


__all__ = ["MLA_DECODE_MAX_TOKENS", "mla_decode_attention", "mla_decode_backend"]
