"""The diagonal [16, 16] blocks of steep chunks' gated scores, summed apart from the row tiles' GEMMs.

In a chunk that ``steep_chunks.py`` flags, some channel decays by more than ``DIAG_SPAN`` across a 16-token tile, so
no one reference splits the tile's pairwise decay ``e^(G_i - G_j)`` into two factors that fit fp32
(``chunk_tiles.py``).

* Forward: the chunk kernel splits every row tile of such a chunk at its start (every factor <= 1), leaves the
  tiles' own blocks out of its GEMMs and adds ``diagonal_scores``'s. That pass runs one program per flagged (chunk,
  head), row by row: row i's pairwise decays to its tile's rows, ``P_ijc = e^(Gt_ic - Gt_jc)`` for j <= i (a [16, K]
  tile; ``Gt`` is the decay cumsum restarted at the tile, so that steep channels lose no precision to long sums; row
  i's own loaded once more, so that every reduction runs along the channels), give ``kk_ij = sum_c k_ic k_jc P_ijc``
  and ``qk_ij`` likewise with q_i, of the raw rows.
* Backward: the gate-gradient kernel checks every K slice of a flagged chunk (``slice_diagonals_in_gemms``); a slice
  whose tiles all stay within DIAG_SPAN keeps its diagonal blocks in the GEMMs, the others add their pairs' gradients
  with ``diagonal_grads``: by quarter tiles as GEMMs where no channel decays by more than DIAG_SPAN across a quarter's
  four rows, else one column at a time. (A row-by-row pass like the forward's, ahead of the gate kernel, made the
  forward + backward at 16 x 4096 x 16 with the benchmark's steep gates 30.2 ms on an H100, against 28.5 so.)
"""

import torch

from ..backend import tl, triton
from .chunk_tiles import BT, DIAG_SPAN, as_mma_reads, chunk_coords, chunk_decay, gate, tile_spans
from .steep_chunks import STEEP_CHUNKS, takes_chunk

DIAGONAL_WARPS = 4  # warps of the forward's pass
SUBTILE = tl.constexpr(4)  # rows of the quarter tiles of the backward's diagonal blocks


@triton.jit
def _tile_rows(bos, t0, L, R, i_h, H: tl.constexpr):
    """Row tile R of a chunk: its rows' token-head indices ([16]) and mask, and its first row's token index."""
    first = bos + t0 + 16 * R
    rows = first + tl.arange(0, 16)
    return (rows * H + i_h).to(tl.int64), rows < bos + L, first


@triton.jit
def _row_gate(g, dtb, a, lb, ti, mi, o_k, K: tl.constexpr, BOUNDED: tl.constexpr):
    """One row's log decay over the channels o_k ([K]; 0 where the mask ``mi`` ([K]) marks the row past the
    sequence end), ``dtb`` the head's dt_bias."""
    z = tl.load(g + ti * K + o_k, mask=mi, other=0.0).to(tl.float32) + dtb
    return tl.where(mi, gate(z, 0.0, a, lb, BOUNDED), 0.0)


@triton.jit
def diagonal_block(D, tok, m_r, WHICH: tl.constexpr):
    """[64, 64]: a chunk's four diagonal blocks of kk (WHICH 0) or qk (WHICH 1) from ``diagonal_scores``' D, zeros
    elsewhere (``tok``: the chunk's rows' token-head indices, ``m_r`` their mask)."""
    o_c = tl.arange(0, BT)
    return tl.load(D + tok[:, None] * 32 + WHICH * 16 + (o_c % 16)[None, :], mask=_diagonal_blocks() & m_r[:, None],
                   other=0.0)


