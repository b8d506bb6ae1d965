"""Chunked KDA forward: a chunk-parallel kernel, then one scan over the chunks.

``_chunk_kernel`` (one program per 64-token chunk and head) fuses the gate activation, the decay
cumsum ``G``, the q/k L2 norms, q's scale and beta's sigmoid. It builds ``A_kk`` (strictly causal) and
``A_qk`` (causal) over K in BK-wide slices, one M = 64 GEMM per 16-row tile (the decay factoring is in
``chunk_tiles.py``), inverts ``I + diag(beta) A_kk`` by 16x16 blocks, and writes, in the storage dtype
(bf16 for bf16 inputs, else fp32; the gated rows are stored by the scores pass itself, so q, k and g are read once,
plus a norm pass over q and k where the rows are stored normalised):

* ``W = T diag(beta) (k * exp(G))`` and ``U = T diag(beta) v`` with ``T = (I + diag(beta) A_kk)^-1``, or
  ``k * exp(G)`` and ``T`` for the scan to apply (``forms_wu``; the gated rows then stay raw and the rows' inverse
  norms, summed in the scores pass, go to the scan),
* ``Qg = q * exp(G)``, ``Kd = k * exp(G_end - G)``, ``A_qk``, and ``gamma = exp(G_end)`` (fp32),
* for the backward, ``T`` itself. The backward's recompute (``LOAD_T``) loads the forward's ``T`` and ``A_qk``
  instead of redoing the gated scores and the inverse.

``_scan_kernel`` (one program per sequence, head and V tile) walks the chunks in order with the fp32
state ``S [K, BV]`` in registers: ``delta = U - W S`` (or ``T diag(beta) (v - k e^G S)``), ``o = Qg S + A_qk delta``,
``S <- gamma * S + Kd^T delta`` (k and q normalised: raw rows take their norms here). For the backward it stores
``S`` per chunk (fp32 by default) and ``delta``.
"""

import torch

from ..backend import tl, triton
from .chunk_tiles import (BT, chunk_coords, chunk_decay, chunk_end, chunk_offsets64, column_factor, diagonal_scores,
                          fast_diag, inverse_norm, inverse_row_norms, load_row_norms, lower_block_matrix, lower_blocks,
                          scan_start, tile_ends, tile_references, unit_lower_inverse)

# Launch knobs, measured on an H200 (bf16, 16x4096x16 unless said; how and when: benchmarks/PERFORMANCE.md).
# chunk_warps, chunk_bk: 4 warps over 32-wide K slices (16-wide: forward 4.36 against 3.70 ms; 64-wide: 3.29 against
#   3.17 ms; 8 warps at 128 registers: 4.70 against 3.17 ms).
# chunk_maxnreg 168: three chunk-kernel programs per SM instead of two, a few registers spilling (forward 3.96 against
#   4.12 ms uncapped; capped at 128: 4.72 against 3.23 ms). recompute_maxnreg 128: the backward's recompute (T, A_qk
#   and the norms loaded) fits it without spilling, four programs per SM (forward + backward 15.10 -> 15.00 ms).
# chunk_stages 4: the K loops software-pipelined (bounded forward 3.15 / 3.06 / 3.00 ms at 2 / 3 / 4 stages);
#   safe_chunk_stages 2 where the diagonal blocks may take the safe path, which deeper pipelining slows (softplus
#   forward 6.63 ms at 2 stages, 7.19 at 3, 6.94 at 4).
# scan_warps, scan_bv, scan_stages: the output scan's warps, V tile (None: ``scan_launch`` picks) and pipelining
#   (8 warps or 32-wide tiles: 4.05 against 3.23 ms; 2 stages: 3.30 against 3.17 ms).
# inv_prec "ieee": the 16x16 inverse's products in fp32; tf32 there gains nothing (chunk kernel 2.06 ms either way).
# state_fp32: the per-chunk states the backward reads stay fp32 for bf16 inputs; in bf16, varlen dk was off by 2.5e-2
#   against the fp32 reference (large initial states). It costs 0.7 of 24.3 ms forward + backward.
# factored_min_pairs 64: from this many (sequence, head) pairs up the output forward leaves W and U to its scan
#   (``forms_wu``): forward 3.62 -> 3.24 ms at 256 pairs, 11.59 -> 10.67 ms at 1x32768x96, but 5.31 -> 5.45 ms at
#   1x65536x16, 16 pairs whose scans are the critical path (5.31 -> 5.35 ms still, after the scan took the raw rows).
# stop_after "chunk": the forward ends after the chunk kernel (per-stage timing only).
CONFIG = dict(chunk_warps=4, chunk_bk=32, chunk_stages=4, safe_chunk_stages=2, chunk_maxnreg=168,
              recompute_maxnreg=128, scan_warps=4, scan_bv=None, scan_stages=1, inv_prec="ieee", state_fp32=True,
              factored_min_pairs=64, stop_after=None)


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
    o_t = tl.arange(0, 64)
    tile = o_t // 16
    kk = tl.zeros((64, 64), dtype=tl.float32)
    qk = tl.zeros((64, 64), dtype=tl.float32)
    sk = tl.zeros((64,), dtype=tl.float32)
    sq = tl.zeros((64,), dtype=tl.float32)
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        pk, mk = chunk_offsets64(bos, t0, L, i_h, o_k, H, K)
        _, G = chunk_decay(g, dt_bias, a, lb, pk, mk, i_h, o_k, K, BOUNDED)
        c1, c2, c3, c4 = tile_ends(G)
        kt, qt, kg = _gated_slice(q, k, G, c4, Qgb, Kdb, gam, rk, rq, pk, mk, o_k, slot, K)
        tl.store(Wb + pk, kg.to(Wb.dtype.element_ty), mask=mk)
        sk += tl.sum(kt * kt, 1)
        sq += tl.sum(qt * qt, 1)
        diag, r0, r1, r2, r3, f = tile_references(G, c1, c2, c3, c4, FAST_DIAG)  # f: each row's own-tile factor
        kf = kt * f
        qf = qt * f
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r0, 0, tile, diag, MMA)
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r1, 1, tile, diag, MMA)
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r2, 2, tile, diag, MMA)
        kk, qk = _row_tile_scores(kk, qk, kf, qf, kt, G, r3, 3, tile, diag, MMA)
        if not diag:
            kk, qk = diagonal_scores(kk, qk, kt, qt, G, MMA)
    return kk, qk, sk, sq


