"""Pure-PyTorch reference for the gated RMSNorm on the KDA output."""

import torch


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight * sigmoid(gate)``. x, gate: ``[..., D]``; weight:
    ``[D]``. Math in fp32 (fp64 for fp64 inputs); output in x.dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dtype) * torch.sigmoid(gate.to(dtype))
    return y.to(x.dtype)
