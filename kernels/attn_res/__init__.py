"""Block AttnRes mix: public entry point.

``attn_res_mix`` takes the blocks and the partial sum as they are (no concatenated copy) and runs the fused Triton
forward and backward (``mix_kernel.py``) when ``backend`` resolves to ``"triton"`` (``"auto"``: on CUDA tensors with
Triton installed and rows of at most ``MAX_MIX_WIDTH`` channels; the model passes ``config.kernel_backend``), else the
PyTorch reference (``reference.py``). Both compute in fp32 and give a row's output from that row alone.
"""

import torch

from ..backend import TRITON_AVAILABLE, resolve_backend
from .reference import attn_res_mix as attn_res_mix_reference

# The widest rows the Triton kernels take: a program holds whole rows in registers (16384 fp32 channels over 16
# warps are 32 a thread per tile). K3's d is 7168.
MAX_MIX_WIDTH = 16384

if TRITON_AVAILABLE:
    from .mix_kernel import attn_res_mix_triton


def attn_res_mix(
    partial: torch.Tensor,
    blocks: torch.Tensor,
    norm_weight: torch.Tensor,
    query_weight: torch.Tensor,
    eps: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax mixture over depth of ``blocks`` [N, ..., d] and ``partial`` [..., d]: keys are the RMS-normalised
    sources (``eps`` inside the root), scored against the pseudo-query ``norm_weight * query_weight`` ([d] each); the
    output, in partial.dtype, is the weighted sum of the raw sources."""
    d = partial.shape[-1]
    if blocks.dim() != partial.dim() + 1 or blocks.shape[1:] != partial.shape or blocks.shape[0] < 1:
        raise ValueError(f"blocks must be [N, *partial.shape] = [N, {', '.join(map(str, partial.shape))}] with N >= 1, "
                         f"got {tuple(blocks.shape)}.")
    if norm_weight.shape != (d,) or query_weight.shape != (d,):
        raise ValueError(f"norm_weight and query_weight must be [d] = [{d}], got {tuple(norm_weight.shape)} and "
                         f"{tuple(query_weight.shape)}.")
    if resolve_backend(backend, partial, blocks, norm_weight, query_weight, supported=d <= MAX_MIX_WIDTH) == "triton":
        if d > MAX_MIX_WIDTH:
            raise ValueError(f"the Triton AttnRes mix holds whole rows in registers and takes d <= {MAX_MIX_WIDTH}, "
                             f"got d = {d}; use backend=\"torch\" (or \"auto\", which picks it).")
        return attn_res_mix_triton(partial, blocks, norm_weight, query_weight, eps)
    return attn_res_mix_reference(partial, blocks, norm_weight, query_weight, eps)


__all__ = ["MAX_MIX_WIDTH", "attn_res_mix"]
