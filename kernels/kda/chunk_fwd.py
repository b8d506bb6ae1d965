"""Chunked KDA forward: a chunk-parallel kernel, then one scan over the chunks.

``_chunk_kernel`` (one program per 64-token chunk and head) fuses the gate activation, the decay
cumsum ``G``, the q/k L2 norms, q's scale and beta's sigmoid. It builds ``A_kk`` (strictly causal) and
``A_qk`` (causal) over K in BK-wide slices, one M = 64 GEMM per 16-row tile (the decay factoring is in
``chunk_tiles.py``), inverts ``I + diag(beta) A_kk`` by 16x16 blocks, and writes, in the storage dtype
(bf16 for bf16 inputs, else fp32; the gated rows are stored by the scores pass itself, so q, k and g are read once,
plus a norm pass over q and k where the rows are stored normalised):

* ``W = T diag(beta) (k * exp(G))`` and ``U = T diag(beta) v`` with ``T = (I + diag(beta) A_kk)^-1``, or
  ``k * exp(G)`` and ``T`` for the scan to apply (``ForwardLaunch.form_wu``; the gated rows then stay raw and the rows' inverse
  norms, summed in the scores pass, go to the scan),
* ``Qg = q * exp(G)``, ``Kd = k * exp(G_end - G)``, ``A_qk``, and ``gamma = exp(G_end)`` (fp32),
* for the backward, ``T`` itself. The backward's recompute (``LOAD_T``) loads the forward's ``T`` and ``A_qk``
  instead of redoing the gated scores and the inverse.

``_scan_kernel`` (one program per sequence, head and V tile) walks the chunks in order with the fp32
state ``S [K, BV]`` in registers: ``delta = U - W S`` (or ``T diag(beta) (v - k e^G S)``), ``o = Qg S + A_qk delta``,
``S <- gamma * S + Kd^T delta`` (k and q normalised: raw rows take their norms here). For the backward it stores
``S`` per chunk (fp32 by default) and ``delta``.

Where the gate's bound does not keep every tile a GEMM, the chunk kernel runs twice (``steep_chunks.py``): over the
chunks whose tiles allow it, then over the steep others, whose row tiles are split at their starts and whose diagonal
blocks ``diagonal_blocks.diagonal_scores`` sums beforehand.

``forward_launch`` picks the kernels' launch settings (a ``ForwardLaunch``) from the shape, dtype and gate;
``chunk_kda_fwd`` runs ``launch_chunk_kernel`` then ``launch_output_scan``, and ``recompute_for_backward`` is the
backward's first stage.
"""

from dataclasses import dataclass
from functools import cached_property

import torch

from ..backend import tl, triton
from .chunk_tiles import (BT, chunk_coords, chunk_decay, chunk_end, chunk_offsets64, column_factor, fast_diag,
                          inverse_norm, inverse_row_norms, load_row_norms, lower_block_matrix, lower_blocks, scan_start,
                          tile_ends, tile_references, unit_lower_inverse)
from .diagonal_blocks import diagonal_block, diagonal_scores
from .steep_chunks import EVERY_CHUNK, chunk_launches, steep_chunk_flags, takes_chunk


@dataclass(frozen=True)
class ForwardLaunch:
    """How the forward's two kernels are launched; ``forward_launch`` picks one per call."""

    chunk_warps: int  # warps of the chunk kernel
    chunk_bk: int  # width of the chunk kernel's K and V slices (at most K and V)
    chunk_stages: int  # software-pipelining depth of the chunk kernel's K loops
    chunk_maxnreg: int | None  # register cap of the chunk kernel (None: the compiler's choice)
    inv_prec: str  # input precision of the 16x16 inverse's products: "ieee" (fp32) or "tf32"
    form_wu: bool  # the chunk kernel forms W and U; else the output scan applies T to v - k e^G S itself
    scan_warps: int  # warps of the scan over the chunks
    scan_bv: int  # width of each scan program's V tile
    scan_stages: int  # software-pipelining depth of the scan
    state_fp32: bool  # the backward's recompute stores the per-chunk states in fp32, else in the storage dtype


