"""The one place that picks between the Triton kernels and the pure-PyTorch reference.

``resolve_backend`` is called by every public op on every call, so ``"auto"`` follows the device of
the tensors actually passed (never a decision taken once at import).

Triton is imported here and nowhere else, inside a ``try``: CPU wheels of torch come without it, and then every op
runs its reference. The kernel modules take ``triton`` / ``tl`` from this module; the public ops import their Triton
entry points under ``if TRITON_AVAILABLE:`` without a ``try``, so an error in a kernel module raises at import.
"""

import functools
import os
from collections.abc import Callable

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None
try:  # grid dependency control, for programmatic dependent launches (dependent_launch.py)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

TRITON_AVAILABLE = triton is not None
BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "KDA_MOE_BACKEND"


def op_for_call(op: Callable, impl: Callable) -> Callable:
    """The torch.library custom op ``op`` while torch.compile traces (one opaque node in the graph) or autograd is on
    (the op's registered backward), else its Python implementation ``impl``, called directly: the dispatcher costs
    tens of microseconds a call (66 on a 2-core CPU), more than a decode step's kernel takes at batch 1."""
    return op if torch.is_grad_enabled() or torch.compiler.is_compiling() else impl


def refuse_autograd(kernel: str, tensors, training_path: str) -> None:
    """Decode kernels have no backward: raise, naming the fix, when one would be called on tensors that need grad."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(f"{kernel} has no backward: call it under torch.no_grad() (as generate() does), or run "
                         f"{training_path} for training.")


def resolve_backend(requested: str, *tensors: torch.Tensor | None, supported: bool = True) -> str:
    """Return ``"torch"`` or ``"triton"`` for one call of a public op on ``tensors``.

    The env var ``KDA_MOE_BACKEND`` (when set and non-empty) overrides ``requested``. ``"auto"`` gives ``"triton"``
    only if Triton is installed, every tensor is on CUDA and the caller says the kernel takes these inputs
    (``supported``; an explicit ``"triton"`` lets the kernel raise instead). An explicit ``"triton"`` never falls
    back: it raises ``ImportError`` without Triton, and ``ValueError`` for non-CUDA tensors unless
    ``TRITON_INTERPRET=1``."""
    env = os.environ.get(ENV_VAR, "").strip().lower()
    choice = env or requested
    if choice not in BACKENDS:
        source = f"the env var {ENV_VAR}" if env else "kernel_backend"
        raise ValueError(f"Unknown kernel backend {choice!r} (from {source}); allowed values are {BACKENDS}.")
    devices = {t.device for t in tensors if t is not None}
    if choice == "torch":
        return "torch"
    if choice == "auto":
        on_cuda = bool(devices) and all(d.type == "cuda" for d in devices)
        return "triton" if TRITON_AVAILABLE and on_cuda and supported else "torch"
    if not TRITON_AVAILABLE:
        raise ImportError(
            "kernel_backend='triton' needs the triton package, which is not installed: pip install triton "
            f"(it comes with CUDA builds of torch), or use kernel_backend='torch' / 'auto' (or {ENV_VAR}=torch) to run "
            "the PyTorch reference."
        )
    off_cuda = sorted(str(d) for d in devices if d.type != "cuda")
    if off_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernel_backend='triton' needs CUDA tensors but got tensors on {', '.join(off_cuda)}. "
            "Move the model to a GPU, use kernel_backend='torch' (or 'auto'), "
            "or set TRITON_INTERPRET=1 to run the Triton kernels in the interpreter."
        )
    return "triton"


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    """The multiprocessors a launch should fill: a CUDA device's; 4 in the interpreter (CPU tensors), so that a test's
    tiny shapes already take the launch settings of a GPU that small shapes leave mostly idle."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
