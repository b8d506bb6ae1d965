"""Programmatic dependent launch of the decoding kernels (Hopper and newer GPUs).

A batch-1 decoding step is about ninety kernels of a few microseconds each, back to back, and each one's launch and
the latency of its first loads are a large share of its time. Launched as programmatically dependent, a kernel's
programs may start while the kernel before it in the stream still runs: they compute their addresses and load the
weights they start with, then wait (``wait_for_inputs``) until that kernel has completed and its stores are visible,
and only then read anything it may have written. Right after its wait a kernel lets the next one launch, so while a
kernel waits, only the kernel just before it can still be running: every earlier one has completed.

A kernel takes part through a ``DEPENDENT: tl.constexpr`` argument, set with the launch option by
``dependent_launch(device)``. Before its wait it may read weights only (nothing a decoding step writes) and write
nothing. ``KDA_MOE_DEPENDENT_LAUNCH=0`` launches every kernel in plain stream order.
"""

import functools
import os

import torch

from .backend import tl, triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: every launch stays in plain stream order
    gdc_launch_dependents = gdc_wait = None

ENV_VAR = "KDA_MOE_DEPENDENT_LAUNCH"


@functools.cache
def _supported(device: torch.device) -> bool:
    return (gdc_wait is not None and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def dependent_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel that takes part: ``DEPENDENT=True`` and Triton's ``launch_pdl=True`` on a CUDA
    GPU of compute capability 9.0 or newer; ``DEPENDENT=False`` elsewhere (other GPUs, the Triton interpreter) and
    when ``KDA_MOE_DEPENDENT_LAUNCH=0``."""
    if os.environ.get(ENV_VAR, "1").strip() != "0" and _supported(device):
        return {"DEPENDENT": True, "launch_pdl": True}
    return {"DEPENDENT": False}


@triton.jit
def wait_for_inputs(DEPENDENT: tl.constexpr):
    """Wait until the kernel before this one has completed and its stores are visible, then let the next kernel
    launch. A no-op unless launched as dependent."""
    if DEPENDENT:
        gdc_wait()
        gdc_launch_dependents()