def forward_launch(K: int, V: int, pairs: int, dtype: torch.dtype, *, for_backward: bool = False,
                   loads_scores: bool = False) -> ForwardLaunch:
    """The launch of a forward over ``pairs`` (sequence, head) pairs with head dims K, V and inputs of ``dtype``;
    ``for_backward``: the backward's recompute, which stores the per-chunk states and reads W and U, and
    ``loads_scores``: one that loads the forward's kept T, A_qk and norms. The values ran fastest on an H200 (bf16,
    B x T x H = 16 x 4096 x 16, K = V = 128, unless a comment names other shapes)."""
    scan_bv, scan_stages = scan_tile(V, pairs, storage_dtype(dtype), 1, stores_states=for_backward)
    return ForwardLaunch(
        chunk_warps=4,  # 4 (8 are slower, also at a 128-register cap)
        chunk_bk=32,  # 32-wide slices (16 and 64 are slower)
        chunk_stages=4,
        # 168: three programs per SM, a few registers spilling; 128 for a recompute that loads the kept scores: four
        # per SM without spilling
        chunk_maxnreg=128 if loads_scores else 168,
        inv_prec="ieee",  # fp32 products: tf32 is no faster there
        # W and U in the chunk kernel below 64 pairs (1 x 65536 x 16: a few scans are the critical path), in the scan
        # from 64 up (256 pairs, 1 x 32768 x 96); the backward reads W and U
        form_wu=for_backward or pairs < 64,
        scan_warps=4,  # 4 (8 are slower)
        scan_bv=scan_bv,
        scan_stages=scan_stages,  # 1 where the tile allows it (2 are slower)
        state_fp32=True,  # bf16 states cost varlen dk 2.5e-2 against the fp32 reference, for 3% of forward + backward
    )


def scan_tile(V: int, pairs: int, storage: torch.dtype, stages: int, *, stores_states: bool) -> tuple[int, int]:
    """(V tile width, pipelining stages) of a scan over ``pairs`` (sequence, head) pairs that would take ``stages``:
    narrower V tiles where there are few pairs, so that every SM gets programs (on the H200 the scans that store
    per-chunk states ran fastest 64 wide from 256 pairs up, 32 from 64, else 16; the output scan keeps 64 down to 64
    pairs); fp32 buffers in 32-wide tiles of one stage (two overflow shared memory); bf16 tiles narrower than 64 at
    least two stages (``check_scan_launch``)."""
    BV = min(V, 64 if pairs >= (256 if stores_states else 64) else (32 if pairs >= 64 else 16))
    if storage == torch.float32:
        return min(BV, 32), 1
    return BV, (max(stages, 2) if BV < 64 else stages)


def check_scan_launch(bv: int, stages: int, storage: torch.dtype):
    """Unpipelined bf16 scans on tiles narrower than 64 are miscompiled by Triton 3.6 for the H200 (compute-sanitizer:
    invalid shared-memory reads in the state update; wrong gradients, NaN or an illegal address)."""
    if storage == torch.bfloat16 and bv < 64 and stages < 2:
        raise ValueError(
            f"a bf16 scan on {bv}-wide V tiles needs at least 2 pipeline stages (got {stages}): Triton 3.6 "
            "miscompiles it unpipelined; use scan_stages=2 or 64-wide tiles."
        )


@triton.jit
def _gated_slice(q, k, G, Gend, Qgb, Kdb, gam, rk, rq, pk, mk, o_k, slot, K: tl.constexpr):
    """Load one BK-wide slice of a chunk's q and k, store its ``Qg = qn e^G``, ``Kd = kn e^(G_end - G)`` and
    ``gamma = e^(G_end)`` (G: its decay, ``chunk_decay``), and return the raw k and q ([64, BK] fp32 each) and
    ``kn e^G``, the right operand of ``W = T diag(beta) (kn e^G)``. ``kn = k rk``, ``qn = q rq``: ``rk``, ``rq``
    are the rows' inverse norms ([64, 1]; rq times the scale), or 1 and the scale where the rows stay raw."""
    kt = tl.load(k + pk, mask=mk, other=0.0).to(tl.float32)
    qt = tl.load(q + pk, mask=mk, other=0.0).to(tl.float32)
    eG = tl.exp(G)
    kn = kt * rk
    tl.store(Kdb + pk, (kn * tl.exp(Gend[None, :] - G)).to(Kdb.dtype.element_ty), mask=mk)
    tl.store(Qgb + pk, (qt * rq * eG).to(Qgb.dtype.element_ty), mask=mk)
    tl.store(gam + slot * K + o_k, tl.exp(Gend))
    return kt, qt, kn * eG


