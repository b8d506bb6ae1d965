"""Pure-PyTorch references for the RMSNorms: the plain one before a layer (as the decoding kernels fold it in) and the
gated one on the KDA output."""

import torch


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight * sigmoid(gate)``. x, gate: ``[..., D]``; weight:
    ``[D]``. Math in fp32 (fp64 for fp64 inputs); output in x.dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(dtype) * torch.sigmoid(gate.to(dtype))
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x * rsqrt(mean(x^2, -1) + eps)`` rounded as the model's RMSNorm rounds it: the statistics in fp32
    (fp64 for fp64 inputs), ``x * rsqrt(...)`` rounded to x.dtype, its product with the weight rounded again."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)
