"""Chunked KDA forward: a chunk-parallel kernel, then one scan over the chunks.

``_chunk_kernel`` (one program per 64-token chunk and head) fuses the gate activation, the decay
cumsum ``G``, the q/k L2 norms, q's scale and beta's sigmoid. Working on 16x16 blocks (see
``chunk_tiles.py``) it builds ``A_kk`` (strictly causal) and ``A_qk`` (causal) over K in BK-wide
slices, inverts ``I + diag(beta) A_kk`` block by block, and writes, in the storage dtype (bf16 for
bf16 inputs, else fp32):

* ``W = T diag(beta) (k * exp(G))`` and ``U = T diag(beta) v`` with ``T = (I + diag(beta) A_kk)^-1``,
* ``Qg = q * exp(G)``, ``Kd = k * exp(G_end - G)``, ``A_qk``, and ``gamma = exp(G_end)`` (fp32),
* for the backward only, ``T`` itself.

``_scan_kernel`` (one program per sequence, head and V tile) walks the chunks in order with the fp32
state ``S [K, BV]`` in registers: ``delta = U - W S``, ``o = Qg S + A_qk delta``,
``S <- gamma * S + Kd^T delta``. For the backward it stores ``S`` per chunk and ``delta``.
"""

import torch
import triton
import triton.language as tl

from .chunk_tiles import (BT, causal_mask, chunk_coords, decay_tiles, diag_scores, fast_diag, load_rows,
                          load_tile, pair_scores, seq_coords, store_tile, unit_lower_inverse)

# Launch knobs (benchmarks/kda.py times the alternatives). stop_after="chunk" ends the forward after the
# chunk kernel (per-stage timing only).
CONFIG = dict(chunk_warps=4, chunk_bk=32, scan_warps=4, scan_bv=None, scan_stages=2, inv_prec="ieee",
              stop_after=None)