@triton.jit
def _scores(q, k, g, dt_bias, a, lb, Wb, Qgb, Kdb, gam, rk, rq, bos, t0, L, slot, i_h, H: tl.constexpr,
            K: tl.constexpr, BK: tl.constexpr, BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    """Un-normalised gated scores of one chunk, ``kk_ij = sum_d k_id k_jd e^(G_id - G_jd)`` and the same for
    ``qk`` ([64, 64] fp32, meaningful on and below the diagonal), and the rows' sums of squares of k and q ([64]
    each). The same pass stores the slices' gated rows (``_gated_slice``, with row factors rk and rq), with
    ``kn e^G`` parked in ``Wb`` until T is known.

    Accumulated over K in BK-wide slices. Per row tile R the decay is split at a reference ``r_R``
    (``chunk_tiles.py``): row operand ``x_i e^(G_i - r_R)`` (rows of tile R only), column operand
    ``k_j e^(r_R - G_j)`` on the columns tile R may see, so each row tile is one M = 64 GEMM."""
    o_t = tl.arange(0, BT)
    tile = o_t // 16
    kk = tl.zeros((BT, BT), dtype=tl.float32)
    qk = tl.zeros((BT, BT), dtype=tl.float32)
    sk = tl.zeros((BT,), dtype=tl.float32)
    sq = tl.zeros((BT,), dtype=tl.float32)
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        pk, mk = chunk_offsets64(bos, t0, L, i_h, o_k, H, K)
        _, G = chunk_decay(g, dt_bias, a, lb, pk, mk, i_h, o_k, K, BOUNDED)
        c1, c2, c3, c4 = tile_ends(G)
        kt, qt, kg = _gated_slice(q, k, G, c4, Qgb, Kdb, gam, rk, rq, pk, mk, o_k, slot, K)
        tl.store(Wb + pk, kg.to(Wb.dtype.element_ty), mask=mk)
        sk += tl.sum(kt * kt, 1)
        sq += tl.sum(qt * qt, 1)
        r0, r1, r2, r3, f = tile_references(G, c1, c2, c3, c4, FAST_DIAG)  # f: each row's own-tile factor
        kf = kt * f
        qf = qt * f
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r0, 0, tile, FAST_DIAG, MMA)
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r1, 1, tile, FAST_DIAG, MMA)
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r2, 2, tile, FAST_DIAG, MMA)
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r3, 3, tile, FAST_DIAG, MMA)
    return kk, qk, sk, sq


@triton.jit
def _row_tile_scores(kk, qk, kf, qf, kt, G, r, R: tl.constexpr, tile, diag: tl.constexpr, MMA: tl.constexpr):
    """Add row tile R's scores: rows of tile R of (kf, qf) times the columns it may see, k_j e^(r - G_j)."""
    col = (kt * column_factor(G, r, R, diag)).to(MMA)
    own = (tile == R)[:, None]
    kk = tl.dot(tl.where(own, kf, 0.0).to(MMA), tl.trans(col), kk)
    qk = tl.dot(tl.where(own, qf, 0.0).to(MMA), tl.trans(col), qk)
    return kk, qk


