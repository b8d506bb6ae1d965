"""Chunked KDA backward: recompute, one reverse scan, two chunk-parallel kernels.

1. ``chunk_kda_fwd(..., for_backward=True)`` recomputes the chunk buffers, ``T``, the state ``h`` at
   every chunk start and ``delta = U - W h``.
2. ``_scan_bwd_kernel`` walks the chunks backwards per (sequence, head, V tile) with the fp32 state
   gradient ``dS`` in registers. Per chunk it stores ``dS`` (the gradient at the chunk END) and
   ``ddelta = A_qk^T dO + Kd dS``, then steps ``dS <- gamma * dS + Qg^T dO - W^T ddelta``.
3. ``_state_grads_kernel`` (per chunk and head) contracts over V: ``dv = (T diag(beta))^T ddelta``,
   ``dA_qk = dO delta^T``, the WY gradient ``dL = -T^T dT T^T`` (``L = diag(beta) A_kk``), beta's
   column-side gradient, and the direct gradients of q, k and G through ``Qg``, ``W`` and ``Kd``
   (fp32 scratch; the gradient of ``G_end`` is added on the chunk's last row, where the reverse
   cumsum spreads it to every row).
4. ``_gate_grads_kernel`` (per chunk and head, over K in BK-wide slices) back-propagates ``dL`` and
   ``dA_qk`` through the gated scores with the forward's tile factors (``chunk_tiles.py``), then
   through the decay cumsum, the gate activation, the L2 norms and beta's sigmoid; it writes dq, dk,
   dg, dbeta and per-chunk partial sums of dA_log and ddt_bias.
"""

import torch
import triton
import triton.language as tl

from .chunk_fwd import chunk_kda_fwd, mm_dtype
from .chunk_tiles import (BT, causal_mask, chunk_coords, chunk_offsets64, decay_tiles, fast_diag, gate, load_rows,
                          load_tile, seq_coords, store_rows, store_tile, tile_offsets)

# launch knobs (benchmarks/kda.py times the alternatives); stop_after ends the backward early (stage timing only)
CONFIG = dict(scan_bv=32, scan_warps=4, state_warps=8, state_bk=32, state_bv=32, gate_warps=4, gate_bk=32,
              stop_after=None)


