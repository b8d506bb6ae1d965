"""The in-chunk tile algebra of chunked KDA, shared by the forward and the backward kernels.

A 64-token chunk is four 16-row tiles; kernels hold whole chunks as ``[64, N]`` tiles. Per channel ``G`` is
the inclusive decay cumsum over the chunk, and ``c_R`` the decay at the end of tile ``R - 1`` (``c_0 = 0``,
``c_4 = G_end``).

Decay between two tokens, ``exp(G_i - G_j)`` with ``i >= j``, is only ever formed as a product of
two factors that cannot overflow, split at a reference ``r_R`` of the row tile R that holds ``i``:
``exp(G_i - r_R) * exp(r_R - G_j)``. So every row tile of a score matrix is one tensor-core GEMM:

* when no channel decays by more than ``DIAG_SPAN`` (e^-94.4) across a 16-token tile, ``r_R`` is the tile's mid
  decay: within the tile both factors lie within ``exp(47.2)`` and columns before it only shrink, so the diagonal
  block is in the GEMM too. A bounded gate (``g >= lower_bound >= -SAFE_LOWER_BOUND``) guarantees it for every
  tile; for any other gate (softplus, or bounded beyond that) ``steep_chunks.py`` marks the chunks where it fails;
* in those, ``r_R`` is the decay at the tile start, both factors are <= 1 for the columns before the tile, and
  the diagonal block is summed apart (``diagonal_blocks.py``).
"""

from ..backend import tl, triton
from .reference import L2NORM_EPS
from .tile_limits import CHUNK_SIZE, SAFE_LOWER_BOUND

BT = tl.constexpr(CHUNK_SIZE)  # the chunk length as a constexpr the kernels read
NORM_EPS = tl.constexpr(L2NORM_EPS)
DIAG_SPAN = tl.constexpr(16 * SAFE_LOWER_BOUND)  # the largest decay (-log) across a tile whose diagonal is a GEMM