@triton.jit
def _unit_lower_inverse64(Lm, INV_PREC: tl.constexpr):
    """``T = (I + Lm)^-1`` for strictly lower-triangular Lm [64, 64] by 16x16 blocks: ``T_RR = (I + L_RR)^-1``,
    ``T_RS = -T_RR sum_{S <= P < R} L_RP T_PS``."""
    l00, l10, l11, l20, l21, l22, l30, l31, l32, l33 = lower_blocks(Lm)
    t00 = unit_lower_inverse(l00, INV_PREC)
    t11 = unit_lower_inverse(l11, INV_PREC)
    t22 = unit_lower_inverse(l22, INV_PREC)
    t33 = unit_lower_inverse(l33, INV_PREC)
    t10 = -tl.dot(t11, tl.dot(l10, t00, input_precision=INV_PREC), input_precision=INV_PREC)
    t21 = -tl.dot(t22, tl.dot(l21, t11, input_precision=INV_PREC), input_precision=INV_PREC)
    t20 = -tl.dot(t22, tl.dot(l21, t10, tl.dot(l20, t00, input_precision=INV_PREC), input_precision=INV_PREC),
                  input_precision=INV_PREC)
    t32 = -tl.dot(t33, tl.dot(l32, t22, input_precision=INV_PREC), input_precision=INV_PREC)
    t31 = -tl.dot(t33, tl.dot(l32, t21, tl.dot(l31, t11, input_precision=INV_PREC), input_precision=INV_PREC),
                  input_precision=INV_PREC)
    acc = tl.dot(l31, t10, tl.dot(l30, t00, input_precision=INV_PREC), input_precision=INV_PREC)
    t30 = -tl.dot(t33, tl.dot(l32, t20, acc, input_precision=INV_PREC), input_precision=INV_PREC)
    return lower_block_matrix(t00, t10, t11, t20, t21, t22, t30, t31, t32, t33)


