"""Which chunks a gate decays too steeply for the mid-tile references, so that they run apart.

Under a gate bounded within the safe range every 16-token tile's diagonal block is in the row tiles' GEMMs
(``chunk_tiles.py``), and the chunk and gate-gradient kernels run once over every chunk. Under any other gate (Kimi
Linear's softplus) most chunks are just as mild, but some have a channel decaying by more than ``DIAG_SPAN`` across
one of their tiles. ``steep_chunk_flags`` marks those per (chunk, head); then each of those kernels runs twice, once
over the unmarked chunks with mid-tile references (``GEMM_CHUNKS``) and once over the marked ones (``STEEP_CHUNKS``),
which sum the tiles' own blocks apart where they must (``diagonal_blocks.py``). A program whose chunk belongs to
another launch returns at once.
"""

import torch

from ..backend import tl, triton
from .chunk_tiles import DIAG_SPAN, chunk_coords, chunk_decay, chunk_offsets64, fast_diag, tile_ends, tile_spans

EVERY_CHUNK = tl.constexpr(0)  # one launch takes every chunk (a gate bounded within the safe range, or no scores pass)
GEMM_CHUNKS = tl.constexpr(1)  # the chunks whose tiles all stay within DIAG_SPAN: mid-tile references
STEEP_CHUNKS = tl.constexpr(2)  # the others: the diagonal blocks apart where they must (diagonal_blocks.py)


@triton.jit
def takes_chunk(ok, steep, slot, CHUNKS: tl.constexpr):
    """Whether a launch over ``CHUNKS`` takes chunk ``slot``, a valid one (``ok``) of which ``steep`` holds the flag
    (``steep_chunk_flags``)."""
    if CHUNKS == EVERY_CHUNK:
        return ok
    elif CHUNKS == GEMM_CHUNKS:
        return ok & (tl.load(steep + slot) == 0)
    else:
        return ok & (tl.load(steep + slot) != 0)


@triton.jit
def _steep_chunks_kernel(g, A_log, dt_bias, steep, cu_seqlens, chunk_indices, T, lb, H: tl.constexpr,
                         K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    worst = tl.zeros((BK,), dtype=tl.float32)  # each slice channel's largest tile span so far
    if ok:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            pk, mk = chunk_offsets64(bos, t0, L, i_h, o_k, H, K)
            _, G = chunk_decay(g, dt_bias, a, lb, pk, mk, i_h, o_k, K, BOUNDED)
            c1, c2, c3, c4 = tile_ends(G)
            worst = tl.maximum(worst, tile_spans(c1, c2, c3, c4))
    tl.store(steep + i_p * H + i_h, (tl.max(worst, 0) > DIAG_SPAN).to(tl.int8))


def steep_chunk_flags(call) -> torch.Tensor:
    """[NS, H] int8: 1 where a chunk (slot) of ``call`` (a ``chunk_fwd.KdaCall``) has a tile that one reference cannot
    factor, else 0 (also for unused varlen slots, which every launch skips)."""
    H, K = call.q.shape[2:]
    steep = torch.empty(call.NS, H, device=call.q.device, dtype=torch.int8)
    _steep_chunks_kernel[(call.NS, H)](call.g, call.A_log, call.dt_bias, steep, call.cu_seqlens, call.chunk_indices,
                                       call.q.shape[1], call.lb, H=H, K=K, BK=min(K, 32),
                                       IS_VARLEN=call.cu_seqlens is not None,
                                       BOUNDED=call.gate_lower_bound is not None, num_warps=4)
    return steep


def chunk_launches(call) -> list[tuple[int, bool, torch.Tensor | None]]:
    """The launches of a kernel with a scores pass over ``call``'s chunks: ``(CHUNKS, FAST_DIAG, steep flags)`` each
    (the flags: ``call.steep``, computed once per call). One launch with every diagonal block in the GEMMs under a
    gate bounded within the safe range; else the mild chunks so and the steep ones with their blocks apart."""
    if fast_diag(call.gate_lower_bound):
        return [(EVERY_CHUNK.value, True, None)]
    return [(GEMM_CHUNKS.value, True, call.steep), (STEEP_CHUNKS.value, False, call.steep)]