def fast_diag(gate_lower_bound) -> bool:
    """Whether the gate's bound alone keeps every tile within DIAG_SPAN (no chunk is then steep)."""
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
def as_mma_reads(y, MMA: tl.constexpr, PREC: tl.constexpr):
    """fp32 y rounded exactly as a tensor-core product with operand dtype MMA and input precision PREC reads it: to
    bf16 / fp16, or to tf32 by dropping the low 13 mantissa bits as Hopper's tf32 MMA does ("tf32x3" keeps fp32).
    A product of two such values is exact in fp32, so a kernel can form the same pair term outside the MMA."""
    y = y.to(MMA).to(tl.float32)
    if PREC == "tf32" and MMA == tl.float32:  # bf16 / fp16 values are exact in tf32 already
        y = (y.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return y


@triton.jit
def chunk_decay(g, dt_bias, a, lb, pk, mk, i_h, o_k, K: tl.constexpr, BOUNDED: tl.constexpr):
    """The decay over channels o_k of the rows at offsets pk (a chunk's, or one 16-row tile's): gate logits
    z = g + dt_bias and the inclusive decay cumsum G over those rows ([rows, BK] each); masked rows (past the
    sequence end) decay by 0."""
    z = tl.load(g + pk, mask=mk, other=0.0).to(tl.float32) + tl.load(dt_bias + i_h * K + o_k).to(tl.float32)[None, :]
    return z, tl.cumsum(tl.where(mk, gate(z, 0.0, a, lb, BOUNDED), 0.0), 0)


@triton.jit
def chunk_end(G):
    """The chunk's total decay ``G_end`` ([BK]): exactly G's last row, so the last token's ``e^(G_end - G)`` is 1."""
    return tl.sum(tl.where((tl.arange(0, BT) == BT - 1)[:, None], G, 0.0), 0)


@triton.jit
def tile_ends(G):
    """G at the end of tiles 0..3, ``c_1..c_4`` ([BK] each; ``c_4 = G_end``), in one reduction across the warps
    (four separate sums took a barrier each)."""
    o_t = tl.arange(0, BT)[:, None]
    return tl.reduce((tl.where(o_t == 15, G, 0.0), tl.where(o_t == 31, G, 0.0), tl.where(o_t == 47, G, 0.0),
                      tl.where(o_t == 63, G, 0.0)), 0, _add4)


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def tile_references(G, c1, c2, c3, c4, diag):
    """(r_0..r_3, f) of one chunk's K slice with tile-end decays c1..c4 (``tile_ends``): the row tiles' decay
    references ([BK] each, see ``tile_reference``; ``diag``: the slice's diagonal blocks are in the GEMMs) and every
    row's factor against its own tile's reference, ``e^(G_i - r_R(i))`` ([64, BK])."""
    tile = (tl.arange(0, BT) // 16)[:, None]
    r0 = tile_reference(tl.zeros_like(c1), c1, diag)
    r1 = tile_reference(c1, c2, diag)
    r2 = tile_reference(c2, c3, diag)
    r3 = tile_reference(c3, c4, diag)
    rows = tl.where(tile == 0, r0[None, :], tl.where(tile == 1, r1[None, :], tl.where(tile == 2, r2[None, :],
                                                                                        r3[None, :])))
    return r0, r1, r2, r3, tl.exp(G - rows)


@triton.jit
def tile_spans(c1, c2, c3, c4):
    """Each channel's largest decay (-log) across one of a chunk's four tiles, from the tile-end decays c1..c4
    (``tile_ends``; [BK] each): G falls along the chunk, so a tile's span is its start's decay minus its end's."""
    return tl.maximum(tl.maximum(-c1, c1 - c2), tl.maximum(c2 - c3, c3 - c4))


@triton.jit
def column_factor(G, r, R: tl.constexpr, diag):
    """``e^(r - G_j)`` on the columns row tile R sees through the GEMM, 0 elsewhere ([64, BK]): the tiles before
    it, and its own when its diagonal block is in the GEMM (``diag``; else ``diagonal_blocks.py`` sums it)."""
    o_t = tl.arange(0, BT)
    if diag:
        seen = o_t < 16 * (R + 1)
    else:
        seen = o_t < 16 * R
    return tl.exp(tl.where(seen[:, None], r[None, :] - G, float("-inf")))


@triton.jit
def tile_reference(c_lo, c_hi, diag):
    """The decay reference r_R of a row tile spanning decays [c_lo, c_hi]: its mid decay when its diagonal block is
    a GEMM, else its start (every factor <= 1)."""
    if diag:
        r = 0.5 * (c_lo + c_hi)
    else:
        r = c_lo
    return r


@triton.jit
def _side_by_side(x0, x1, x2, x3):
    """Four [16, 16] blocks in a row: [16, 64]."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [16, 16, 2(lo), 2(hi)]: block 2 * hi + lo
    return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (16, 64))


@triton.jit
def _stack_rows(x0, x1, x2, x3):
    """Four [16, N] row tiles on top of each other: [64, N]."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [16, N, 2(lo), 2(hi)]: tile 2 * hi + lo
    return tl.reshape(tl.permute(x, (3, 2, 0, 1)), (64, x0.shape[1]))


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
    return _stack_rows(_side_by_side(b00, z, z, z), _side_by_side(b10, b11, z, z), _side_by_side(b20, b21, b22, z),
                      _side_by_side(b30, b31, b32, b33))


@triton.jit
def chunk_offsets64(bos, t0, L, i_h, o_d, H: tl.constexpr, D: tl.constexpr):
    """Element offsets [64, len(o_d)] of one chunk of a [B, T, H, D] tensor and its row mask [64, 1]."""
    o_t = t0 + tl.arange(0, BT)
    return ((bos + o_t) * H + i_h).to(tl.int64)[:, None] * D + o_d[None, :], (o_t < L)[:, None]


@triton.jit
def inverse_row_norms(q, k, bos, t0, L, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """1 / ||k_i|| and 1 / ||q_i|| of one chunk's rows ([64] each), over K in BK slices."""
    sk = tl.zeros((BT,), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    for kb in range(0, K, BK):
        pk, mk = chunk_offsets64(bos, t0, L, i_h, kb + tl.arange(0, BK), H, K)
        x = tl.load(k + pk, mask=mk, other=0.0).to(tl.float32)
        sk += tl.sum(x * x, 1)
        x = tl.load(q + pk, mask=mk, other=0.0).to(tl.float32)
        sq += tl.sum(x * x, 1)
    return inverse_norm(sk), inverse_norm(sq)


@triton.jit
def inverse_norm(sum_of_squares):
    """1 / ||x|| from a row's sum of squares."""
    return tl.rsqrt(sum_of_squares + NORM_EPS)


@triton.jit
def load_row_norms(Nb, tok, m_r):
    """1 / ||k_i|| and 1 / ||q_i|| of one chunk's rows ([64] each; ``tok``: their token-head indices) as the
    forward's chunk kernel stored them for the backward (which would otherwise recompute them in every kernel) or for
    the scan of a forward whose gated rows stay raw (``chunk_fwd.forms_wu``)."""
    return tl.load(Nb + 2 * tok, mask=m_r, other=0.0), tl.load(Nb + 2 * tok + 1, mask=m_r, other=0.0)


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
        NT = tl.cdiv(T, BT)
        bos = (i_p // NT) * T
        i_c = i_p % NT
        L = T
        ok = i_p >= 0
    return ok, bos, i_c * BT, L


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
        c_off = i_n * tl.cdiv(T, BT)
    return bos, L, c_off


@triton.jit
def scan_start(h0, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BV: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr):
    """Where a scan program (one per V tile, sequence and head) starts: its head, its sequence's (bos, length, first
    chunk slot), its K and V offsets, the offsets of its [K, BV] state tile in [N, H, K, V] tensors, and that tile
    of h0 (fp32; zeros without one)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    bos, L, c_off = seq_coords(cu_seqlens, chunk_offsets, i_nh // H, T, IS_VARLEN)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    ps = (i_nh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + ps).to(tl.float32)
    else:
        S = tl.zeros((K, BV), dtype=tl.float32)
    return i_nh % H, bos, L, c_off, o_k, o_v, ps, S