@triton.jit
def _row_tile_scores(kk, qk, kf, qf, kt, G, r, R: tl.constexpr, tile, diag, MMA: tl.constexpr):
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
def _chunk_kernel(q, k, v, g, beta, A_log, dt_bias, Wb, Ub, Qgb, Kdb, Aqb, Tb, Nb, gam, cu_seqlens, chunk_indices,
                  T, scale, lb, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr,
                  MMA: tl.constexpr, INV_PREC: tl.constexpr, STORE_T: tl.constexpr, LOAD_T: tl.constexpr,
                  STORE_NORMS: tl.constexpr, FORM_WU: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
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


def mm_dtype(x: torch.Tensor):
    """Tensor-core operand dtype: bf16 for bf16 inputs, fp32 (tf32 on GPU) for fp16 / fp32."""
    return tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32


def storage_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def scan_launch(V: int, NH: int, storage: torch.dtype, bv: int | None, stages: int, stores_states: bool = True):
    """(BV, num_stages) of a scan over NH (sequence, head) pairs: narrower V tiles when there are few pairs, so
    that every SM gets a scan, and one pipeline stage for fp32 buffers (two overflow shared memory). The forward's
    output scan (no per-chunk states stored) keeps 64-wide tiles down to 64 pairs; forward only on the H200 (stop 15):
    4x16384x16 4.25 -> 4.03 ms, 1x32768x96 12.71 -> 11.55 ms; 16 pairs stay fastest on 16-wide tiles (5.32 ms, 5.49
    on 32) and 256 pairs on 64-wide ones (3.64 ms, 3.73 on 128).

    bf16 scans on tiles narrower than 64 always take two stages: unpipelined, Triton 3.6 miscompiles them on the
    H200 (16-wide tiles: compute-sanitizer reports invalid shared-memory reads in the state update; wrong
    gradients, NaN, or an illegal address). Checked there: two stages at 16 (both scans) and at 32 (the backward
    scan), one at 64."""
    BV = min(V, bv or (64 if NH >= (256 if stores_states else 64) else (32 if NH >= 64 else 16)))
    if storage == torch.float32:
        return min(BV, 32), 1
    return BV, (max(stages, 2) if BV < 64 else stages)


def forms_wu(NH: int, for_backward: bool) -> bool:
    """Whether the chunk kernel forms ``W`` and ``U`` for a forward over NH (sequence, head) pairs. The backward
    reads them, so its recompute always does. The output forward can instead leave ``delta = T diag(beta)
    (v - kn e^G S)`` to the scan, which then reads T, beta, ``k e^G``, v and the rows' norms: the chunk kernel skips
    two passes over K and V (in bf16 a 2-byte read and write per channel of each) and its norm pass over q and k (it
    stores the gated rows raw), the scan's step gains a dependent product.
    That pays when many scans share the GPU, not when a few are its critical path (``CONFIG["factored_min_pairs"]``).
    """
    return for_backward or NH < CONFIG["factored_min_pairs"]


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


def chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, output_final_state,
                  cu_seqlens, *, keep_scores=False, scores=None, for_backward=False):
    """Launch the forward. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (raw logits).

    Returns (o [B, T, H, V] in v.dtype, final_state fp32 or None, scores). ``keep_scores``: scores are the chunk
    matrices and the rows' inverse norms ``(A_qk, T, norms)`` ([B, T, H, 64] in the storage dtype, [B, T, H, 2] fp32)
    for the backward, else None. With ``for_backward`` it skips o and returns the buffers the backward needs instead,
    as a dict: T, Aqk [B, T, H, 64]; W, Qg, Kd [B, T, H, K]; norms [B, T, H, 2] fp32 (1 / ||k||, 1 / ||q|| per token);
    gam [NS, H, K] fp32; h [NS, H, K, V] (state at each chunk start; fp32 with ``state_fp32``) and delta
    [B, T, H, V] (storage dtype), plus the varlen bookkeeping chunk_indices, chunk_offsets, NS, N. Given the
    forward's ``scores`` it loads them instead of recomputing the gated scores, the inverse and the norms (most of
    the chunk kernel's work)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets, NS = prepare_varlen(cu_seqlens, T)
        N = cu_seqlens.numel() - 1
    else:
        chunk_indices = chunk_offsets = None
        NS = B * triton.cdiv(T, BT.value)
        N = B
    sd = storage_dtype(v)
    MMA = mm_dtype(v)
    W = torch.empty(B, T, H, K, device=dev, dtype=sd)
    Qg = torch.empty_like(W)
    Kd = torch.empty_like(W)
    form_wu = forms_wu(N * H, for_backward)
    U = torch.empty(B, T, H, V, device=dev, dtype=sd) if form_wu else v  # else the scan reads v itself
    if scores is not None:
        Aqk, Tm, norms = scores
    else:
        Aqk = torch.empty(B, T, H, BT.value, device=dev, dtype=sd)
        kept = keep_scores or for_backward or not form_wu  # T and the norms: for the backward or for the scan
        Tm = torch.empty_like(Aqk) if kept else None
        norms = torch.empty(B, T, H, 2, device=dev, dtype=torch.float32) if kept else None
    gam = torch.empty(NS, H, K, device=dev, dtype=torch.float32)
    BOUNDED = gate_lower_bound is not None
    lb = float(gate_lower_bound) if BOUNDED else 0.0
    FAST_DIAG = fast_diag(gate_lower_bound)
    _chunk_kernel[(NS, H)](
        q, k, v, g, beta, A_log, dt_bias, W, U, Qg, Kd, Aqk, Tm, norms, gam, cu_seqlens, chunk_indices, T, scale, lb,
        H=H, K=K, V=V, BK=min(K, CONFIG["chunk_bk"]), BV=min(V, CONFIG["chunk_bk"]), IS_VARLEN=cu_seqlens is not None,
        BOUNDED=BOUNDED, FAST_DIAG=FAST_DIAG, MMA=MMA, INV_PREC=CONFIG["inv_prec"],
        STORE_T=Tm is not None and scores is None, LOAD_T=scores is not None,
        STORE_NORMS=norms is not None and scores is None, FORM_WU=form_wu,
        num_warps=CONFIG["chunk_warps"],
        num_stages=CONFIG["chunk_stages" if FAST_DIAG else "safe_chunk_stages"],
        maxnreg=CONFIG["recompute_maxnreg" if scores is not None else "chunk_maxnreg"])
    if CONFIG["stop_after"] == "chunk":
        return None, None, None
    o = None if for_backward else torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    state_dtype = torch.float32 if CONFIG["state_fp32"] else sd
    hbuf = torch.empty(NS, H, K, V, device=dev, dtype=state_dtype) if for_backward else None
    dbuf = torch.empty_like(U) if for_backward else None
    BVs, stages = scan_launch(V, N * H, sd, CONFIG["scan_bv"], CONFIG["scan_stages"], stores_states=for_backward)
    _scan_kernel[(triton.cdiv(V, BVs), N * H)](
        W, U, Tm, beta, norms, Qg, Kd, Aqk, gam, o if o is not None else U, initial_state, ht, hbuf, dbuf, cu_seqlens,
        chunk_offsets, T, H=H, K=K, V=V, BV=BVs, IS_VARLEN=cu_seqlens is not None, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, STORE_H=for_backward, STORE_D=for_backward, WRITE_O=not for_backward,
        FORM_WU=form_wu, MMA=MMA, num_warps=CONFIG["scan_warps"], num_stages=stages)
    if for_backward:
        return dict(T=Tm, Aqk=Aqk, W=W, Qg=Qg, Kd=Kd, gam=gam, norms=norms, h=hbuf, delta=dbuf, ht=ht,
                    chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, NS=NS, N=N)
    return o, ht, ((Aqk, Tm, norms) if keep_scores else None)
