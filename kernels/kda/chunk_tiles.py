"""The in-chunk tile algebra of chunked KDA, shared by the forward and the backward kernels.

A 64-token chunk is four 16-row tiles. Per channel, the inclusive decay cumsum ``G`` is built tile
by tile (``decay_tiles``), always in the same order, so the forward and the backward see
bit-identical values. ``c_R`` is the decay at the end of tile ``R - 1`` (``c_0 = 0``, ``c_4 = G_end``).

Decay between two tokens, ``exp(G_i - G_j)`` with ``i >= j``, is only ever formed as a product of
two factors that cannot overflow, split at a reference ``r_R`` of the row tile R that holds ``i``:
``exp(G_i - r_R) * exp(r_R - G_j)``. So every row tile of a score matrix is one tensor-core GEMM:

* bounded gate (``g >= lower_bound >= -SAFE_LOWER_BOUND``): ``r_R`` is the tile's mid decay; within the
  tile both factors lie within ``exp(8 * 5.9)`` and columns before it only shrink, so the diagonal block is
  in the GEMM too;
* unbounded softplus gate: ``r_R`` is the decay at the tile start, both factors are <= 1 for the columns
  before the tile, and the diagonal block is summed one column at a time with the pairwise decay (the safe
  path the bounded gate exists to avoid).
"""

import triton
import triton.language as tl

BT = tl.constexpr(64)  # chunk length (a constexpr so kernels can read it; host code uses BT.value)
SAFE_LOWER_BOUND = 5.9  # |gate_lower_bound| up to which the diagonal tiles are dense GEMMs


def fast_diag(gate_lower_bound) -> bool:
    return gate_lower_bound is not None and -gate_lower_bound <= SAFE_LOWER_BOUND


@triton.jit
def gate(graw, bias, a, lb, BOUNDED: tl.constexpr):
    """Log decay from raw logits (fp32): lb*sigmoid(a z) or -a*softplus(z), z = graw + bias."""
    z = graw + bias
    if BOUNDED:
        ga = lb * tl.sigmoid(a * z)
    else:
        ez = tl.exp(tl.minimum(z, 20.0))
        sp = tl.where(z > 20.0, z, tl.where(z < -15.0, ez, tl.log(1.0 + ez)))
        ga = -a * sp
    return ga


@triton.jit
def tile_offsets(bos, t0, L, i_h, R: tl.constexpr, o_d, H: tl.constexpr, D: tl.constexpr):
    """Element offsets [16, len(o_d)] of row tile R of a [B, T, H, D] tensor, and its row mask [16]."""
    o_r = t0 + R * 16 + tl.arange(0, 16)
    p = ((bos + o_r) * H + i_h).to(tl.int64)[:, None] * D + o_d[None, :]
    return p, o_r < L


@triton.jit
def load_tile(x, bos, t0, L, i_h, R: tl.constexpr, o_d, H: tl.constexpr, D: tl.constexpr):
    """Row tile R of x (columns o_d) in fp32; rows past the sequence end read as 0."""
    p, m = tile_offsets(bos, t0, L, i_h, R, o_d, H, D)
    return tl.load(x + p, mask=m[:, None], other=0.0).to(tl.float32)


@triton.jit
def store_tile(x, val, bos, t0, L, i_h, R: tl.constexpr, o_d, H: tl.constexpr, D: tl.constexpr):
    p, m = tile_offsets(bos, t0, L, i_h, R, o_d, H, D)
    tl.store(x + p, val.to(x.dtype.element_ty), mask=m[:, None])


@triton.jit
def load_rows(x, bos, t0, L, i_h, R: tl.constexpr, H: tl.constexpr):
    """The 16 per-token scalars of row tile R of a [B, T, H] tensor (fp32, 0 past the end)."""
    o_r = t0 + R * 16 + tl.arange(0, 16)
    return tl.load(x + ((bos + o_r) * H + i_h).to(tl.int64), mask=o_r < L, other=0.0).to(tl.float32)


@triton.jit
def store_rows(x, val, bos, t0, L, i_h, R: tl.constexpr, H: tl.constexpr):
    o_r = t0 + R * 16 + tl.arange(0, 16)
    tl.store(x + ((bos + o_r) * H + i_h).to(tl.int64), val.to(x.dtype.element_ty), mask=o_r < L)


