"""Grouped GEMM of routed experts whose weights are stored mxfp4, decoded in registers.

``mxfp4_grouped_mm_triton`` multiplies rows sorted by expert, ``x [S, K]`` (expert e owns rows ``offsets[e - 1]``
... ``offsets[e]``), by their expert's weight ``W_e [N, K]`` as compressed-tensors stores it (``Mxfp4Weight``): each
program loads its weight tile as packed bytes and E8M0 scales, decodes it in fp32 registers and hands it to the
tensor cores in the operand dtype, so the dense weight (3.8x the bytes in bf16) never exists in memory.

The rows of every expert are cut into BM-row tiles that ``row_tiles`` lists on the device: ``cdiv(S, BM) + min(E, S)``
slots whatever the routing, so the grid is fixed (slots, output column blocks) and nothing waits for the host. One
kernel computes both orientations: ``x W_e^T`` ([S, K] -> [S, N]) and ``x W_e`` ([S, N] -> [S, K]), the gradient in x,
from the same [BN, BK] weight tiles. Differentiable in x only: the packed weights are frozen bytes.
"""

from dataclasses import dataclass

import torch

from ..backend import op_for_call, tl, triton
from .reference import Mxfp4Weight


@dataclass(frozen=True)
class Mxfp4Launch:
    """How the mxfp4 grouped GEMM is launched; ``mxfp4_launch`` picks one per call."""

    rows: int  # BM: rows of x per tile (tl.dot takes 16 and up)
    block_n: int  # BN: weight rows per tile (the output columns of x W^T, the reduction of x W)
    block_k: int  # BK: weight columns per tile, a multiple of 32: whole scale groups and whole packed bytes
    warps: int  # warps per program
    stages: int  # software-pipelining depth of the reduction loop


def mxfp4_launch(dtype: torch.dtype, transposed: bool, rows_per_expert: float) -> Mxfp4Launch:
    """The launch measured fastest at K3's expert widths on an H100 (the sweep is in ``benchmarks/PERFORMANCE.md``).

    Every weight tile is decoded once per row tile, so row tiles as tall as the experts' rows allow pay it the fewest
    times: bf16 / fp16 ``x W^T`` takes 256-row tiles once the experts average 128 rows, 128-row tiles below; ``x W``
    (the gradient in x, reduced over the weight rows) takes 128 x 128 x 128 tiles on 8 warps. fp32 inputs, whose fp32
    products run on FMA units, keep 64 x 64 x 64 tiles unpipelined (2 stages spill 5 KB a thread in the sm_90 compile
    report; 1 stage fits in 128 registers)."""
    if dtype == torch.float32:
        return Mxfp4Launch(rows=64, block_n=64, block_k=64, warps=4, stages=1)
    if transposed:
        return Mxfp4Launch(rows=128, block_n=128, block_k=128, warps=8, stages=3)
    if rows_per_expert >= 128:
        return Mxfp4Launch(rows=256, block_n=128, block_k=64, warps=8, stages=3)
    return Mxfp4Launch(rows=128, block_n=64, block_k=64, warps=4, stages=3)


def row_tiles(offsets: torch.Tensor, S: int, tile_rows: int) -> torch.Tensor:
    """The ``tile_rows``-row tiles of every expert's rows, listed on the device without a host sync: ``[slots, 2]``
    int32 of (expert, first row) in expert order, then (-1, 0) for the unused slots. ``slots = cdiv(S, tile_rows) +
    min(E, S)`` bounds the tile count however the S rows are spread (at most min(E, S) experts have rows, each a
    partial tile at most), so the size is fixed by the shapes: a decoding step's few rows over hundreds of experts
    launch a few programs, not one per expert."""
    E = offsets.numel()
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + tile_rows - 1) // tile_rows  # [E]
    tiles_end = tiles.cumsum(0)
    slot = torch.arange(triton.cdiv(S, tile_rows) + min(E, S), device=offsets.device)
    expert = torch.searchsorted(tiles_end, slot, right=True)  # [slots]: E past the last expert's tiles
    used = expert < E
    expert = expert.clamp(max=E - 1)
    first_row = starts[expert] + (slot - tiles_end[expert] + tiles[expert]) * tile_rows
    return torch.stack([torch.where(used, expert, -1), torch.where(used, first_row, 0)], 1).to(torch.int32)


