"""Counters on which the programs of a decoding kernel find the last of them to finish.

A decoding kernel whose programs each hold a part of a result can end with a step over all of it: the fused KDA
step's gated RMSNorm over a head split across programs. Instead of a second launch, each program counts itself on a
counter of its group with an acquire-release atomic after its stores, and the program that takes the last count runs
that step and resets the counter to zero for the next call (``last_to_arrive``).

The counters are one zeroed int32 tensor per device, shared by every kernel that counts: a kernel touches them only
after its dependent-launch wait (``wait_for_inputs``), when every kernel before it has completed, and leaves them at
zero. They are allocated once, at a fixed address a CUDA graph replays, with room for ``MIN_COUNTERS`` groups or the
most any call asked for; ``reserve_arrival_counters`` allocates them ahead of a capture. Calls on one device share
them, so two decoding steps must not run concurrently on different streams.
"""

import torch

from .backend import TRITON_AVAILABLE, tl, triton

MIN_COUNTERS = 65536  # 256 KB a device: more groups than any decoding kernel's grid has at the sizes we run


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _device_key(device: torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" name one set
        return torch.device("cuda", torch.cuda.current_device())
    return device


def arrival_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Zeroed int32 counters, at least ``groups`` of them, on ``device``. A call asking for more than the current set
    holds adds a larger one and keeps the old alive for the CUDA graphs that read it."""
    sets = _COUNTERS.setdefault(_device_key(device), [])
    if not sets or sets[-1].numel() < groups:
        sets.append(torch.zeros(max(groups, MIN_COUNTERS), dtype=torch.int32, device=device))
    return sets[-1]


def reserve_arrival_counters(device: torch.device | str, groups: int = MIN_COUNTERS) -> None:
    """Allocate the counters of ``device`` (a CUDA device: no kernel counts elsewhere) outside any CUDA graph: made at
    a first call inside a capture, or inside the warm-up of inductor's CUDA-graph trees, they would live in the
    graph's memory pool."""
    device = torch.device(device)
    if device.type == "cuda":
        arrival_counters(device, groups)


if TRITON_AVAILABLE:

    @triton.jit
    def last_to_arrive(counters, group, programs):
        """Whether this program is the last of the ``programs`` of its group to arrive; the last resets the counter.
        Call it after the program's stores that the last program reads (and a ``tl.debug_barrier()``, so that every
        thread's stores precede the count): the acquire-release atomic makes them visible to the last program."""
        last = tl.atomic_add(counters + group, 1, sem="acq_rel") == programs - 1
        if last:
            tl.store(counters + group, 0)
        return last
