"""Programmatic dependent launch of the decoding kernels (Hopper and newer GPUs).

A batch-1 decoding step is about ninety kernels of a few microseconds each, back to back, and each one's launch and
the latency of its first loads are a large share of its time. Launched as programmatically dependent, a kernel's
programs may start while the kernel before it in the stream still runs: they compute their addresses and load the
weights they start with, then wait (``wait_for_inputs``) until that kernel has completed and its stores are visible,
and only then read anything it may have written. Right after its wait a kernel lets the next one launch (inductor's
dependent kernels too), so while a kernel waits, only the kernel just before it can still be running: every earlier
one has completed, and what it wrote may be read before the wait (the MoE down kernel reads the router's choices so).

It pays where every kernel of the step takes part: graphed decoding compiles the step with inductor's
``triton.enable_pdl`` and captures it inside ``dependent_launches()`` (on an H100, batch 1: 348 us of device time a
step against 398 in stream order; ours dependent among inductor's kernels in stream order took 541). Elsewhere the
kernels launch in stream order. A kernel takes part through a ``DEPENDENT: tl.constexpr`` argument, set with the
launch option by ``dependent_launch(device)``; before its wait it may read weights and what kernels launched before
its predecessor wrote, and write nothing. ``KDA_MOE_DEPENDENT_LAUNCH=0`` turns it off everywhere.
"""

import contextlib
import contextvars
import functools
import os

import torch

from .backend import TRITON_AVAILABLE, gdc_launch_dependents, gdc_wait, tl, triton

ENV_VAR = "KDA_MOE_DEPENDENT_LAUNCH"
_ACTIVE = contextvars.ContextVar("kda_moe_dependent_launches", default=False)


@functools.cache
def _hardware_supports(device: torch.device) -> bool:
    return (gdc_wait is not None and device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device)[0] >= 9)


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` can launch as dependent: Triton with grid dependency control, a CUDA GPU of
    compute capability 9.0 or newer, and ``KDA_MOE_DEPENDENT_LAUNCH`` not ``0``."""
    return os.environ.get(ENV_VAR, "1").strip() != "0" and _hardware_supports(torch.device(device))


@contextlib.contextmanager
def dependent_launches(enabled: bool = True):
    """Within (when ``enabled``), the decoding kernels launch as dependent where ``dependent_launch_supported``."""
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def dependent_launch(device: torch.device) -> dict:
    """A decoding kernel's launch arguments: ``DEPENDENT=True`` and Triton's ``launch_pdl=True`` inside
    ``dependent_launches()`` where supported, else ``DEPENDENT=False`` (stream order)."""
    if _ACTIVE.get() and dependent_launch_supported(device):
        return {"DEPENDENT": True, "launch_pdl": True}
    return {"DEPENDENT": False}


if TRITON_AVAILABLE:

    @triton.jit
    def wait_for_inputs(DEPENDENT: tl.constexpr):
        """Wait until the kernel before this one has completed and its stores are visible, then let the next kernel
        launch. A no-op unless launched as dependent."""
        if DEPENDENT:
            gdc_wait()
            gdc_launch_dependents()