@triton.jit
def decay_tiles(g, dt_bias, a, lb, bos, t0, L, i_h, o_k, H: tl.constexpr, K: tl.constexpr, BOUNDED: tl.constexpr):
    """Inclusive in-chunk decay cumsum of channels o_k as four [16, BK] tiles G0..G3, and the
    decays c1, c2, c3 at the ends of tiles 0..2 and c4 = G_end ([BK] each). Rows past the end add 0."""
    bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)[None, :]
    ga0 = _gate_tile(g, bias, a, lb, bos, t0, L, i_h, 0, o_k, H, K, BOUNDED)
    ga1 = _gate_tile(g, bias, a, lb, bos, t0, L, i_h, 1, o_k, H, K, BOUNDED)
    ga2 = _gate_tile(g, bias, a, lb, bos, t0, L, i_h, 2, o_k, H, K, BOUNDED)
    ga3 = _gate_tile(g, bias, a, lb, bos, t0, L, i_h, 3, o_k, H, K, BOUNDED)
    c1 = tl.sum(ga0, 0)
    c2 = c1 + tl.sum(ga1, 0)
    c3 = c2 + tl.sum(ga2, 0)
    c4 = c3 + tl.sum(ga3, 0)
    G0 = tl.cumsum(ga0, 0)
    G1 = c1[None, :] + tl.cumsum(ga1, 0)
    G2 = c2[None, :] + tl.cumsum(ga2, 0)
    G3 = c3[None, :] + tl.cumsum(ga3, 0)
    return G0, G1, G2, G3, c1, c2, c3, c4


@triton.jit
def _gate_tile(g, bias, a, lb, bos, t0, L, i_h, R: tl.constexpr, o_k, H: tl.constexpr, K: tl.constexpr,
               BOUNDED: tl.constexpr):
    p, m = tile_offsets(bos, t0, L, i_h, R, o_k, H, K)
    graw = tl.load(g + p, mask=m[:, None], other=0.0).to(tl.float32)
    return tl.where(m[:, None], gate(graw, bias, a, lb, BOUNDED), 0.0)


@triton.jit
def tile_reference(c_lo, c_hi, FAST_DIAG: tl.constexpr):
    """The decay reference r_R of a row tile spanning decays [c_lo, c_hi]: its mid decay when the diagonal block
    is a GEMM (bounded gate), else its start (every factor <= 1)."""
    if FAST_DIAG:
        r = 0.5 * (c_lo + c_hi)
    else:
        r = c_lo
    return r


@triton.jit
def _tile_row(x, sel):
    """[64, N]: the row of each 16-row tile that ``sel`` marks, repeated over that tile's rows."""
    N: tl.constexpr = x.shape[1]
    x3 = tl.sum(tl.reshape(tl.where(sel, x, 0.0), (4, 16, N)), 1)
    return tl.reshape(tl.broadcast_to(x3[:, None, :], (4, 16, N)), (64, N))


@triton.jit
def diagonal_scores(kk, qk, kt, qt, G):
    """Add the four diagonal [16, 16] blocks of kk and qk ([64, 64]) for an unbounded gate: one column of every
    block at a time, with the pairwise decay e^(G_i - G_j) <= 1 formed directly (the safe path)."""
    o_t = tl.arange(0, 64)
    pos = o_t % 16
    for jj in range(16):
        sel = (pos == jj)[:, None]
        e = tl.exp(tl.where((pos >= jj)[:, None], G - _tile_row(G, sel), float("-inf"))) * _tile_row(kt, sel)
        col = o_t[None, :] == (o_t - pos + jj)[:, None]  # column 16 * tile(i) + jj of row i
        kk += tl.where(col, tl.sum(kt * e, 1)[:, None], 0.0)
        qk += tl.where(col, tl.sum(qt * e, 1)[:, None], 0.0)
    return kk, qk


@triton.jit
def causal_mask(x, STRICT: tl.constexpr):
    """Zero the non-causal half of a diagonal [16, 16] block (and the diagonal itself if STRICT)."""
    o_i = tl.arange(0, 16)
    if STRICT:
        keep = o_i[None, :] < o_i[:, None]
    else:
        keep = o_i[None, :] <= o_i[:, None]
    return tl.where(keep, x, 0.0)