@triton.jit
def _diagonal_scores_kernel(q, k, g, A_log, dt_bias, D, cu_seqlens, chunk_indices, steep, T, lb, H: tl.constexpr,
                            K: tl.constexpr, IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr):
    """Per steep chunk and head, tile by tile and row by row: row i's pairwise decays to its tile's rows j,
    ``e^(Gt_i - Gt_j)`` ([16, K], ``Gt_i`` summed row by row), times k_j, contracted with k_i and q_i."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if takes_chunk(ok, steep, i_p * H + i_h, STEEP_CHUNKS):
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        o_j = tl.arange(0, 16)
        o_k = tl.arange(0, K)
        dtb = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        for R in range(4):
            tok, m_r, first = _tile_rows(bos, t0, L, R, i_h, H)
            pk = tok[:, None] * K + o_k[None, :]
            kt = tl.load(k + pk, mask=m_r[:, None], other=0.0).to(tl.float32)
            _, Gt = chunk_decay(g, dt_bias, a, lb, pk, m_r[:, None], i_h, o_k, K, BOUNDED)  # restarted at the tile
            Gi = tl.zeros((K,), dtype=tl.float32)
            for i in range(16):
                ti = ((first + i) * H + i_h).to(tl.int64)
                mi = first + i + 0 * o_k < bos + L  # [K]: row i is in the sequence
                Gi += _row_gate(g, dtb, a, lb, ti, mi, o_k, K, BOUNDED)
                X = tl.exp(tl.where((o_j <= i)[:, None], Gi[None, :] - Gt, float("-inf"))) * kt  # P_ij k_j
                ki = tl.load(k + ti * K + o_k, mask=mi, other=0.0).to(tl.float32)
                qi = tl.load(q + ti * K + o_k, mask=mi, other=0.0).to(tl.float32)
                mj = first + i + 0 * o_j < bos + L
                tl.store(D + ti * 32 + o_j, tl.sum(X * ki[None, :], 1), mask=mj)
                tl.store(D + ti * 32 + 16 + o_j, tl.sum(X * qi[None, :], 1), mask=mj)


def diagonal_scores(call) -> torch.Tensor:
    """[B, T, H, 2, 16] fp32: the diagonal blocks of kk and qk of ``call``'s steep chunks (a ``chunk_fwd.KdaCall``),
    row i holding its tile's 16 columns (meaningful for j <= i; rows of other chunks are left unwritten)."""
    B, T, H, K = call.q.shape
    D = torch.empty(B, T, H, 2, 16, device=call.q.device, dtype=torch.float32)
    _diagonal_scores_kernel[(call.NS, H)](
        call.q, call.k, call.g, call.A_log, call.dt_bias, D, call.cu_seqlens, call.chunk_indices, call.steep, T,
        call.lb, H=H, K=K, IS_VARLEN=call.cu_seqlens is not None, BOUNDED=call.gate_lower_bound is not None,
        num_warps=DIAGONAL_WARPS)
    return D


@triton.jit
def _tile_sum(x):
    """[64, N]: the sum over each 16-row tile, repeated over that tile's rows."""
    N: tl.constexpr = x.shape[1]
    x3 = tl.sum(tl.reshape(x, (4, 16, N)), 1)
    return tl.reshape(tl.broadcast_to(x3[:, None, :], (4, 16, N)), (64, N))


@triton.jit
def _tile_row(x, sel):
    """[64, N]: the row of each 16-row tile that ``sel`` marks, repeated over that tile's rows."""
    return _tile_sum(tl.where(sel, x, 0.0))


