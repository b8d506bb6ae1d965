"""What the Triton projection kernel takes, without importing Triton, so that the model can ask before choosing it."""

import torch

# The most token rows one call takes: the rows of every tile (tl.dot's least M is 16, so up to 16 rows cost the same
# as one). More rows are no longer a decoding step, and cuBLAS's GEMMs fill the GPU well enough there.
MAX_PROJECTION_TOKENS = 16
# The most weights one launch multiplies: a KDA layer's six input projections (q, k, v, the two gates' first
# factors, beta).
MAX_PROJECTIONS = 6
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fits_projection_kernel(hidden_states: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether the kernel takes these inputs: hidden states ``[N, d]`` of at most ``MAX_PROJECTION_TOKENS`` rows, one to
    ``MAX_PROJECTIONS`` contiguous weights ``[n_i, d]`` of the hidden states' (floating) dtype, read in place."""
    return (
        hidden_states.dim() == 2
        and hidden_states.shape[0] <= MAX_PROJECTION_TOKENS
        and hidden_states.dtype in KERNEL_DTYPES
        and 1 <= len(weights) <= MAX_PROJECTIONS
        and all(
            w.dim() == 2 and w.shape[1] == hidden_states.shape[1] and w.dtype == hidden_states.dtype
            and w.is_contiguous()
            for w in weights
        )
    )


def split_groups(weights: list, group_sizes: list[int] | None) -> list[list]:
    """``weights`` cut into consecutive groups of ``group_sizes`` (None: one each), the groups whose products leave
    ``decode_projections`` as one tensor."""
    groups, start = [], 0
    for size in group_sizes or [1] * len(weights):
        groups.append(weights[start : start + size])
        start += size
    return groups