@triton.jit
def _scores(q, k, g, dt_bias, a, lb, bos, t0, L, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
            BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    """Un-normalised gated scores of one chunk as [16, 16] blocks kk_RS (k.k) and qk_RS (q.k), S <= R,
    and the squared row norms of k and q per tile. Accumulated over K in BK-wide slices."""
    z = tl.zeros((16, 16), dtype=tl.float32)
    kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33 = z, z, z, z, z, z, z, z, z, z
    qk00, qk10, qk11, qk20, qk21, qk22, qk30, qk31, qk32, qk33 = z, z, z, z, z, z, z, z, z, z
    s = tl.zeros((16,), dtype=tl.float32)
    sk0, sk1, sk2, sk3, sq0, sq1, sq2, sq3 = s, s, s, s, s, s, s, s
    for kb in range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        G0, G1, G2, G3, c1, c2, c3, c4 = decay_tiles(g, dt_bias, a, lb, bos, t0, L, i_h, o_k, H, K, BOUNDED)
        k0 = load_tile(k, bos, t0, L, i_h, 0, o_k, H, K)
        k1 = load_tile(k, bos, t0, L, i_h, 1, o_k, H, K)
        k2 = load_tile(k, bos, t0, L, i_h, 2, o_k, H, K)
        k3 = load_tile(k, bos, t0, L, i_h, 3, o_k, H, K)
        q0 = load_tile(q, bos, t0, L, i_h, 0, o_k, H, K)
        q1 = load_tile(q, bos, t0, L, i_h, 1, o_k, H, K)
        q2 = load_tile(q, bos, t0, L, i_h, 2, o_k, H, K)
        q3 = load_tile(q, bos, t0, L, i_h, 3, o_k, H, K)
        sk0 += tl.sum(k0 * k0, 1)
        sk1 += tl.sum(k1 * k1, 1)
        sk2 += tl.sum(k2 * k2, 1)
        sk3 += tl.sum(k3 * k3, 1)
        sq0 += tl.sum(q0 * q0, 1)
        sq1 += tl.sum(q1 * q1, 1)
        sq2 += tl.sum(q2 * q2, 1)
        sq3 += tl.sum(q3 * q3, 1)
        # off-diagonal blocks: column tile S carried to the end of its tile, then to row tile R's start
        e0 = k0 * tl.exp(c1[None, :] - G0)
        e1 = k1 * tl.exp(c2[None, :] - G1)
        e2 = k2 * tl.exp(c3[None, :] - G2)
        f = tl.exp(G1 - c1[None, :])
        kk10, qk10 = pair_scores(kk10, qk10, k1 * f, q1 * f, e0, MMA)
        f = tl.exp(G2 - c2[None, :])
        kk20, qk20 = pair_scores(kk20, qk20, k2 * f, q2 * f, e0 * tl.exp(c2 - c1)[None, :], MMA)
        kk21, qk21 = pair_scores(kk21, qk21, k2 * f, q2 * f, e1, MMA)
        f = tl.exp(G3 - c3[None, :])
        kk30, qk30 = pair_scores(kk30, qk30, k3 * f, q3 * f, e0 * tl.exp(c3 - c1)[None, :], MMA)
        kk31, qk31 = pair_scores(kk31, qk31, k3 * f, q3 * f, e1 * tl.exp(c3 - c2)[None, :], MMA)
        kk32, qk32 = pair_scores(kk32, qk32, k3 * f, q3 * f, e2, MMA)
        kk00, qk00 = diag_scores(kk00, qk00, k0, q0, G0, tl.zeros_like(c1), c1, FAST_DIAG, MMA)
        kk11, qk11 = diag_scores(kk11, qk11, k1, q1, G1, c1, c2, FAST_DIAG, MMA)
        kk22, qk22 = diag_scores(kk22, qk22, k2, q2, G2, c2, c3, FAST_DIAG, MMA)
        kk33, qk33 = diag_scores(kk33, qk33, k3, q3, G3, c3, c4, FAST_DIAG, MMA)
    return (kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33,
            qk00, qk10, qk11, qk20, qk21, qk22, qk30, qk31, qk32, qk33, sk0, sk1, sk2, sk3, sq0, sq1, sq2, sq3)


@triton.jit
def _wy_rows(aw_0, aw_1, aw_2, aw_3, x0, x1, x2, x3, MMA: tl.constexpr):
    """sum_S aw_S x_S: one row tile of (T diag(beta)) X from its four [16, 16] blocks ([16, D] operands)."""
    acc = tl.dot(aw_0, x0.to(MMA))
    acc = tl.dot(aw_1, x1.to(MMA), acc)
    acc = tl.dot(aw_2, x2.to(MMA), acc)
    return tl.dot(aw_3, x3.to(MMA), acc)


@triton.jit
def _chunk_kernel(q, k, v, g, beta, A_log, dt_bias, Wb, Ub, Qgb, Kdb, Aqb, Tb, gam, cu_seqlens, chunk_indices,
                  T, scale, lb, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr,
                  MMA: tl.constexpr, INV_PREC: tl.constexpr, STORE_T: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        (kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33,
         qk00, qk10, qk11, qk20, qk21, qk22, qk30, qk31, qk32, qk33, sk0, sk1, sk2, sk3, sq0, sq1, sq2, sq3) = _scores(
            q, k, g, dt_bias, a, lb, bos, t0, L, i_h, H, K, BK, BOUNDED, FAST_DIAG, MMA)
        rk0, rk1, rk2, rk3 = tl.rsqrt(sk0 + 1e-6), tl.rsqrt(sk1 + 1e-6), tl.rsqrt(sk2 + 1e-6), tl.rsqrt(sk3 + 1e-6)
        rq0, rq1 = tl.rsqrt(sq0 + 1e-6) * scale, tl.rsqrt(sq1 + 1e-6) * scale
        rq2, rq3 = tl.rsqrt(sq2 + 1e-6) * scale, tl.rsqrt(sq3 + 1e-6) * scale
        b0 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 0, H))
        b1 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 1, H))
        b2 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 2, H))
        b3 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 3, H))

        # A_qk = diag(rq) qk diag(rk), causal; stored as [16, 16] blocks of its [64, 64] (zeros above)
        o_b = tl.arange(0, 16)
        z = tl.zeros((16, 16), dtype=tl.float32)
        store_tile(Aqb, causal_mask(qk00, False) * rq0[:, None] * rk0[None, :], bos, t0, L, i_h, 0, o_b, H, BT)
        store_tile(Aqb, z, bos, t0, L, i_h, 0, 16 + o_b, H, BT)
        store_tile(Aqb, z, bos, t0, L, i_h, 0, 32 + o_b, H, BT)
        store_tile(Aqb, z, bos, t0, L, i_h, 0, 48 + o_b, H, BT)
        store_tile(Aqb, qk10 * rq1[:, None] * rk0[None, :], bos, t0, L, i_h, 1, o_b, H, BT)
        store_tile(Aqb, causal_mask(qk11, False) * rq1[:, None] * rk1[None, :], bos, t0, L, i_h, 1, 16 + o_b, H, BT)
        store_tile(Aqb, z, bos, t0, L, i_h, 1, 32 + o_b, H, BT)
        store_tile(Aqb, z, bos, t0, L, i_h, 1, 48 + o_b, H, BT)
        store_tile(Aqb, qk20 * rq2[:, None] * rk0[None, :], bos, t0, L, i_h, 2, o_b, H, BT)
        store_tile(Aqb, qk21 * rq2[:, None] * rk1[None, :], bos, t0, L, i_h, 2, 16 + o_b, H, BT)
        store_tile(Aqb, causal_mask(qk22, False) * rq2[:, None] * rk2[None, :], bos, t0, L, i_h, 2, 32 + o_b, H, BT)
        store_tile(Aqb, z, bos, t0, L, i_h, 2, 48 + o_b, H, BT)
        store_tile(Aqb, qk30 * rq3[:, None] * rk0[None, :], bos, t0, L, i_h, 3, o_b, H, BT)
        store_tile(Aqb, qk31 * rq3[:, None] * rk1[None, :], bos, t0, L, i_h, 3, 16 + o_b, H, BT)
        store_tile(Aqb, qk32 * rq3[:, None] * rk2[None, :], bos, t0, L, i_h, 3, 32 + o_b, H, BT)
        store_tile(Aqb, causal_mask(qk33, False) * rq3[:, None] * rk3[None, :], bos, t0, L, i_h, 3, 48 + o_b, H, BT)

        # L = diag(beta) A_kk (strictly causal) and T = (I + L)^-1, by blocks: T_RR = (I + L_RR)^-1,
        # T_RS = -T_RR sum_{S <= P < R} L_RP T_PS
        l10 = kk10 * (b1 * rk1)[:, None] * rk0[None, :]
        l20 = kk20 * (b2 * rk2)[:, None] * rk0[None, :]
        l21 = kk21 * (b2 * rk2)[:, None] * rk1[None, :]
        l30 = kk30 * (b3 * rk3)[:, None] * rk0[None, :]
        l31 = kk31 * (b3 * rk3)[:, None] * rk1[None, :]
        l32 = kk32 * (b3 * rk3)[:, None] * rk2[None, :]
        t00 = unit_lower_inverse(causal_mask(kk00, True) * (b0 * rk0)[:, None] * rk0[None, :], INV_PREC)
        t11 = unit_lower_inverse(causal_mask(kk11, True) * (b1 * rk1)[:, None] * rk1[None, :], INV_PREC)
        t22 = unit_lower_inverse(causal_mask(kk22, True) * (b2 * rk2)[:, None] * rk2[None, :], INV_PREC)
        t33 = unit_lower_inverse(causal_mask(kk33, True) * (b3 * rk3)[:, None] * rk3[None, :], INV_PREC)
        t10 = -tl.dot(t11, tl.dot(l10, t00, input_precision=INV_PREC), input_precision=INV_PREC)
        t21 = -tl.dot(t22, tl.dot(l21, t11, input_precision=INV_PREC), input_precision=INV_PREC)
        t20 = -tl.dot(t22, tl.dot(l21, t10, tl.dot(l20, t00, input_precision=INV_PREC), input_precision=INV_PREC),
                      input_precision=INV_PREC)
        t32 = -tl.dot(t33, tl.dot(l32, t22, input_precision=INV_PREC), input_precision=INV_PREC)
        t31 = -tl.dot(t33, tl.dot(l32, t21, tl.dot(l31, t11, input_precision=INV_PREC), input_precision=INV_PREC),
                      input_precision=INV_PREC)
        acc = tl.dot(l31, t10, tl.dot(l30, t00, input_precision=INV_PREC), input_precision=INV_PREC)
        t30 = -tl.dot(t33, tl.dot(l32, t20, acc, input_precision=INV_PREC), input_precision=INV_PREC)
        if STORE_T:
            store_tile(Tb, t00, bos, t0, L, i_h, 0, o_b, H, BT)
            store_tile(Tb, z, bos, t0, L, i_h, 0, 16 + o_b, H, BT)
            store_tile(Tb, z, bos, t0, L, i_h, 0, 32 + o_b, H, BT)
            store_tile(Tb, z, bos, t0, L, i_h, 0, 48 + o_b, H, BT)
            store_tile(Tb, t10, bos, t0, L, i_h, 1, o_b, H, BT)
            store_tile(Tb, t11, bos, t0, L, i_h, 1, 16 + o_b, H, BT)
            store_tile(Tb, z, bos, t0, L, i_h, 1, 32 + o_b, H, BT)
            store_tile(Tb, z, bos, t0, L, i_h, 1, 48 + o_b, H, BT)
            store_tile(Tb, t20, bos, t0, L, i_h, 2, o_b, H, BT)
            store_tile(Tb, t21, bos, t0, L, i_h, 2, 16 + o_b, H, BT)
            store_tile(Tb, t22, bos, t0, L, i_h, 2, 32 + o_b, H, BT)
            store_tile(Tb, z, bos, t0, L, i_h, 2, 48 + o_b, H, BT)
            store_tile(Tb, t30, bos, t0, L, i_h, 3, o_b, H, BT)
            store_tile(Tb, t31, bos, t0, L, i_h, 3, 16 + o_b, H, BT)
            store_tile(Tb, t32, bos, t0, L, i_h, 3, 32 + o_b, H, BT)
            store_tile(Tb, t33, bos, t0, L, i_h, 3, 48 + o_b, H, BT)
        # T diag(beta) as MMA operands (zero blocks above the diagonal)
        zm = z.to(MMA)
        w00 = (t00 * b0[None, :]).to(MMA)
        w10, w11 = (t10 * b0[None, :]).to(MMA), (t11 * b1[None, :]).to(MMA)
        w20, w21, w22 = (t20 * b0[None, :]).to(MMA), (t21 * b1[None, :]).to(MMA), (t22 * b2[None, :]).to(MMA)
        w30, w31 = (t30 * b0[None, :]).to(MMA), (t31 * b1[None, :]).to(MMA)
        w32, w33 = (t32 * b2[None, :]).to(MMA), (t33 * b3[None, :]).to(MMA)

        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            G0, G1, G2, G3, c1, c2, c3, c4 = decay_tiles(g, dt_bias, a, lb, bos, t0, L, i_h, o_k, H, K, BOUNDED)
            n0 = load_tile(k, bos, t0, L, i_h, 0, o_k, H, K) * rk0[:, None]
            n1 = load_tile(k, bos, t0, L, i_h, 1, o_k, H, K) * rk1[:, None]
            n2 = load_tile(k, bos, t0, L, i_h, 2, o_k, H, K) * rk2[:, None]
            n3 = load_tile(k, bos, t0, L, i_h, 3, o_k, H, K) * rk3[:, None]
            x0, x1, x2, x3 = n0 * tl.exp(G0), n1 * tl.exp(G1), n2 * tl.exp(G2), n3 * tl.exp(G3)
            store_tile(Wb, _wy_rows(w00, zm, zm, zm, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 0, o_k, H, K)
            store_tile(Wb, _wy_rows(w10, w11, zm, zm, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 1, o_k, H, K)
            store_tile(Wb, _wy_rows(w20, w21, w22, zm, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 2, o_k, H, K)
            store_tile(Wb, _wy_rows(w30, w31, w32, w33, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 3, o_k, H, K)
            store_tile(Kdb, n0 * tl.exp(c4[None, :] - G0), bos, t0, L, i_h, 0, o_k, H, K)
            store_tile(Kdb, n1 * tl.exp(c4[None, :] - G1), bos, t0, L, i_h, 1, o_k, H, K)
            store_tile(Kdb, n2 * tl.exp(c4[None, :] - G2), bos, t0, L, i_h, 2, o_k, H, K)
            store_tile(Kdb, n3 * tl.exp(c4[None, :] - G3), bos, t0, L, i_h, 3, o_k, H, K)
            store_tile(Qgb, load_tile(q, bos, t0, L, i_h, 0, o_k, H, K) * rq0[:, None] * tl.exp(G0),
                       bos, t0, L, i_h, 0, o_k, H, K)
            store_tile(Qgb, load_tile(q, bos, t0, L, i_h, 1, o_k, H, K) * rq1[:, None] * tl.exp(G1),
                       bos, t0, L, i_h, 1, o_k, H, K)
            store_tile(Qgb, load_tile(q, bos, t0, L, i_h, 2, o_k, H, K) * rq2[:, None] * tl.exp(G2),
                       bos, t0, L, i_h, 2, o_k, H, K)
            store_tile(Qgb, load_tile(q, bos, t0, L, i_h, 3, o_k, H, K) * rq3[:, None] * tl.exp(G3),
                       bos, t0, L, i_h, 3, o_k, H, K)
            tl.store(gam + (i_p * H + i_h).to(tl.int64) * K + o_k, tl.exp(c4))
        for vb in range(0, V, BV):
            o_v = vb + tl.arange(0, BV)
            x0 = load_tile(v, bos, t0, L, i_h, 0, o_v, H, V)
            x1 = load_tile(v, bos, t0, L, i_h, 1, o_v, H, V)
            x2 = load_tile(v, bos, t0, L, i_h, 2, o_v, H, V)
            x3 = load_tile(v, bos, t0, L, i_h, 3, o_v, H, V)
            store_tile(Ub, _wy_rows(w00, zm, zm, zm, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 0, o_v, H, V)
            store_tile(Ub, _wy_rows(w10, w11, zm, zm, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 1, o_v, H, V)
            store_tile(Ub, _wy_rows(w20, w21, w22, zm, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 2, o_v, H, V)
            store_tile(Ub, _wy_rows(w30, w31, w32, w33, x0, x1, x2, x3, MMA), bos, t0, L, i_h, 3, o_v, H, V)


@triton.jit
def _scan_kernel(Wb, Ub, Qgb, Kdb, Aqb, gam, o, h0, ht, hbuf, dbuf, cu_seqlens, chunk_offsets, T,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                 STORE_H: tl.constexpr, STORE_D: tl.constexpr, WRITE_O: tl.constexpr, MMA: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L, c_off = seq_coords(cu_seqlens, chunk_offsets, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, BT)
    ps = (i_nh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + ps).to(tl.float32)
    else:
        S = tl.zeros((K, BV), dtype=tl.float32)
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
        bu = tl.load(Ub + pv, mask=m_t, other=0.0).to(tl.float32)
        Sm = S.to(MMA)
        delta = bu - tl.dot(bw, Sm)
        dm = delta.to(MMA)
        if STORE_D:
            tl.store(dbuf + pv, dm.to(dbuf.dtype.element_ty), mask=m_t)
        if WRITE_O:
            bqg = tl.load(Qgb + pk, mask=m_t, other=0.0).to(MMA)
            baq = tl.load(Aqb + tok[:, None] * BT + o_c[None, :], mask=m_t, other=0.0).to(MMA)
            tl.store(o + pv, tl.dot(baq, dm, tl.dot(bqg, Sm)).to(o.dtype.element_ty), mask=m_t)
        gm = tl.load(gam + (slot * H + i_h) * K + o_k)
        S = tl.dot(tl.trans(bkd), dm, S * gm[:, None])
    if STORE_HT:
        tl.store(ht + ps, S)


def mm_dtype(x: torch.Tensor):
    """Tensor-core operand dtype: bf16 for bf16 inputs, fp32 (tf32 on GPU) for fp16 / fp32."""
    return tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float32


def storage_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32


def prepare_varlen(cu_seqlens: torch.Tensor, T: int):
    """Device-side chunk bookkeeping (no host sync, fixed sizes, so it can be captured/compiled).

    Returns chunk_indices [NS, 2] int32 (sequence, chunk) per slot, -1 for unused slots,
    chunk_offsets [N] int32 (first slot of each sequence) and NS = cdiv(T, 64) + N."""
    N = cu_seqlens.numel() - 1
    NS = triton.cdiv(T, BT) + N
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    nch = (lens + BT - 1) // BT
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
                  cu_seqlens, *, for_backward=False):
    """Launch the forward. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (raw logits).

    Returns (o [B, T, H, V] in v.dtype, final_state fp32 or None). With ``for_backward`` it skips o and
    returns the buffers the backward needs instead, as a dict: T, Aqk [B, T, H, 64]; W, Qg, Kd [B, T, H, K];
    gam [NS, H, K] fp32; h [NS, H, K, V] (state at each chunk start) and delta [B, T, H, V] (storage dtype),
    plus the varlen bookkeeping chunk_indices, chunk_offsets, NS, N."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets, NS = prepare_varlen(cu_seqlens, T)
        N = cu_seqlens.numel() - 1
    else:
        chunk_indices = chunk_offsets = None
        NS = B * triton.cdiv(T, BT)
        N = B
    sd = storage_dtype(v)
    MMA = mm_dtype(v)
    W = torch.empty(B, T, H, K, device=dev, dtype=sd)
    Qg = torch.empty_like(W)
    Kd = torch.empty_like(W)
    U = torch.empty(B, T, H, V, device=dev, dtype=sd)
    Aqk = torch.empty(B, T, H, BT, device=dev, dtype=sd)
    Tm = torch.empty_like(Aqk) if for_backward else None
    gam = torch.empty(NS, H, K, device=dev, dtype=torch.float32)
    BOUNDED = gate_lower_bound is not None
    lb = float(gate_lower_bound) if BOUNDED else 0.0
    _chunk_kernel[(NS, H)](
        q, k, v, g, beta, A_log, dt_bias, W, U, Qg, Kd, Aqk, Tm, gam, cu_seqlens, chunk_indices, T, scale, lb,
        H=H, K=K, V=V, BK=min(K, CONFIG["chunk_bk"]), BV=min(V, CONFIG["chunk_bk"]), IS_VARLEN=cu_seqlens is not None,
        BOUNDED=BOUNDED, FAST_DIAG=fast_diag(gate_lower_bound), MMA=MMA, INV_PREC=CONFIG["inv_prec"],
        STORE_T=for_backward, num_warps=CONFIG["chunk_warps"], num_stages=1)
    if CONFIG["stop_after"] == "chunk":
        return None, None
    o = None if for_backward else torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    hbuf = torch.empty(NS, H, K, V, device=dev, dtype=sd) if for_backward else None
    dbuf = torch.empty_like(U) if for_backward else None
    # narrow V tiles when there are few (sequence, head) pairs, so that every SM gets a scan
    BVs = min(V, CONFIG["scan_bv"] or (64 if N * H >= 512 else (32 if N * H >= 64 else 16)))
    _scan_kernel[(triton.cdiv(V, BVs), N * H)](
        W, U, Qg, Kd, Aqk, gam, o if o is not None else U, initial_state, ht, hbuf, dbuf, cu_seqlens, chunk_offsets,
        T, H=H, K=K, V=V, BV=BVs, IS_VARLEN=cu_seqlens is not None, HAS_H0=initial_state is not None,
        STORE_HT=output_final_state, STORE_H=for_backward, STORE_D=for_backward, WRITE_O=not for_backward, MMA=MMA,
        num_warps=CONFIG["scan_warps"], num_stages=CONFIG["scan_stages"])
    if for_backward:
        return dict(T=Tm, Aqk=Aqk, W=W, Qg=Qg, Kd=Kd, gam=gam, h=hbuf, delta=dbuf, ht=ht,
                    chunk_indices=chunk_indices, chunk_offsets=chunk_offsets, NS=NS, N=N)
    return o, ht