@triton.jit
def _scan_bwd_kernel(Wb, Qgb, Kdb, Aqb, gam, do, dht, dh0, dhbuf, ddbuf, cu_seqlens, chunk_offsets, T,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     IS_VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, MMA: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L, c_off = seq_coords(cu_seqlens, chunk_offsets, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_c = tl.arange(0, BT)
    ps = (i_nh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
    if HAS_DHT:
        dS = tl.load(dht + ps).to(tl.float32)
    else:
        dS = tl.zeros((K, BV), dtype=tl.float32)
    NC = tl.cdiv(L, BT)
    for j in range(NC):
        i_c = NC - 1 - j
        slot = (c_off + i_c).to(tl.int64)
        tl.store(dhbuf + ((slot * H + i_h) * K + o_k)[:, None] * V + o_v[None, :], dS.to(dhbuf.dtype.element_ty))
        o_t = i_c * BT + o_c
        m_t = (o_t < L)[:, None]
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        pk = tok[:, None] * K + o_k[None, :]
        pv = tok[:, None] * V + o_v[None, :]
        bw = tl.load(Wb + pk, mask=m_t, other=0.0).to(MMA)
        bqg = tl.load(Qgb + pk, mask=m_t, other=0.0).to(MMA)
        bkd = tl.load(Kdb + pk, mask=m_t, other=0.0).to(MMA)
        baq = tl.load(Aqb + tok[:, None] * BT + o_c[None, :], mask=m_t, other=0.0).to(MMA)
        bdo = tl.load(do + pv, mask=m_t, other=0.0).to(MMA)
        gm = tl.load(gam + (slot * H + i_h) * K + o_k)
        dd = tl.dot(bkd, dS.to(MMA), tl.dot(tl.trans(baq), bdo)).to(MMA)  # [64, BV]
        tl.store(ddbuf + pv, dd.to(ddbuf.dtype.element_ty), mask=m_t)
        dS = tl.dot(tl.trans(bw), -dd, tl.dot(tl.trans(bqg), bdo, dS * gm[:, None]))
    if STORE_DH0:
        tl.store(dh0 + ps, dS)


@triton.jit
def _state_grads_kernel(q, k, g, beta, A_log, dt_bias, v, do, Tb, hbuf, dhbuf, dbuf, ddbuf,
                        dv, dLb, dAqb, dbeta_col, dqn_s, dkn_s, dG_s, cu_seqlens, chunk_indices, T, scale, lb,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr, MMA: tl.constexpr, DOT_PREC: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        slot = (i_p * H + i_h).to(tl.int64)
        o_c = tl.arange(0, BT)
        o_t = t0 + o_c
        m_r = o_t < L
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        bb = tl.where(m_r, tl.sigmoid(tl.load(beta + tok, mask=m_r, other=0.0).to(tl.float32)), 0.0)
        pT, m_t = chunk_offsets64(bos, t0, L, i_h, o_c, H, BT)
        Tm = tl.load(Tb + pT, mask=m_t, other=0.0).to(tl.float32)
        Aw = (Tm * bb[None, :]).to(MMA)
        sk = tl.zeros((BT,), dtype=tl.float32)
        sq = tl.zeros((BT,), dtype=tl.float32)
        for kb in range(0, K, BK):
            pk, _ = chunk_offsets64(bos, t0, L, i_h, kb + tl.arange(0, BK), H, K)
            bk = tl.load(k + pk, mask=m_t, other=0.0).to(tl.float32)
            bq = tl.load(q + pk, mask=m_t, other=0.0).to(tl.float32)
            sk += tl.sum(bk * bk, 1)
            sq += tl.sum(bq * bq, 1)
        rk = tl.rsqrt(sk + 1e-6)
        rq = tl.rsqrt(sq + 1e-6) * scale

        dAw = tl.zeros((BT, BT), dtype=tl.float32)
        dAq = tl.zeros((BT, BT), dtype=tl.float32)
        for vb in range(0, V, BV):
            pv, _ = chunk_offsets64(bos, t0, L, i_h, vb + tl.arange(0, BV), H, V)
            bdo = tl.load(do + pv, mask=m_t, other=0.0).to(MMA)
            bd = tl.load(dbuf + pv, mask=m_t, other=0.0).to(MMA)
            bdd = tl.load(ddbuf + pv, mask=m_t, other=0.0).to(MMA)
            bv = tl.load(v + pv, mask=m_t, other=0.0).to(MMA)
            dAq = tl.dot(bdo, tl.trans(bd), dAq)
            dAw = tl.dot(bdd, tl.trans(bv), dAw)
            tl.store(dv + pv, tl.dot(tl.trans(Aw), bdd).to(dv.dtype.element_ty), mask=m_t)

        last = (o_t == tl.minimum(t0 + BT, L) - 1)[:, None]  # the chunk's last row: where dG_end goes
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            dQg = tl.zeros((BT, BK), dtype=tl.float32)
            dKd = tl.zeros((BT, BK), dtype=tl.float32)
            dW = tl.zeros((BT, BK), dtype=tl.float32)
            dgam = tl.zeros((BK,), dtype=tl.float32)
            for vb in range(0, V, BV):
                o_v = vb + tl.arange(0, BV)
                pv, _ = chunk_offsets64(bos, t0, L, i_h, o_v, H, V)
                ph = (slot * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
                bS = tl.load(hbuf + ph)
                bdS = tl.load(dhbuf + ph)
                dQg = tl.dot(tl.load(do + pv, mask=m_t, other=0.0).to(MMA), tl.trans(bS.to(MMA)), dQg)
                dKd = tl.dot(tl.load(dbuf + pv, mask=m_t, other=0.0).to(MMA), tl.trans(bdS.to(MMA)), dKd)
                dW = tl.dot(tl.load(ddbuf + pv, mask=m_t, other=0.0).to(MMA), tl.trans(bS.to(MMA)), dW)
                dgam += tl.sum(bS.to(tl.float32) * bdS.to(tl.float32), 1)
            dW = -dW
            # decay of this channel slice as one [64, BK] cumsum (the tiled forward order differs only in rounding)
            pk, _ = chunk_offsets64(bos, t0, L, i_h, o_k, H, K)
            bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
            ga = tl.where(m_t, gate(tl.load(g + pk, mask=m_t, other=0.0).to(tl.float32), bias[None, :], a, lb,
                                    BOUNDED), 0.0)
            G = tl.cumsum(ga, 0)
            Gend = tl.sum(ga, 0)
            eG = tl.exp(G)
            eK = tl.exp(Gend[None, :] - G)
            kn = tl.load(k + pk, mask=m_t, other=0.0).to(tl.float32) * rk[:, None]
            qn = tl.load(q + pk, mask=m_t, other=0.0).to(tl.float32) * rq[:, None]
            kg = kn * eG
            dAw = tl.dot(dW.to(MMA), tl.trans(kg.to(MMA)), dAw)
            dkg = tl.dot(tl.trans(Aw), dW.to(MMA))
            dGend = tl.sum(dKd * kn * eK, 0) + dgam * tl.exp(Gend)
            dG = dQg * qn * eG + dkg * kg - dKd * kn * eK + tl.where(last, dGend[None, :], 0.0)
            tl.store(dqn_s + pk, dQg * eG, mask=m_t)
            tl.store(dkn_s + pk, dkg * eG + dKd * eK, mask=m_t)
            tl.store(dG_s + pk, dG, mask=m_t)

        # Aw = T diag(beta): dT = dAw diag(beta), dbeta_j = sum_i dAw_ij T_ij; dL = -T^T dT T^T (strictly causal)
        tl.store(dbeta_col + tok, tl.sum(dAw * Tm, 0), mask=m_r)
        dT = dAw * bb[None, :]
        dL = -tl.dot(tl.dot(tl.trans(Tm), dT, input_precision=DOT_PREC), tl.trans(Tm), input_precision=DOT_PREC)
        dL = tl.where(o_c[None, :] < o_c[:, None], dL, 0.0)
        dAq = tl.where(o_c[None, :] <= o_c[:, None], dAq, 0.0)
        tl.store(dLb + pT, dL, mask=m_t)
        tl.store(dAqb + pT, dAq, mask=m_t)


@triton.jit
def _load_block(x, bos, t0, L, i_h, R: tl.constexpr, S: tl.constexpr, H: tl.constexpr):
    """Block (R, S) [16, 16] of a per-chunk [64, 64] matrix stored as [B, T, H, 64] rows."""
    return load_tile(x, bos, t0, L, i_h, R, S * 16 + tl.arange(0, 16), H, BT)


@triton.jit
def _diag_grads(rl, rq, dl, dq_, kn, bk, qn, Gt, c_lo, c_hi, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    """Diagonal block of one tile: row sums rl += sum_j dL_ij kn_j e^(G_i - G_j), rq (dA_qk, same), and the
    column sums C_j = sum_i (dL_ij bk_i + dA_ij qn_i) e^(G_i - G_j) (bk = beta * kn)."""
    if FAST_DIAG:
        m = 0.5 * (c_lo + c_hi)
        fr = tl.exp(Gt - m[None, :])
        fc = tl.exp(m[None, :] - Gt)
        col = (kn * fc).to(MMA)
        rl += fr * tl.dot(dl.to(MMA), col)
        rq += fr * tl.dot(dq_.to(MMA), col)
        C = fc * tl.dot(tl.trans(dl.to(MMA)), (bk * fr).to(MMA), tl.dot(tl.trans(dq_.to(MMA)), (qn * fr).to(MMA)))
    else:
        o_i = tl.arange(0, 16)
        C = tl.zeros_like(rl)
        for j in range(16):
            sel = (o_i == j)[:, None]
            kj = tl.sum(tl.where(sel, kn, 0.0), 0)
            Gj = tl.sum(tl.where(sel, Gt, 0.0), 0)
            e = tl.exp(tl.where((o_i >= j)[:, None], Gt - Gj[None, :], float("-inf")))  # [16, BK]
            pl = tl.sum(tl.where((o_i == j)[None, :], dl, 0.0), 1)  # column j of the block
            pq = tl.sum(tl.where((o_i == j)[None, :], dq_, 0.0), 1)
            rl += pl[:, None] * e * kj[None, :]
            rq += pq[:, None] * e * kj[None, :]
            C += tl.where(sel, tl.sum((pl[:, None] * bk + pq[:, None] * qn) * e, 0)[None, :], 0.0)
    return rl, rq, C


@triton.jit
def _col_dot(acc, dl, dq_, bk, qn, f, MMA: tl.constexpr):
    """acc + dL_RS^T (bk_R f) + dA_RS^T (qn_R f): column-side sums of block (R, S) with row factor f."""
    acc = tl.dot(tl.trans(dl.to(MMA)), (bk * f).to(MMA), acc)
    return tl.dot(tl.trans(dq_.to(MMA)), (qn * f).to(MMA), acc)


@triton.jit
def _tile_grads(rl, rq, C, kn, qn, bb, Gt, dqn_s, dkn_s, dG_s, bos, t0, L, i_h, R: tl.constexpr, o_k,
                H: tl.constexpr, K: tl.constexpr):
    """Total dkn, dqn, dG of tile R (score terms + the direct terms in scratch), and sum_d kn dL-row (for dbeta)."""
    dkn = bb[:, None] * rl + C + load_tile(dkn_s, bos, t0, L, i_h, R, o_k, H, K)
    dqn = rq + load_tile(dqn_s, bos, t0, L, i_h, R, o_k, H, K)
    dG = kn * (bb[:, None] * rl - C) + qn * rq + load_tile(dG_s, bos, t0, L, i_h, R, o_k, H, K)
    return dkn, dqn, dG, tl.sum(kn * rl, 1)


@triton.jit
def _gate_back(dga, g, dt_bias, a, lb, bos, t0, L, i_h, R: tl.constexpr, o_k, dg, H: tl.constexpr,
               K: tl.constexpr, BOUNDED: tl.constexpr):
    """Store dg of tile R from the decay gradient; return the column sums of dz (-> ddt_bias) and of the
    dA_log terms ([BK] each)."""
    p, m = tile_offsets(bos, t0, L, i_h, R, o_k, H, K)
    z = tl.load(g + p, mask=m[:, None], other=0.0).to(tl.float32) + tl.load(dt_bias + i_h * K + o_k).to(tl.float32)[None, :]
    dga = tl.where(m[:, None], dga, 0.0)
    if BOUNDED:
        s = tl.sigmoid(a * z)
        dz = dga * (lb * a) * s * (1.0 - s)
        dal = tl.sum(dz * z, 0)
    else:
        dz = dga * (-a) * tl.sigmoid(z)
        dal = tl.sum(dga * gate(z, 0.0, a, lb, BOUNDED), 0)
    tl.store(dg + p, dz.to(dg.dtype.element_ty), mask=m[:, None])
    return tl.sum(dz, 0), dal


@triton.jit
def _norm_back(dx_s, x, r, scale, bos, t0, L, i_h, R: tl.constexpr, o_k, rho, dx, H: tl.constexpr, K: tl.constexpr):
    """dx = r (scale * dxn - n rho) for xn = scale * x * r (n = x * r, rho = sum xn dxn)."""
    n = load_tile(x, bos, t0, L, i_h, R, o_k, H, K) * r[:, None]
    dxn = load_tile(dx_s, bos, t0, L, i_h, R, o_k, H, K)
    store_tile(dx, r[:, None] * (scale * dxn - n * rho[:, None]), bos, t0, L, i_h, R, o_k, H, K)


@triton.jit
def _gate_grads_kernel(q, k, g, beta, A_log, dt_bias, dLb, dAqb, dbeta_col, dqn_s, dkn_s, dG_s,
                       dq, dk, dg, dbeta, dA_part, dbias_part, cu_seqlens, chunk_indices, T, scale, lb,
                       H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                       BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        slot = (i_p * H + i_h).to(tl.int64)
        s = tl.zeros((16,), dtype=tl.float32)
        sk0, sk1, sk2, sk3, sq0, sq1, sq2, sq3 = s, s, s, s, s, s, s, s
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            x = load_tile(k, bos, t0, L, i_h, 0, o_k, H, K)
            sk0 += tl.sum(x * x, 1)
            x = load_tile(k, bos, t0, L, i_h, 1, o_k, H, K)
            sk1 += tl.sum(x * x, 1)
            x = load_tile(k, bos, t0, L, i_h, 2, o_k, H, K)
            sk2 += tl.sum(x * x, 1)
            x = load_tile(k, bos, t0, L, i_h, 3, o_k, H, K)
            sk3 += tl.sum(x * x, 1)
            x = load_tile(q, bos, t0, L, i_h, 0, o_k, H, K)
            sq0 += tl.sum(x * x, 1)
            x = load_tile(q, bos, t0, L, i_h, 1, o_k, H, K)
            sq1 += tl.sum(x * x, 1)
            x = load_tile(q, bos, t0, L, i_h, 2, o_k, H, K)
            sq2 += tl.sum(x * x, 1)
            x = load_tile(q, bos, t0, L, i_h, 3, o_k, H, K)
            sq3 += tl.sum(x * x, 1)
        rk0, rk1, rk2, rk3 = tl.rsqrt(sk0 + 1e-6), tl.rsqrt(sk1 + 1e-6), tl.rsqrt(sk2 + 1e-6), tl.rsqrt(sk3 + 1e-6)
        nq0, nq1, nq2, nq3 = tl.rsqrt(sq0 + 1e-6), tl.rsqrt(sq1 + 1e-6), tl.rsqrt(sq2 + 1e-6), tl.rsqrt(sq3 + 1e-6)
        b0 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 0, H))
        b1 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 1, H))
        b2 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 2, H))
        b3 = tl.sigmoid(load_rows(beta, bos, t0, L, i_h, 3, H))
        l00, l10, l11 = _load_block(dLb, bos, t0, L, i_h, 0, 0, H), _load_block(dLb, bos, t0, L, i_h, 1, 0, H), \
            _load_block(dLb, bos, t0, L, i_h, 1, 1, H)
        l20, l21, l22 = _load_block(dLb, bos, t0, L, i_h, 2, 0, H), _load_block(dLb, bos, t0, L, i_h, 2, 1, H), \
            _load_block(dLb, bos, t0, L, i_h, 2, 2, H)
        l30, l31 = _load_block(dLb, bos, t0, L, i_h, 3, 0, H), _load_block(dLb, bos, t0, L, i_h, 3, 1, H)
        l32, l33 = _load_block(dLb, bos, t0, L, i_h, 3, 2, H), _load_block(dLb, bos, t0, L, i_h, 3, 3, H)
        p00, p10, p11 = _load_block(dAqb, bos, t0, L, i_h, 0, 0, H), _load_block(dAqb, bos, t0, L, i_h, 1, 0, H), \
            _load_block(dAqb, bos, t0, L, i_h, 1, 1, H)
        p20, p21, p22 = _load_block(dAqb, bos, t0, L, i_h, 2, 0, H), _load_block(dAqb, bos, t0, L, i_h, 2, 1, H), \
            _load_block(dAqb, bos, t0, L, i_h, 2, 2, H)
        p30, p31 = _load_block(dAqb, bos, t0, L, i_h, 3, 0, H), _load_block(dAqb, bos, t0, L, i_h, 3, 1, H)
        p32, p33 = _load_block(dAqb, bos, t0, L, i_h, 3, 2, H), _load_block(dAqb, bos, t0, L, i_h, 3, 3, H)

        db0, db1, db2, db3 = s, s, s, s
        rho_k0, rho_k1, rho_k2, rho_k3, rho_q0, rho_q1, rho_q2, rho_q3 = s, s, s, s, s, s, s, s
        dal = tl.zeros((BK,), dtype=tl.float32)
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            G0, G1, G2, G3, c1, c2, c3, c4 = decay_tiles(g, dt_bias, a, lb, bos, t0, L, i_h, o_k, H, K, BOUNDED)
            kn0 = load_tile(k, bos, t0, L, i_h, 0, o_k, H, K) * rk0[:, None]
            kn1 = load_tile(k, bos, t0, L, i_h, 1, o_k, H, K) * rk1[:, None]
            kn2 = load_tile(k, bos, t0, L, i_h, 2, o_k, H, K) * rk2[:, None]
            kn3 = load_tile(k, bos, t0, L, i_h, 3, o_k, H, K) * rk3[:, None]
            qn0 = load_tile(q, bos, t0, L, i_h, 0, o_k, H, K) * (nq0 * scale)[:, None]
            qn1 = load_tile(q, bos, t0, L, i_h, 1, o_k, H, K) * (nq1 * scale)[:, None]
            qn2 = load_tile(q, bos, t0, L, i_h, 2, o_k, H, K) * (nq2 * scale)[:, None]
            qn3 = load_tile(q, bos, t0, L, i_h, 3, o_k, H, K) * (nq3 * scale)[:, None]
            bk0, bk1, bk2, bk3 = kn0 * b0[:, None], kn1 * b1[:, None], kn2 * b2[:, None], kn3 * b3[:, None]
            # row side, off-diagonal blocks: the forward's column operands
            e0 = (kn0 * tl.exp(c1[None, :] - G0)).to(MMA)
            e1 = (kn1 * tl.exp(c2[None, :] - G1)).to(MMA)
            e2 = (kn2 * tl.exp(c3[None, :] - G2)).to(MMA)
            e20 = (kn0 * tl.exp(c1[None, :] - G0) * tl.exp(c2 - c1)[None, :]).to(MMA)
            e30 = (kn0 * tl.exp(c1[None, :] - G0) * tl.exp(c3 - c1)[None, :]).to(MMA)
            e31 = (kn1 * tl.exp(c2[None, :] - G1) * tl.exp(c3 - c2)[None, :]).to(MMA)
            f1 = tl.exp(G1 - c1[None, :])
            f2 = tl.exp(G2 - c2[None, :])
            f3 = tl.exp(G3 - c3[None, :])
            z = tl.zeros_like(G0)
            rl1 = f1 * tl.dot(l10.to(MMA), e0)
            rq1 = f1 * tl.dot(p10.to(MMA), e0)
            rl2 = f2 * tl.dot(l21.to(MMA), e1, tl.dot(l20.to(MMA), e20))
            rq2 = f2 * tl.dot(p21.to(MMA), e1, tl.dot(p20.to(MMA), e20))
            rl3 = f3 * tl.dot(l32.to(MMA), e2, tl.dot(l31.to(MMA), e31, tl.dot(l30.to(MMA), e30)))
            rq3 = f3 * tl.dot(p32.to(MMA), e2, tl.dot(p31.to(MMA), e31, tl.dot(p30.to(MMA), e30)))
            # column side, off-diagonal blocks: C_S = e^(c_{S+1} - G_S) sum_R e^(c_R - c_{S+1}) dP_RS^T (x_R f_R)
            C0 = _col_dot(z, l10, p10, bk1, qn1, f1, MMA)
            C0 += tl.exp(c2 - c1)[None, :] * _col_dot(z, l20, p20, bk2, qn2, f2, MMA)
            C0 += tl.exp(c3 - c1)[None, :] * _col_dot(z, l30, p30, bk3, qn3, f3, MMA)
            C0 = C0 * tl.exp(c1[None, :] - G0)
            C1 = _col_dot(z, l21, p21, bk2, qn2, f2, MMA)
            C1 += tl.exp(c3 - c2)[None, :] * _col_dot(z, l31, p31, bk3, qn3, f3, MMA)
            C1 = C1 * tl.exp(c2[None, :] - G1)
            C2 = _col_dot(z, l32, p32, bk3, qn3, f3, MMA) * tl.exp(c3[None, :] - G2)
            # diagonal blocks
            rl0, rq0, D0 = _diag_grads(z, z, causal_mask(l00, True), causal_mask(p00, False), kn0, bk0, qn0, G0,
                                        tl.zeros_like(c1), c1, FAST_DIAG, MMA)
            rl1, rq1, D1 = _diag_grads(rl1, rq1, causal_mask(l11, True), causal_mask(p11, False), kn1, bk1, qn1, G1,
                                       c1, c2, FAST_DIAG, MMA)
            rl2, rq2, D2 = _diag_grads(rl2, rq2, causal_mask(l22, True), causal_mask(p22, False), kn2, bk2, qn2, G2,
                                       c2, c3, FAST_DIAG, MMA)
            rl3, rq3, D3 = _diag_grads(rl3, rq3, causal_mask(l33, True), causal_mask(p33, False), kn3, bk3, qn3, G3,
                                       c3, c4, FAST_DIAG, MMA)
            dkn0, dqn0, dG0, x0 = _tile_grads(rl0, rq0, C0 + D0, kn0, qn0, b0, G0, dqn_s, dkn_s, dG_s,
                                              bos, t0, L, i_h, 0, o_k, H, K)
            dkn1, dqn1, dG1, x1 = _tile_grads(rl1, rq1, C1 + D1, kn1, qn1, b1, G1, dqn_s, dkn_s, dG_s,
                                              bos, t0, L, i_h, 1, o_k, H, K)
            dkn2, dqn2, dG2, x2 = _tile_grads(rl2, rq2, C2 + D2, kn2, qn2, b2, G2, dqn_s, dkn_s, dG_s,
                                              bos, t0, L, i_h, 2, o_k, H, K)
            dkn3, dqn3, dG3, x3 = _tile_grads(rl3, rq3, D3, kn3, qn3, b3, G3, dqn_s, dkn_s, dG_s,
                                              bos, t0, L, i_h, 3, o_k, H, K)
            db0, db1, db2, db3 = db0 + x0, db1 + x1, db2 + x2, db3 + x3
            rho_k0 += tl.sum(kn0 * dkn0, 1)
            rho_k1 += tl.sum(kn1 * dkn1, 1)
            rho_k2 += tl.sum(kn2 * dkn2, 1)
            rho_k3 += tl.sum(kn3 * dkn3, 1)
            rho_q0 += tl.sum(qn0 * dqn0, 1)
            rho_q1 += tl.sum(qn1 * dqn1, 1)
            rho_q2 += tl.sum(qn2 * dqn2, 1)
            rho_q3 += tl.sum(qn3 * dqn3, 1)
            # the totals replace the direct terms in scratch; the norm backward reads them once rho is complete
            store_tile(dkn_s, dkn0, bos, t0, L, i_h, 0, o_k, H, K)
            store_tile(dkn_s, dkn1, bos, t0, L, i_h, 1, o_k, H, K)
            store_tile(dkn_s, dkn2, bos, t0, L, i_h, 2, o_k, H, K)
            store_tile(dkn_s, dkn3, bos, t0, L, i_h, 3, o_k, H, K)
            store_tile(dqn_s, dqn0, bos, t0, L, i_h, 0, o_k, H, K)
            store_tile(dqn_s, dqn1, bos, t0, L, i_h, 1, o_k, H, K)
            store_tile(dqn_s, dqn2, bos, t0, L, i_h, 2, o_k, H, K)
            store_tile(dqn_s, dqn3, bos, t0, L, i_h, 3, o_k, H, K)
            # decay cumsum: dga_i = sum_{t >= i} dG_t (dG_end already sits on the last row)
            s3 = tl.sum(dG3, 0)
            s2 = s3 + tl.sum(dG2, 0)
            s1 = s2 + tl.sum(dG1, 0)
            u0, a0 = _gate_back(tl.cumsum(dG0, 0, reverse=True) + s1[None, :], g, dt_bias, a, lb, bos, t0, L, i_h, 0,
                                o_k, dg, H, K, BOUNDED)
            u1, a1 = _gate_back(tl.cumsum(dG1, 0, reverse=True) + s2[None, :], g, dt_bias, a, lb, bos, t0, L, i_h, 1,
                                o_k, dg, H, K, BOUNDED)
            u2, a2 = _gate_back(tl.cumsum(dG2, 0, reverse=True) + s3[None, :], g, dt_bias, a, lb, bos, t0, L, i_h, 2,
                                o_k, dg, H, K, BOUNDED)
            u3, a3 = _gate_back(tl.cumsum(dG3, 0, reverse=True), g, dt_bias, a, lb, bos, t0, L, i_h, 3,
                                o_k, dg, H, K, BOUNDED)
            dal += a0 + a1 + a2 + a3
            tl.store(dbias_part + slot * K + o_k, u0 + u1 + u2 + u3)
        tl.store(dA_part + slot, tl.sum(dal, 0))
        # beta: column side (from the WY kernel) + row side sum_d kn dL-row, through the sigmoid
        store_rows(dbeta, (load_rows(dbeta_col, bos, t0, L, i_h, 0, H) + db0) * b0 * (1.0 - b0), bos, t0, L, i_h, 0, H)
        store_rows(dbeta, (load_rows(dbeta_col, bos, t0, L, i_h, 1, H) + db1) * b1 * (1.0 - b1), bos, t0, L, i_h, 1, H)
        store_rows(dbeta, (load_rows(dbeta_col, bos, t0, L, i_h, 2, H) + db2) * b2 * (1.0 - b2), bos, t0, L, i_h, 2, H)
        store_rows(dbeta, (load_rows(dbeta_col, bos, t0, L, i_h, 3, H) + db3) * b3 * (1.0 - b3), bos, t0, L, i_h, 3, H)
        tl.debug_barrier()  # the scratch totals above were written by other threads of this program
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            _norm_back(dkn_s, k, rk0, 1.0, bos, t0, L, i_h, 0, o_k, rho_k0, dk, H, K)
            _norm_back(dkn_s, k, rk1, 1.0, bos, t0, L, i_h, 1, o_k, rho_k1, dk, H, K)
            _norm_back(dkn_s, k, rk2, 1.0, bos, t0, L, i_h, 2, o_k, rho_k2, dk, H, K)
            _norm_back(dkn_s, k, rk3, 1.0, bos, t0, L, i_h, 3, o_k, rho_k3, dk, H, K)
            _norm_back(dqn_s, q, nq0, scale, bos, t0, L, i_h, 0, o_k, rho_q0, dq, H, K)
            _norm_back(dqn_s, q, nq1, scale, bos, t0, L, i_h, 1, o_k, rho_q1, dq, H, K)
            _norm_back(dqn_s, q, nq2, scale, bos, t0, L, i_h, 2, o_k, rho_q2, dq, H, K)
            _norm_back(dqn_s, q, nq3, scale, bos, t0, L, i_h, 3, o_k, rho_q3, dq, H, K)


def chunk_kda_bwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, cu_seqlens, do, dht):
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) of ``chunk_kda_fwd``'s (o, ht).

    dq/dk/dg/dbeta/dv come back in the inputs' dtypes, dA_log/ddt_bias fp32, dh0 fp32 (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    fb = chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, False, cu_seqlens,
                       for_backward=True)
    NS, N, chunk_indices, chunk_offsets = fb["NS"], fb["N"], fb["chunk_indices"], fb["chunk_offsets"]
    MMA = mm_dtype(v)
    IS_VARLEN = cu_seqlens is not None
    BOUNDED = gate_lower_bound is not None
    lb = float(gate_lower_bound) if BOUNDED else 0.0
    if CONFIG["stop_after"] == "recompute":
        return None
    do = do.contiguous()
    dhbuf = torch.empty_like(fb["h"])
    ddbuf = torch.empty_like(fb["delta"])
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if initial_state is not None else None
    BVs = min(V, CONFIG["scan_bv"])
    _scan_bwd_kernel[(triton.cdiv(V, BVs), N * H)](
        fb["W"], fb["Qg"], fb["Kd"], fb["Aqk"], fb["gam"], do, dht, dh0, dhbuf, ddbuf, cu_seqlens, chunk_offsets, T,
        H=H, K=K, V=V, BV=BVs, IS_VARLEN=IS_VARLEN, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, MMA=MMA,
        num_warps=CONFIG["scan_warps"], num_stages=2)
    if CONFIG["stop_after"] == "scan":
        return None
    dv = torch.empty_like(v)
    dL = torch.empty(B, T, H, BT.value, device=dev, dtype=torch.float32)
    dAq = torch.empty_like(dL)
    dbeta_col = torch.empty(B, T, H, device=dev, dtype=torch.float32)
    dqn_s = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    dkn_s = torch.empty_like(dqn_s)
    dG_s = torch.empty_like(dqn_s)
    _state_grads_kernel[(NS, H)](
        q, k, g, beta, A_log, dt_bias, v, do, fb["T"], fb["h"], dhbuf, fb["delta"], ddbuf, dv, dL, dAq, dbeta_col,
        dqn_s, dkn_s, dG_s, cu_seqlens, chunk_indices, T, scale, lb, H=H, K=K, V=V, BK=min(K, CONFIG["state_bk"]),
        BV=min(V, CONFIG["state_bv"]), IS_VARLEN=IS_VARLEN, BOUNDED=BOUNDED, MMA=MMA, DOT_PREC="tf32",
        num_warps=CONFIG["state_warps"], num_stages=1)
    if CONFIG["stop_after"] == "state":
        return None
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    dA_part = torch.zeros(NS, H, device=dev, dtype=torch.float32)
    dbias_part = torch.zeros(NS, H, K, device=dev, dtype=torch.float32)
    _gate_grads_kernel[(NS, H)](
        q, k, g, beta, A_log, dt_bias, dL, dAq, dbeta_col, dqn_s, dkn_s, dG_s, dq, dk, dg, dbeta, dA_part, dbias_part,
        # fp32 operands (tf32 on the GPU) for the score gradients: dL / dA_qk span a wider range than the inputs
        cu_seqlens, chunk_indices, T, scale, lb, H=H, K=K, BK=min(K, CONFIG["gate_bk"]), IS_VARLEN=IS_VARLEN,
        BOUNDED=BOUNDED, FAST_DIAG=fast_diag(gate_lower_bound), MMA=tl.float32, num_warps=CONFIG["gate_warps"], num_stages=1)
    dA_log = dA_part.sum(0).to(A_log.dtype)
    ddt = dbias_part.sum(0).reshape(-1).to(dt_bias.dtype)
    return dq, dk, dv, dg, dbeta, dA_log, ddt, dh0
