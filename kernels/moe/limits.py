"""What the Triton MoE decode kernel takes, without importing Triton, so that the public op and the model can ask
before the kernel is chosen."""

import torch

# The most tokens one call takes: every program holds all of them as the rows of its tiles (64 rows of bf16 at a
# 64-wide reduction slice are 32 registers a thread at 4 warps). More tokens are no longer decoding: grouped GEMMs
# read each expert once as well and keep the tensor cores busier.
MAX_DECODE_TOKENS = 64
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The most experts the top-k router kernel chooses among: one program holds a token's scores in registers (K3 has
# 384 experts).
MAX_ROUTED_EXPERTS = 1024


def fits_decode_kernel(hidden_states: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: at most ``MAX_DECODE_TOKENS`` tokens, and contiguous expert weights
    (the routed experts' gate_up_proj and down_proj, a shared expert's) of the hidden states' (floating) dtype, which it
    reads in place."""
    return (
        hidden_states.shape[0] <= MAX_DECODE_TOKENS
        and hidden_states.dtype in KERNEL_DTYPES
        and all(weight.dtype == hidden_states.dtype and weight.is_contiguous() for weight in weights)
    )