@triton.jit
def _side_by_side(x0, x1, x2, x3):
    """Four [16, 16] blocks in a row: [16, 64]."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [16, 16, 2(lo), 2(hi)]: block 2 * hi + lo
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (16, 64))


@triton.jit
def stack_rows(x0, x1, x2, x3):
    """Four [16, N] row tiles on top of each other: [64, N]."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [16, N, 2(lo), 2(hi)]: tile 2 * hi + lo
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (64, x0.shape[1]))


@triton.jit
def stack_vectors(x0, x1, x2, x3):
    """Four [16] vectors end to end: [64]."""
    return tl.reshape(stack_rows(x0[:, None], x1[:, None], x2[:, None], x3[:, None]), (64,))


@triton.jit
def _four_blocks(r):
    """[16, 16, 2(cl), 2(ch)] -> its four [16, 16] blocks, S = 2 ch + cl in order."""
    lo, hi = tl.split(r)
    b0, b1 = tl.split(lo)
    b2, b3 = tl.split(hi)
    return b0, b1, b2, b3


@triton.jit
def lower_blocks(M):
    """The ten [16, 16] blocks on and below the diagonal of a [64, 64] matrix: M00, M10, M11, M20, ..., M33."""
    x = tl.permute(tl.reshape(M, (2, 2, 16, 2, 2, 16)), (2, 5, 4, 3, 1, 0))  # [i, j, cl, ch, rl, rh]
    top, bottom = tl.split(x)
    r0, r1 = tl.split(top)  # row tiles R = 2 rh + rl: [16, 16, 2(cl), 2(ch)]
    r2, r3 = tl.split(bottom)
    b00, _, _, _ = _four_blocks(r0)
    b10, b11, _, _ = _four_blocks(r1)
    b20, b21, b22, _ = _four_blocks(r2)
    b30, b31, b32, b33 = _four_blocks(r3)
    return b00, b10, b11, b20, b21, b22, b30, b31, b32, b33


@triton.jit
def lower_block_matrix(b00, b10, b11, b20, b21, b22, b30, b31, b32, b33):
    """The [64, 64] matrix with these [16, 16] blocks on and below the diagonal, zeros above."""
    z = tl.zeros_like(b00)
    return stack_rows(_side_by_side(b00, z, z, z), _side_by_side(b10, b11, z, z), _side_by_side(b20, b21, b22, z),
                      _side_by_side(b30, b31, b32, b33))


@triton.jit
def chunk_offsets64(bos, t0, L, i_h, o_d, H: tl.constexpr, D: tl.constexpr):
    """Element offsets [64, len(o_d)] of one chunk of a [B, T, H, D] tensor and its row mask [64, 1]."""
    o_t = t0 + tl.arange(0, 64)
    return ((bos + o_t) * H + i_h).to(tl.int64)[:, None] * D + o_d[None, :], (o_t < L)[:, None]


@triton.jit
def unit_lower_inverse(N, PREC: tl.constexpr):
    """(I + N)^-1 for strictly lower-triangular N [16, 16] (fp32): (I - N)(I + N^2)(I + N^4)(I + N^8),
    exact because N^16 = 0."""
    o_i = tl.arange(0, 16)
    X = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0) - N
    N2 = tl.dot(N, N, input_precision=PREC)
    X += tl.dot(X, N2, input_precision=PREC)
    N4 = tl.dot(N2, N2, input_precision=PREC)
    X += tl.dot(X, N4, input_precision=PREC)
    N8 = tl.dot(N4, N4, input_precision=PREC)
    return X + tl.dot(X, N8, input_precision=PREC)


@triton.jit
def chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN: tl.constexpr):
    """(valid, bos, chunk start inside the sequence, sequence length) of chunk slot i_p."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_p * 2)
        i_c = tl.load(chunk_indices + i_p * 2 + 1)
        ok = i_n >= 0
        i_n = tl.maximum(i_n, 0)
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        NT = tl.cdiv(T, 64)
        bos = (i_p // NT) * T
        i_c = i_p % NT
        L = T
        ok = i_p >= 0
    return ok, bos, i_c * 64, L


@triton.jit
def seq_coords(cu_seqlens, chunk_offsets, i_n, T, IS_VARLEN: tl.constexpr):
    """(bos, length, first chunk slot) of sequence i_n."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        c_off = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        bos = i_n * T
        L = T
        c_off = i_n * tl.cdiv(T, 64)
    return bos, L, c_off
