"""What the Triton MLA decode kernel takes, without importing Triton, so that the public op can ask before a kernel
is chosen."""

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # of the latent cache and the rotary keys
