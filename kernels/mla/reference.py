"""Pure-PyTorch reference for absorbed-MLA decode attention: every head of a few new tokens against the shared latent
cache (one-head MQA with keys ``latent | k_rope`` and values ``latent``).

Query token ``t`` of ``T`` sees cache positions ``<= S - T + t`` (the new tokens are the cache's last ``T``), and of
those only where ``attention_mask`` lets it: a bool mask keeps the True positions, a float mask is added to the scores
(``-inf`` drops a position). A query that sees no position gets a zero output. Math in fp32 (fp64 for an fp64
cache); the output is in the cache's dtype.
"""

import torch


def visible_positions(T: int, S: int, device: torch.device) -> torch.Tensor:
    """``[T, S]`` bool: query token t sees the positions ``<= S - T + t``."""
    return torch.arange(S, device=device) <= torch.arange(S - T, S, device=device)[:, None]


def mla_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q_latent: ``[B, H, T, L]`` (``W_UK`` folded in); q_rope: ``[B, H, T, R]``; latent: ``[B, 1, S, L]``; k_rope:
    ``[B, 1, S, R]``; attention_mask: None or 4-D, broadcast to ``[B, H, T, S]``. Returns ``[B, T, H, L]``."""
    out_dtype, dtype = latent.dtype, torch.promote_types(latent.dtype, torch.float32)
    latent = latent.to(dtype)
    scores = (q_latent.to(dtype) @ latent.mT + q_rope.to(dtype) @ k_rope.to(dtype).mT) * scale  # [B, H, T, S]
    visible = visible_positions(q_latent.shape[2], latent.shape[2], scores.device)
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        visible = visible & attention_mask
    elif attention_mask is not None:
        scores = scores + attention_mask.to(dtype)
        visible = visible & (attention_mask != float("-inf"))
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).where(visible.any(-1, keepdim=True), 0.0)  # a query that sees nothing: 0
    return (probs @ latent).transpose(1, 2).to(out_dtype)