@triton.jit
def _e2m1_values(nibbles):
    """E2M1 nibbles (int32) -> fp32 values. Bit 3 is the sign; bits 0-2, the index, give 0 and 0.5 (index / 2) below
    2, else 2 ** (e - 1) * (1 + m / 2) for index 2e + m, whose fp32 bits are (index + 252) << 22."""
    index = nibbles & 7
    magnitude = tl.where(index < 2, index.to(tl.float32) * 0.5, ((index + 252) << 22).to(tl.float32, bitcast=True))
    return tl.where(nibbles >= 8, -magnitude, magnitude)


@triton.jit
def _e8m0_values(exponents):
    """E8M0 scales (int32) -> 2 ** (scale - 127) in fp32, written as its bits (scale 0 is the subnormal 2 ** -127)."""
    return tl.where(exponents == 0, 1 << 22, exponents << 23).to(tl.float32, bitcast=True)


@triton.jit
def _weight_tile(packed, scale, strides, expert, o_n, k0, N, K, BN: tl.constexpr, BK: tl.constexpr,
                 MMA: tl.constexpr):
    """Rows o_n ([BN]) and columns k0 ... k0 + BK of the expert's weight, decoded from its packed bytes and scales:
    [BN, BK] in the MMA dtype, zeros past N and K. ``strides``: (expert, row) strides of packed, then of scale."""
    tl.static_assert(BK % 32 == 0, "BK must cover whole scale groups of 32 weights")
    packed_expert, packed_row, scale_expert, scale_row = strides
    o_b = k0 // 2 + tl.arange(0, BK // 2)  # packed bytes
    o_g = k0 // 32 + tl.arange(0, BK // 32)  # scale groups
    expert, row = expert.to(tl.int64), o_n.to(tl.int64)[:, None]
    m_n = (o_n < N)[:, None]
    bytes_ = tl.load(packed + expert * packed_expert + row * packed_row + o_b[None, :],
                     mask=m_n & (o_b < K // 2)[None, :], other=0)
    exponents = tl.load(scale + expert * scale_expert + row * scale_row + o_g[None, :],
                        mask=m_n & (o_g < K // 32)[None, :], other=0)
    nibbles = tl.join(bytes_ & 0xF, bytes_ >> 4).to(tl.int32)  # [BN, BK / 2, 2]: the low nibble first
    groups = _e2m1_values(nibbles).reshape(BN, BK // 32, 32) * _e8m0_values(exponents.to(tl.int32))[:, :, None]
    return groups.reshape(BN, BK).to(MMA)


@triton.jit
def _row_tile(a, rows, m_r, o_c, C):
    """Columns o_c of the tile's rows ([BM, 1]) of the row-major [S, C] tensor a; zeros past the expert's rows and C."""
    return tl.load(a + rows * C + o_c[None, :], mask=m_r & (o_c < C)[None, :], other=0.0)


@triton.jit
def _mxfp4_grouped_mm_kernel(a, packed, scale, offsets, tiles, out, N, K, packed_expert, packed_row, scale_expert,
                             scale_row, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TRANSPOSED: tl.constexpr,
                             MMA: tl.constexpr):
    expert = tl.load(tiles + 2 * tl.program_id(0))
    if expert < 0:  # a slot past the last expert's tiles
        return
    rows = tl.load(tiles + 2 * tl.program_id(0) + 1) + tl.arange(0, BM)
    m_r = (rows < tl.load(offsets + expert))[:, None]
    rows = rows.to(tl.int64)[:, None]
    strides = (packed_expert, packed_row, scale_expert, scale_row)
    # "ieee": fp32 operands multiply in full fp32, not tf32 (bf16 operands are exact either way)
    if TRANSPOSED:  # out [S, K] = a [S, N] @ W_e: this program's BK columns, summed over N
        k0 = tl.program_id(1) * BK
        o_c, C = k0 + tl.arange(0, BK), K
        acc = tl.zeros((BM, BK), dtype=tl.float32)
        for n0 in range(0, N, BN):
            o_n = n0 + tl.arange(0, BN)
            w = _weight_tile(packed, scale, strides, expert, o_n, k0, N, K, BN, BK, MMA)  # [BN, BK]
            acc = tl.dot(_row_tile(a, rows, m_r, o_n, N).to(MMA), w, acc, input_precision="ieee")
    else:  # out [S, N] = a [S, K] @ W_e^T: this program's BN columns, summed over K
        o_c, C = tl.program_id(1) * BN + tl.arange(0, BN), N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            w = _weight_tile(packed, scale, strides, expert, o_c, k0, N, K, BN, BK, MMA)  # [BN, BK]
            a_tile = _row_tile(a, rows, m_r, k0 + tl.arange(0, BK), K).to(MMA)
            acc = tl.dot(a_tile, tl.trans(w), acc, input_precision="ieee")
    tl.store(out + rows * C + o_c[None, :], acc.to(out.dtype.element_ty), mask=m_r & (o_c < C)[None, :])


def _mxfp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                      transposed: bool) -> torch.Tensor:
    S = x.shape[0]
    N, K = packed.shape[1], 2 * packed.shape[2]
    launch = mxfp4_launch(x.dtype, transposed, S / offsets.numel())
    tiles = row_tiles(offsets, S, launch.rows)
    out = x.new_empty(S, K if transposed else N)
    grid = (tiles.shape[0], triton.cdiv(out.shape[1], launch.block_k if transposed else launch.block_n))
    # bf16 operands for fp16 inputs too: fp16 cannot hold the decoded weights' range (2 ** (scale - 127))
    _mxfp4_grouped_mm_kernel[grid](
        x, packed, scale, offsets, tiles, out, N, K, *packed.stride()[:2], *scale.stride()[:2], BM=launch.rows,
        BN=launch.block_n, BK=launch.block_k, TRANSPOSED=transposed,
        MMA=tl.float32 if x.dtype == torch.float32 else tl.bfloat16, num_warps=launch.warps, num_stages=launch.stages)
    return out


mxfp4_grouped_mm_op = torch.library.custom_op("kda_moe::mxfp4_grouped_mm", _mxfp4_grouped_mm, mutates_args=())


@mxfp4_grouped_mm_op.register_fake
def _(x, packed, scale, offsets, transposed):
    return x.new_empty(x.shape[0], 2 * packed.shape[2] if transposed else packed.shape[1])


def _setup(ctx, inputs, output):
    _, packed, scale, offsets, transposed = inputs
    ctx.save_for_backward(packed, scale, offsets)
    ctx.transposed = transposed


def _backward(ctx, grad_out):
    """The gradient in x is the product in the other orientation, through the op itself (so it has a backward too)."""
    packed, scale, offsets = ctx.saved_tensors
    grad_x = mxfp4_grouped_mm_op(grad_out.contiguous(), packed, scale, offsets, not ctx.transposed)
    return grad_x, None, None, None, None


torch.library.register_autograd("kda_moe::mxfp4_grouped_mm", _backward, setup_context=_setup)


def mxfp4_grouped_mm_triton(x: torch.Tensor, weight: Mxfp4Weight, offsets: torch.Tensor) -> torch.Tensor:
    """``x[r] @ W_e.T`` for every row r of expert e: x ``[S, K]`` (bf16, fp16 or fp32) sorted by expert, weight mxfp4
    ``[E, N, K]``, offsets ``[E]`` int32 the end of each expert's rows (``offsets[-1] == S``; grouped_mm's ``offs``)
    -> ``[S, N]`` in x's dtype. fp32 sums of bf16 products (fp32 products for fp32 inputs); differentiable in x."""
    return op_for_call(mxfp4_grouped_mm_op, _mxfp4_grouped_mm)(
        x.contiguous(), *map(unit_last_stride, weight), offsets.contiguous(), False)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its last dim is contiguous (the kernel takes any expert and row strides, e.g. the packed
    bytes and scales of ``Mxfp4Weight.from_rows``, views of one tensor), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()
