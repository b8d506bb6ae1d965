"""The one place that picks between the Triton kernels and the pure-PyTorch reference.

``resolve_backend`` is called by every public op on every call, so ``"auto"`` follows the device of
the tensors actually passed (never a decision taken once at import). Triton kernels plug in per op
through ``register_triton_op``; an op without a registered kernel always runs the torch reference
under ``"auto"`` and raises under an explicit ``"triton"``.
"""

import os
from collections.abc import Callable

import torch

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "KDA_MOE_BACKEND"

_TRITON_OPS: dict[str, Callable] = {}
_AUTO_TRITON_OPS: set[str] = set()  # registered kernels that "auto" may pick


def register_triton_op(name: str, fn: Callable | None = None, *, auto: bool = True):
    """Register the Triton implementation of op ``name`` (usable as ``@register_triton_op("kda")``).

    ``fn`` takes the same arguments as the public op (minus ``backend``). ``auto=False`` registers a kernel that
    runs only when ``"triton"`` is asked for explicitly (not yet validated on every shape), never under ``"auto"``."""
    if fn is None:
        return lambda f: register_triton_op(name, f, auto=auto)
    _TRITON_OPS[name] = fn
    if auto:
        _AUTO_TRITON_OPS.add(name)
    else:
        _AUTO_TRITON_OPS.discard(name)
    return fn


def triton_op_available(name: str) -> bool:
    """Whether a Triton kernel is registered for op ``name``."""
    return name in _TRITON_OPS


def triton_op(name: str) -> Callable:
    """The registered Triton implementation of op ``name``; raises if none is built yet."""
    if name not in _TRITON_OPS:
        raise NotImplementedError(
            f"The Triton kernels are not built yet (no Triton kernel registered for op {name!r}). "
            'Use kernel_backend="torch" (or KDA_MOE_BACKEND=torch) to run the PyTorch reference.'
        )
    return _TRITON_OPS[name]


def op_for_call(op: Callable, impl: Callable) -> Callable:
    """The torch.library custom op ``op`` while torch.compile traces (one opaque node in the graph) or autograd is on
    (the op's registered backward), else its Python implementation ``impl``, called directly: the dispatcher costs
    tens of microseconds a call (66 on a 2-core CPU), more than a decode step's kernel takes at batch 1."""
    return op if torch.is_grad_enabled() or torch.compiler.is_compiling() else impl


def resolve_backend(requested: str, *tensors: torch.Tensor | None, op: str, supported: bool = True) -> str:
    """Return ``"torch"`` or ``"triton"`` for one call of op ``op`` on ``tensors``.

    The env var ``KDA_MOE_BACKEND`` (when set and non-empty) overrides ``requested``. ``"auto"``
    gives ``"triton"`` only if every tensor is on CUDA, a Triton kernel for ``op`` is registered and the caller
    says the kernel takes these inputs (``supported``; an explicit ``"triton"`` lets the kernel raise instead).
    An explicit ``"triton"`` never falls back: it raises ``NotImplementedError`` if the kernel is not
    built, and ``ValueError`` for non-CUDA tensors unless ``TRITON_INTERPRET=1``."""
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
        return "triton" if on_cuda and supported and op in _AUTO_TRITON_OPS else "torch"
    triton_op(op)  # raises NotImplementedError when the kernel is not built
    off_cuda = sorted(str(d) for d in devices if d.type != "cuda")
    if off_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"kernel_backend='triton' needs CUDA tensors but got tensors on {', '.join(off_cuda)}. "
            "Move the model to a GPU, use kernel_backend='torch' (or 'auto'), "
            "or set TRITON_INTERPRET=1 to run the Triton kernels in the interpreter."
        )
    return "triton"
