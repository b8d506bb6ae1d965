"""Pure-PyTorch reference for the Block AttnRes mix: a softmax over depth of the stored blocks and the partial sum."""

import torch


def attn_res_mix(
    partial: torch.Tensor, blocks: torch.Tensor, norm_weight: torch.Tensor, query_weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """partial [..., d], blocks [N, ..., d] -> [..., d] in partial.dtype.

    The N + 1 sources are the blocks and the partial sum; each source's key is its RMS-normalised value, scored
    against the pseudo-query ``norm_weight * query_weight`` ([d] each); the output is the softmax-weighted sum of the
    raw values. Math in fp32 (fp64 for fp64 inputs)."""
    dtype = torch.promote_types(partial.dtype, torch.float32)
    values = torch.cat([blocks, partial[None]], dim=0).to(dtype)  # [N + 1, ..., d]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    query = norm_weight.to(dtype) * query_weight.to(dtype)  # [d]
    weights = torch.softmax(keys @ query, dim=0)  # [N + 1, ...]
    return (weights[..., None] * values).sum(0).to(partial.dtype)