@triton.jit
def _chunk_kernel(q, k, v, g, beta, A_log, dt_bias, Wb, Ub, Qgb, Kdb, Aqb, Tb, Nb, gam, Db, cu_seqlens, chunk_indices,
                  steep, T, scale, lb, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr, CHUNKS: tl.constexpr,
                  FAST_DIAG: tl.constexpr, MMA: tl.constexpr, INV_PREC: tl.constexpr, STORE_T: tl.constexpr,
                  LOAD_T: tl.constexpr, STORE_NORMS: tl.constexpr, FORM_WU: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if takes_chunk(ok, steep, i_p * H + i_h, CHUNKS):  # the chunks of this launch (steep_chunks.py)
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        slot = (i_p * H + i_h).to(tl.int64)
        o_c = tl.arange(0, BT)
        m_r = t0 + o_c < L
        tok = ((bos + t0 + o_c) * H + i_h).to(tl.int64)
        b = tl.sigmoid(tl.load(beta + tok, mask=m_r, other=0.0).to(tl.float32))
        p64, m64 = chunk_offsets64(bos, t0, L, i_h, o_c, H, BT)
        if LOAD_T:  # the backward's recompute: T, A_qk and the rows' norms come from the forward
            rk, rq = load_row_norms(Nb, tok, m_r)
            Tm = tl.load(Tb + p64, mask=m64, other=0.0).to(tl.float32)
        else:
            if FORM_WU:  # W and U take the gated rows normalised, so the norms come first
                rk, rq = inverse_row_norms(q, k, bos, t0, L, i_h, H, K, BK)
                kk, qk, _, _ = _scores(q, k, g, dt_bias, a, lb, Wb, Qgb, Kdb, gam, rk[:, None], rq[:, None] * scale,
                                       bos, t0, L, slot, i_h, H, K, BK, BOUNDED, FAST_DIAG, MMA)
            else:  # the rows stay raw (the scan applies their norms), so the same pass sums their squares
                kk, qk, sk, sq = _scores(q, k, g, dt_bias, a, lb, Wb, Qgb, Kdb, gam, 1.0, scale, bos, t0, L, slot,
                                         i_h, H, K, BK, BOUNDED, FAST_DIAG, MMA)
                rk = inverse_norm(sk)
                rq = inverse_norm(sq)
            if not FAST_DIAG:  # a steep chunk: its tiles' own blocks come from diagonal_blocks.py
                kk += diagonal_block(Db, tok, m_r, 0)
                qk += diagonal_block(Db, tok, m_r, 1)
            # A_qk = diag(rq) qk diag(rk) * scale, causal
            Aq = tl.where(o_c[None, :] <= o_c[:, None], qk * (rq * scale)[:, None] * rk[None, :], 0.0)
            tl.store(Aqb + p64, Aq.to(Aqb.dtype.element_ty), mask=m64)
            Lm = tl.where(o_c[None, :] < o_c[:, None], kk * (b * rk)[:, None] * rk[None, :], 0.0)
            Tm = _unit_lower_inverse64(Lm, INV_PREC)
            if STORE_T:
                tl.store(Tb + p64, Tm.to(Tb.dtype.element_ty), mask=m64)
            if STORE_NORMS:  # for the backward, or the scan of raw rows (chunk_tiles.load_row_norms)
                tl.store(Nb + 2 * tok, rk, mask=m_r)
                tl.store(Nb + 2 * tok + 1, rq, mask=m_r)
            if FORM_WU:
                tl.debug_barrier()  # the scores pass's kn e^G in Wb, written by other threads, is read back below
        if FORM_WU:
            _form_wu(q, k, v, g, dt_bias, a, lb, Wb, Ub, Qgb, Kdb, gam, Tm, b, rk, rq * scale, bos, t0, L, slot, i_h,
                     H, K, V, BK, BV, BOUNDED, MMA, LOAD_T)


@triton.jit
def _form_wu(q, k, v, g, dt_bias, a, lb, Wb, Ub, Qgb, Kdb, gam, Tm, b, rk, rq, bos, t0, L, slot, i_h, H: tl.constexpr,
             K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BOUNDED: tl.constexpr,
             MMA: tl.constexpr, LOAD_T: tl.constexpr):
    """Overwrite Wb's ``kn e^G`` with ``W = T diag(beta) (kn e^G)`` and store ``U = T diag(beta) v``. With LOAD_T
    (the backward's recompute, T loaded) the gated rows are formed here instead of in the scores pass."""
    Aw = (Tm * b[None, :]).to(MMA)  # T diag(beta)
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        pk, mk = chunk_offsets64(bos, t0, L, i_h, o_k, H, K)
        if LOAD_T:
            _, G = chunk_decay(g, dt_bias, a, lb, pk, mk, i_h, o_k, K, BOUNDED)
            _, _, kg = _gated_slice(q, k, G, chunk_end(G), Qgb, Kdb, gam, rk[:, None], rq[:, None], pk, mk, o_k,
                                    slot, K)
        else:
            kg = tl.load(Wb + pk, mask=mk, other=0.0)
        tl.store(Wb + pk, tl.dot(Aw, kg.to(MMA)).to(Wb.dtype.element_ty), mask=mk)
    for vb in range(0, V, BV):
        pv, mv = chunk_offsets64(bos, t0, L, i_h, vb + tl.arange(0, BV), H, V)
        u = tl.dot(Aw, tl.load(v + pv, mask=mv, other=0.0).to(MMA))
        tl.store(Ub + pv, u.to(Ub.dtype.element_ty), mask=mv)


@triton.jit
def _scan_kernel(Wb, Ub, Tb, beta, Nb, Qgb, Kdb, Aqb, gam, o, h0, ht, hbuf, dbuf, cu_seqlens, chunk_offsets, T,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                 STORE_H: tl.constexpr, STORE_D: tl.constexpr, WRITE_O: tl.constexpr, FORM_WU: tl.constexpr,
                 MMA: tl.constexpr):
    i_h, bos, L, c_off, o_k, o_v, ps, S = scan_start(h0, cu_seqlens, chunk_offsets, T, H, K, V, BV, IS_VARLEN, HAS_H0)
    o_c = tl.arange(0, BT)
    for i_c in range(tl.cdiv(L, BT)):
        slot = (c_off + i_c).to(tl.int64)
        if STORE_H:
            tl.store(hbuf + ((slot * H + i_h) * K + o_k)[:, None] * V + o_v[None, :], S.to(hbuf.dtype.element_ty))
        o_t = i_c * BT + o_c
        m_t = (o_t < L)[:, None]
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        pk = tok[:, None] * K + o_k[None, :]
        pv = tok[:, None] * V + o_v[None, :]
        bw = tl.load(Wb + pk, mask=m_t, other=0.0).to(MMA)
        bkd = tl.load(Kdb + pk, mask=m_t, other=0.0).to(MMA)
        Sm = S.to(MMA)
        if FORM_WU:  # Wb: W, Ub: U; the gated rows are normalised
            rk = tl.full((BT,), 1.0, tl.float32)
            rq = rk
            delta = tl.load(Ub + pv, mask=m_t, other=0.0).to(tl.float32) - tl.dot(bw, Sm)
        else:  # Wb: k e^G, Ub: v; raw rows with inverse norms rk, rq: delta = T diag(beta) (v - diag(rk) k e^G S)
            rk, rq = load_row_norms(Nb, tok, o_t < L)
            bb = tl.sigmoid(tl.load(beta + tok, mask=o_t < L, other=0.0).to(tl.float32))
            aw = (tl.load(Tb + tok[:, None] * BT + o_c[None, :], mask=m_t, other=0.0).to(tl.float32) * bb[None, :])
            x = tl.load(Ub + pv, mask=m_t, other=0.0).to(tl.float32) - tl.dot(bw, Sm) * rk[:, None]
            delta = tl.dot(aw.to(MMA), x.to(MMA))
        dm = delta.to(MMA)
        if STORE_D:
            tl.store(dbuf + pv, dm.to(dbuf.dtype.element_ty), mask=m_t)
        if WRITE_O:
            bqg = tl.load(Qgb + pk, mask=m_t, other=0.0).to(MMA)
            baq = tl.load(Aqb + tok[:, None] * BT + o_c[None, :], mask=m_t, other=0.0).to(MMA)
            tl.store(o + pv, tl.dot(baq, dm, tl.dot(bqg, Sm) * rq[:, None]).to(o.dtype.element_ty), mask=m_t)
        gm = tl.load(gam + (slot * H + i_h) * K + o_k)
        S = tl.dot(tl.trans(bkd), (delta * rk[:, None]).to(MMA), S * gm[:, None])
    if STORE_HT:
        tl.store(ht + ps, S)


def mm_dtype(dtype: torch.dtype):
    """Tensor-core operand dtype for inputs of ``dtype``: bf16 for bf16, fp32 (tf32 on GPU) for fp16 / fp32."""
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float32


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the chunk buffers for inputs of ``dtype``: bf16 for bf16, else fp32."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def prepare_varlen(cu_seqlens: torch.Tensor, T: int):
    """Device-side chunk bookkeeping (no host sync, fixed sizes, so it can be captured/compiled).

    Returns chunk_indices [NS, 2] int32 (sequence, chunk) per slot, -1 for unused slots,
    chunk_offsets [N] int32 (first slot of each sequence) and NS = cdiv(T, 64) + N."""
    N = cu_seqlens.numel() - 1
    NS = triton.cdiv(T, BT.value) + N
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    nch = (lens + BT.value - 1) // BT.value
    ends = torch.cumsum(nch, 0)
    offs = ends - nch
    p = torch.arange(NS, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, p, right=True)
    ok = seq < N
    seqc = seq.clamp(max=max(N - 1, 0))
    chunk = p - offs[seqc]
    idx = torch.stack([torch.where(ok, seqc, -1), torch.where(ok, chunk, 0)], 1).to(torch.int32).contiguous()
    return idx, offs.to(torch.int32).contiguous(), NS


@dataclass(frozen=True)
class KdaCall:
    """One call of the chunked kernels: its inputs as they take them and where its chunks lie.

    q, k, g: [B, T, H, K] (g the raw gate logits); v: [B, T, H, V]; beta: [B, T, H] logits; A_log [H] and dt_bias
    [H*K] fp32; cu_seqlens [N+1] offsets of N packed sequences (B == 1) or None. ``NS`` chunk slots in all; with
    cu_seqlens, ``chunk_indices`` and ``chunk_offsets`` from ``prepare_varlen``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    gate_lower_bound: float | None
    scale: float
    cu_seqlens: torch.Tensor | None
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    NS: int
    N: int

    @property
    def pairs(self) -> int:
        """(sequence, head) pairs: the scans run one program per pair and V tile."""
        return self.N * self.q.shape[2]

    @property
    def lb(self) -> float:
        """The gate bound as the kernels take it (0.0, unused, for the softplus gate)."""
        return 0.0 if self.gate_lower_bound is None else float(self.gate_lower_bound)

    @cached_property
    def steep(self) -> torch.Tensor:
        """[NS, H] int8: the chunks with a tile that one reference cannot factor (``steep_chunk_flags``), found once
        per call, so that a backward's recompute and its gate-gradient kernel share them."""
        return steep_chunk_flags(self)


def kda_call(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, cu_seqlens) -> KdaCall:
    B, T = q.shape[:2]
    if cu_seqlens is None:
        return KdaCall(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, None, None, None,
                       NS=B * triton.cdiv(T, BT.value), N=B)
    chunk_indices, chunk_offsets, NS = prepare_varlen(cu_seqlens, T)
    return KdaCall(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, cu_seqlens, chunk_indices,
                   chunk_offsets, NS=NS, N=cu_seqlens.numel() - 1)


@dataclass
class ChunkBuffers:
    """What the chunk kernel writes, in the storage dtype unless said: ``W`` [B, T, H, K] (``T diag(beta) (kn e^G)``,
    or ``k e^G`` where the scan forms delta, ``form_wu``), ``U`` [B, T, H, V] (``T diag(beta) v``, or v itself),
    ``Qg``, ``Kd`` [B, T, H, K], ``Aqk`` and the WY matrix ``T`` [B, T, H, 64], the rows' inverse norms ``norms``
    [B, T, H, 2] fp32 (1 / ||k||, 1 / ||q||; these two None where neither a backward nor the scan reads them) and
    ``gam`` [NS, H, K] fp32. The backward drops each buffer (sets it to None) once its last kernel has run."""

    W: torch.Tensor | None
    U: torch.Tensor | None
    Qg: torch.Tensor | None
    Kd: torch.Tensor | None
    Aqk: torch.Tensor | None
    T: torch.Tensor | None
    norms: torch.Tensor | None
    gam: torch.Tensor | None
    form_wu: bool


def launch_chunk_kernel(call: KdaCall, launch: ForwardLaunch, *, store_scores: bool,
                        scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> ChunkBuffers:
    """The chunk kernel over every chunk and head. ``store_scores``: also write T and the norms for a backward;
    ``scores``: the forward's kept ``(A_qk, T, norms)``, loaded instead of recomputing the gated scores, the inverse
    and the norms (most of the kernel's work)."""
    q, k, v = call.q, call.k, call.v
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    sd = storage_dtype(v.dtype)
    W = torch.empty(B, T, H, K, device=dev, dtype=sd)
    Qg = torch.empty_like(W)
    Kd = torch.empty_like(W)
    U = torch.empty(B, T, H, V, device=dev, dtype=sd) if launch.form_wu else v  # else the scan reads v itself
    if scores is not None:
        Aqk, Tm, norms = scores
    else:
        Aqk = torch.empty(B, T, H, BT.value, device=dev, dtype=sd)
        kept = store_scores or not launch.form_wu  # T and the norms: for the backward or for the scan
        Tm = torch.empty_like(Aqk) if kept else None
        norms = torch.empty(B, T, H, 2, device=dev, dtype=torch.float32) if kept else None
    gam = torch.empty(call.NS, H, K, device=dev, dtype=torch.float32)
    # loading the scores skips the scores pass, the only part that a steep gate changes
    launches = [(EVERY_CHUNK.value, fast_diag(call.gate_lower_bound), None)] if scores is not None else \
        chunk_launches(call)
    D = diagonal_scores(call) if len(launches) > 1 else None  # the steep chunks' diagonal blocks
    for chunks, gemm_only, steep in launches:
        _chunk_kernel[(call.NS, H)](
            q, k, v, call.g, call.beta, call.A_log, call.dt_bias, W, U, Qg, Kd, Aqk, Tm, norms, gam, D, call.cu_seqlens,
            call.chunk_indices, steep, T, call.scale, call.lb, H=H, K=K, V=V, BK=min(K, launch.chunk_bk),
            BV=min(V, launch.chunk_bk), IS_VARLEN=call.cu_seqlens is not None,
            BOUNDED=call.gate_lower_bound is not None, CHUNKS=chunks, FAST_DIAG=gemm_only, MMA=mm_dtype(v.dtype),
            INV_PREC=launch.inv_prec, STORE_T=Tm is not None and scores is None, LOAD_T=scores is not None,
            STORE_NORMS=norms is not None and scores is None, FORM_WU=launch.form_wu, num_warps=launch.chunk_warps,
            num_stages=launch.chunk_stages, maxnreg=launch.chunk_maxnreg)
    return ChunkBuffers(W, U, Qg, Kd, Aqk, Tm, norms, gam, launch.form_wu)


def _launch_scan(call, bufs, launch, initial_state, o, ht, hbuf, dbuf):
    """``_scan_kernel`` over every (sequence, head) pair and V tile; it writes whichever of o, ht (the output
    forward) and hbuf, dbuf (the backward's recompute) are given."""
    T, H, K = call.q.shape[1:]
    V = call.v.shape[-1]
    check_scan_launch(launch.scan_bv, launch.scan_stages, bufs.W.dtype)
    _scan_kernel[(triton.cdiv(V, launch.scan_bv), call.pairs)](
        bufs.W, bufs.U, bufs.T, call.beta, bufs.norms, bufs.Qg, bufs.Kd, bufs.Aqk, bufs.gam,
        o if o is not None else bufs.U, initial_state, ht, hbuf, dbuf, call.cu_seqlens, call.chunk_offsets, T,
        H=H, K=K, V=V, BV=launch.scan_bv, IS_VARLEN=call.cu_seqlens is not None, HAS_H0=initial_state is not None,
        STORE_HT=ht is not None, STORE_H=hbuf is not None, STORE_D=dbuf is not None, WRITE_O=o is not None,
        FORM_WU=bufs.form_wu, MMA=mm_dtype(call.v.dtype), num_warps=launch.scan_warps, num_stages=launch.scan_stages)


def launch_output_scan(call: KdaCall, bufs: ChunkBuffers, launch: ForwardLaunch, initial_state: torch.Tensor | None,
                       output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward's scan: ``(o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None)``."""
    B, T, H, K = call.q.shape
    V = call.v.shape[-1]
    o = torch.empty(B, T, H, V, device=call.v.device, dtype=call.v.dtype)
    ht = torch.empty(call.N, H, K, V, device=o.device, dtype=torch.float32) if output_final_state else None
    _launch_scan(call, bufs, launch, initial_state, o, ht, None, None)
    return o, ht


def chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, output_final_state,
                  cu_seqlens, *, keep_scores: bool = False, launch: ForwardLaunch | None = None):
    """The chunked forward. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (raw logits).

    Returns (o [B, T, H, V] in v.dtype, final_state [N, H, K, V] fp32 or None, scores): with ``keep_scores``, scores
    are the chunk matrices and the rows' inverse norms ``(A_qk, T, norms)`` ([B, T, H, 64] in the storage dtype,
    [B, T, H, 2] fp32) for the backward, else None. ``launch``: ``forward_launch``'s for this call unless given."""
    call = kda_call(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, cu_seqlens)
    launch = launch or forward_launch(q.shape[-1], v.shape[-1], call.pairs, v.dtype)
    bufs = launch_chunk_kernel(call, launch, store_scores=keep_scores)
    o, ht = launch_output_scan(call, bufs, launch, initial_state, output_final_state)
    return o, ht, ((bufs.Aqk, bufs.T, bufs.norms) if keep_scores else None)


def recompute_for_backward(call: KdaCall, launch: ForwardLaunch, initial_state: torch.Tensor | None,
                           scores: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """The backward's first stage: ``(bufs, h, delta)``, the chunk buffers the backward reads (U dropped; T, A_qk
    and the norms loaded from the forward's ``scores`` where it kept them), the state at every chunk start ``h``
    [NS, H, K, V] (fp32 with ``launch.state_fp32``, else the storage dtype) and ``delta = U - W h`` [B, T, H, V]
    (storage dtype)."""
    if not launch.form_wu:
        raise ValueError("the backward reads W and U: its recompute needs a launch with form_wu=True.")
    bufs = launch_chunk_kernel(call, launch, store_scores=True, scores=scores)
    B, T, H, K = call.q.shape
    sd = storage_dtype(call.v.dtype)
    h = torch.empty(call.NS, H, K, call.v.shape[-1], device=call.q.device,
                    dtype=torch.float32 if launch.state_fp32 else sd)
    delta = torch.empty_like(bufs.U)
    _launch_scan(call, bufs, launch, initial_state, None, None, h, delta)
    bufs.U = None  # delta replaces it
    return bufs, h, delta