@triton.jit
def _subtile_span(G, S: tl.constexpr):
    """The largest decay (-log) of any channel from the first to the last row of any S-row sub-tile (a scalar)."""
    X = tl.reshape(G, (64 // S, S, G.shape[1]))
    pos = tl.arange(0, S)[None, :, None]
    return tl.max(tl.sum(tl.where(pos == 0, X, tl.where(pos == S - 1, -X, 0.0)), 1))


@triton.jit
def _diagonal_blocks():
    """[64, 64] mask of the four diagonal [16, 16] blocks: the pairs of rows in one tile."""
    tile = tl.arange(0, BT) // 16
    return tile[:, None] == tile[None, :]


@triton.jit
def _subtile_factors(G, s, S: tl.constexpr):
    """Sub-tile s of every tile (rows s .. s + S - 1) split at its mid decay ``rho``: the row factors
    ``e^(G_i - rho)`` of the rows from it on and the column factors ``e^(rho - G_j)`` of its own rows, 0 elsewhere
    ([64, BK] each; both within e^(DIAG_SPAN / 2) on the sub-tile when ``_subtile_span`` is)."""
    pos = tl.arange(0, BT) % 16
    rho = 0.5 * _tile_sum(tl.where(((pos == s) | (pos == s + S - 1))[:, None], G, 0.0))
    rows = tl.exp(tl.where((pos >= s)[:, None], G - rho, float("-inf")))
    cols = tl.exp(tl.where(((pos >= s) & (pos < s + S))[:, None], rho - G, float("-inf")))
    return rows, cols


@triton.jit
def diagonal_grads(rl, rq, C, dG, dLb, dAqb, pm, pairs, k, Nb, tok, o_k, n_rows, kn, bk, qn, G, H: tl.constexpr,
                   K: tl.constexpr, MMA: tl.constexpr, PREC: tl.constexpr):
    """The diagonal blocks' share of the gate kernel's score gradients where a K slice's GEMMs leave them out: the
    blocks' row sums ``rl_i = sum_j dL_ij kn_j e^(G_i - G_j)`` (``rq`` with dA_qk), column sums ``C_j = sum_i (dL_ij
    bk_i + dA_ij qn_i) e^(G_i - G_j)`` (j < i in i's tile; the gate kernel adds the pairs i = j itself) and their decay
    gradient ``bk rl + qn rq - kn C``, added to the accumulators rl, rq, C and dG ([64, BK] each): by quarter tiles as
    GEMMs when no channel decays by more than ``DIAG_SPAN`` across any quarter's four rows (``_subtile_grads``), else
    one column at a time (``_column_grads``). dL and dA_qk are read from dLb / dAqb ([tokens, 64] in the operand
    dtype, ``pm`` their chunk's offsets, ``pairs`` the mask of its pairs j < i)."""
    if _subtile_span(G, SUBTILE) <= DIAG_SPAN:
        rl, rq, C, dG = _subtile_grads(rl, rq, C, dG, dLb, dAqb, pm, pairs, kn, bk, qn, G, SUBTILE, MMA, PREC)
    else:
        xl, xq, xc = _column_grads(dLb, dAqb, k, Nb, tok, o_k, n_rows, bk, qn, G, H, K)
        rl += xl
        rq += xq
        C += xc
        dG += bk * xl + qn * xq - kn * xc
    return rl, rq, C, dG


@triton.jit
def _subtile_grads(rl, rq, C, dG, dLb, dAqb, pm, pairs, kn, bk, qn, G, S: tl.constexpr, MMA: tl.constexpr,
                   PREC: tl.constexpr):
    """``diagonal_grads`` by S-row sub-tiles, each split at its mid decay (``_subtile_factors``);
    dL and dA_qk are loaded with their off-diagonal blocks zeroed (the GEMMs would mix the tiles' references).
    Operands are rounded as the MMA reads them (``as_mma_reads``), as in ``_row_tile_grads``."""
    block = _diagonal_blocks()
    dl = tl.load(dLb + pm, mask=pairs & block, other=0.0).to(MMA)
    da = tl.load(dAqb + pm, mask=pairs & block, other=0.0).to(MMA)
    dlt, dat = tl.trans(dl), tl.trans(da)
    for s in range(0, 16, S):
        f, cf = _subtile_factors(G, s, S)
        kc = as_mma_reads(kn * cf, MMA, PREC)
        pb = as_mma_reads(bk * f, MMA, PREC)
        pq = as_mma_reads(qn * f, MMA, PREC)
        col = kc.to(MMA)
        xl = tl.dot(dl, col, input_precision=PREC)
        xq = tl.dot(da, col, input_precision=PREC)
        xc = tl.dot(dlt, pb.to(MMA), tl.dot(dat, pq.to(MMA), input_precision=PREC), input_precision=PREC)
        rl += f * xl
        rq += f * xq
        C += cf * xc
        dG += pb * xl + pq * xq - kc * xc
    return rl, rq, C, dG


@triton.jit
def _column_grads(dLb, dAqb, k, Nb, tok, o_k, n_rows, bk, qn, G, H: tl.constexpr, K: tl.constexpr):
    """``diagonal_grads`` one column of every block at a time, with the pairwise decay formed directly, for the pairs
    j < i (the gate kernel adds i = j apart). dL_ij, dA_ij and kn_j (k times its row's inverse norm in Nb) are
    loaded again per column, L1 hits, rather than gathered from registers across the threads (``tok``: the rows'
    token-head indices, ``o_k`` the slice's channels, the first ``n_rows`` rows in the sequence): on the H200 the
    softplus forward + backward at 16 x 4096 x 16 takes 29.5 ms so, 47.0 with gathers."""
    o_t = tl.arange(0, BT)
    pos = o_t % 16
    rl = tl.zeros_like(bk)
    rq = tl.zeros_like(bk)
    C = tl.zeros_like(bk)
    m_r = o_t < n_rows
    for jj in range(16):
        sel = (pos == jj)[:, None]
        e = tl.exp(tl.where((pos > jj)[:, None], G - _tile_row(G, sel), float("-inf")))
        j = o_t - pos + jj  # column 16 * tile(i) + jj of row i
        pl = tl.load(dLb + tok * BT + j, mask=m_r, other=0.0).to(tl.float32)[:, None]
        pq = tl.load(dAqb + tok * BT + j, mask=m_r, other=0.0).to(tl.float32)[:, None]
        tj = tok + (j - o_t) * H  # row j's token-head index
        mj = j < n_rows
        kj = tl.load(k + tj[:, None] * K + o_k[None, :], mask=mj[:, None], other=0.0).to(tl.float32) * \
            tl.load(Nb + 2 * tj, mask=mj, other=0.0)[:, None]
        rl += pl * e * kj
        rq += pq * e * kj
        C += tl.where(sel, _tile_sum((pl * bk + pq * qn) * e), 0.0)
    return rl, rq, C


@triton.jit
def slice_diagonals_in_gemms(c1, c2, c3, c4, FAST_DIAG: tl.constexpr):
    """Whether the gate kernel keeps a K slice's diagonal blocks in its row tiles' GEMMs (mid-tile references): always
    in a chunk whose tiles all stay within DIAG_SPAN (``FAST_DIAG``), else when the slice's do (tile-end decays
    c1..c4, ``tile_ends``)."""
    if FAST_DIAG:
        diag = True
    else:
        diag = tl.max(tile_spans(c1, c2, c3, c4), 0) <= DIAG_SPAN
    return diag
