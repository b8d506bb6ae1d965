"""Chunked KDA backward: recompute, one reverse scan, one chunk-parallel kernel.

1. ``chunk_kda_fwd(..., for_backward=True)`` recomputes the WY buffers and stores the state at
   every chunk start ``h`` and ``delta = U - W h`` (storage dtype).
2. ``_scan_bwd_kernel`` walks the chunks backwards per (sequence, head, V tile) with the fp32 state
   gradient in registers: it stores ``dh`` (the gradient at each chunk END) and returns ``dh0``:
   ``dS0 = gamma * dS1 + Qp^T dO - W^T (Kd dS1)``.
3. ``_intra_bwd_kernel`` (per chunk and head) recomputes the chunk (``_chunk_intra``), loops over V
   for ``dv`` and the products that contract over V, then back-propagates through
   ``T = (I + A)^-1``, the gated ``A_kk`` / ``A_qk`` (same two-factor tiling as the forward), the
   decay cumsum, the gate activation, the L2 norms and beta's sigmoid, and writes dq, dk, dv, dg,
   dbeta plus per-chunk partial sums for dA_log and ddt_bias.
"""

import torch
import triton
import triton.language as tl

from .chunk_fwd import (CONFIG, _chunk_coords, _chunk_intra, _g_tiles, _gate, _join4, _load_full, _qk_tile, _ref,
                        _seq_coords, _split4, chunk_kda_fwd, fast_diag, mm_dtype)


@triton.jit
def _scan_bwd_kernel(Wb, Qpb, Kdb, gam, do, dht, dh0, dhbuf, cu_seqlens, chunk_offsets, T,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     IS_VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, MMA: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L, c_off = _seq_coords(cu_seqlens, chunk_offsets, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    ps = (i_nh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
    if HAS_DHT:
        dS = tl.load(dht + ps).to(tl.float32)
    else:
        dS = tl.zeros((K, BV), dtype=tl.float32)
    NC = tl.cdiv(L, 64)
    for j in range(NC):
        i_c = NC - 1 - j
        slot = (c_off + i_c).to(tl.int64)
        tl.store(dhbuf + ((slot * H + i_h) * K + o_k)[:, None] * V + o_v[None, :], dS.to(dhbuf.dtype.element_ty))
        o_t = i_c * 64 + tl.arange(0, 64)
        m_t = (o_t < L)[:, None]
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        pk = tok[:, None] * K + o_k[None, :]
        bw = tl.load(Wb + pk, mask=m_t, other=0.0).to(MMA)
        bqp = tl.load(Qpb + pk, mask=m_t, other=0.0).to(MMA)
        bkd = tl.load(Kdb + pk, mask=m_t, other=0.0).to(MMA)
        bdo = tl.load(do + tok[:, None] * V + o_v[None, :], mask=m_t, other=0.0).to(MMA)
        gm = tl.load(gam + (slot * H + i_h) * K + o_k)
        t = tl.dot(bkd, dS.to(MMA))  # [64, BV]
        dS = dS * gm[:, None] + tl.dot(tl.trans(bqp), bdo) - tl.dot(tl.trans(bw), t.to(MMA))
    if STORE_DH0:
        tl.store(dh0 + ps, dS)


@triton.jit
def _row_grads(dPq_r, dPk_r, qn_r, kn_r, G_r, kn, G, c, R: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    """Row tile R of  sum_j dP_ij k_j exp(G_i - G_j)  for P = A_qk (-> dq) and P = A_kk (-> dk),
    plus (unbounded gate) the diagonal block's column-side sums. All [16, K] fp32."""
    o_t = tl.arange(0, 64)
    o_i = tl.arange(0, 16)
    if FAST_DIAG:
        ok = o_t < 16 * (R + 1)
    else:
        ok = o_t < 16 * R
    Y = (kn * tl.exp(tl.where(ok[:, None], c[None, :] - G, float("-inf")))).to(MMA)
    rowf = tl.exp(G_r - c[None, :])
    Rq = tl.dot(dPq_r.to(MMA), Y) * rowf
    Rk = tl.dot(dPk_r.to(MMA), Y) * rowf
    Cd = tl.zeros_like(Rq)
    if not FAST_DIAG:
        for jj in range(16):
            sel = (o_i == jj)[:, None]
            kj = tl.sum(tl.where(sel, kn_r, 0.0), 0)
            Gj = tl.sum(tl.where(sel, G_r, 0.0), 0)
            e = tl.exp(tl.where((o_i >= jj)[:, None], G_r - Gj[None, :], float("-inf")))  # [16, K]
            colsel = (o_t == R * 16 + jj)[None, :]
            pq = tl.sum(tl.where(colsel, dPq_r, 0.0), 1)  # column j of the tile [16]
            pk = tl.sum(tl.where(colsel, dPk_r, 0.0), 1)
            Rq += pq[:, None] * e * kj[None, :]
            Rk += pk[:, None] * e * kj[None, :]
            cj = tl.sum((pq[:, None] * qn_r + pk[:, None] * kn_r) * e, 0)  # [K]
            Cd = tl.where(sel, cj[None, :], Cd)
    return Rq, Rk, Cd


@triton.jit
def _col_grads(dPqT_s, dPkT_s, G_s, qn, kn, G, c, S: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    """Column tile S of  sum_i dP_ij (q_i | k_i) exp(G_i - G_j)  (-> dk of the column side), [16, K]."""
    o_t = tl.arange(0, 64)
    if FAST_DIAG:
        ok = o_t >= 16 * S
    else:
        ok = o_t >= 16 * (S + 1)
    f = tl.exp(tl.where(ok[:, None], G - c[None, :], float("-inf")))
    acc = tl.dot(dPqT_s.to(MMA), (qn * f).to(MMA)) + tl.dot(dPkT_s.to(MMA), (kn * f).to(MMA))
    return acc * tl.exp(c[None, :] - G_s)


@triton.jit
def _intra_bwd_kernel(q, k, v, g, beta, A_log, dt_bias, Wb, Kdb, hbuf, dbuf, dhbuf, do,
                      dq, dk, dv, dg, dbeta, dA_part, dbias_part, cu_seqlens, chunk_indices,
                      T, scale, lb, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                      IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr,
                      MMA: tl.constexpr, DOT_PREC: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = _chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        kn, bb, G, Gend, Akk, Aqk, Tm = _chunk_intra(
            q, k, g, beta, dt_bias, a, lb, scale, bos, t0, L, i_h, H, K, BOUNDED, FAST_DIAG, MMA, DOT_PREC)
        bq = _load_full(q, bos, t0, L, i_h, H, K)
        rq = tl.rsqrt(tl.sum(bq * bq, 1) + 1e-6)
        qn = bq * (rq * scale)[:, None]
        o_t = t0 + tl.arange(0, 64)
        m_t = o_t < L
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        o_k = tl.arange(0, K)
        pk = tok[:, None] * K + o_k[None, :]
        slot = (i_p * H + i_h).to(tl.int64)
        bw = tl.load(Wb + pk, mask=m_t[:, None], other=0.0).to(MMA)
        bkd = tl.load(Kdb + pk, mask=m_t[:, None], other=0.0)
        Tmm = Tm.to(MMA)
        Aqm = Aqk.to(MMA)

        dWacc = tl.zeros((64, K), dtype=tl.float32)
        dQg = tl.zeros((64, K), dtype=tl.float32)
        dKd = tl.zeros((64, K), dtype=tl.float32)
        dAqk = tl.zeros((64, 64), dtype=tl.float32)
        dT = tl.zeros((64, 64), dtype=tl.float32)
        dgam = tl.zeros((K,), dtype=tl.float32)
        db = tl.zeros((64,), dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            pv = tok[:, None] * V + o_v[None, :]
            ph = (slot * K + o_k)[:, None] * V + o_v[None, :]
            bv = tl.load(v + pv, mask=m_t[:, None], other=0.0).to(tl.float32)
            bdo = tl.load(do + pv, mask=m_t[:, None], other=0.0).to(MMA)
            bd = tl.load(dbuf + pv, mask=m_t[:, None], other=0.0).to(MMA)
            bS0 = tl.load(hbuf + ph)
            bdS1 = tl.load(dhbuf + ph)
            ddelta = tl.dot(bkd.to(MMA), bdS1.to(MMA)) + tl.dot(tl.trans(Aqm), bdo)  # [64, BV]
            ddm = ddelta.to(MMA)
            dWacc += tl.dot(ddm, tl.trans(bS0.to(MMA)))
            dQg += tl.dot(bdo, tl.trans(bS0.to(MMA)))
            dKd += tl.dot(bd, tl.trans(bdS1.to(MMA)))
            dAqk += tl.dot(bdo, tl.trans(bd))
            dgam += tl.sum(bS0.to(tl.float32) * bdS1.to(tl.float32), 1)
            dBv = tl.dot(tl.trans(Tmm), ddm)
            tl.store(dv + pv, (bb[:, None] * dBv).to(dv.dtype.element_ty), mask=m_t[:, None])
            db += tl.sum(dBv * bv, 1)
            dT += tl.dot(ddm, tl.trans((bb[:, None] * bv).to(MMA)))

        eG = tl.exp(G)
        Kg = kn * eG
        dW = -dWacc
        dT += tl.dot(dW.to(MMA), tl.trans((bb[:, None] * Kg).to(MMA)))
        dBk = tl.dot(tl.trans(Tmm), dW.to(MMA))
        db += tl.sum(dBk * Kg, 1)
        dKg = bb[:, None] * dBk
        dA = -tl.dot(tl.dot(tl.trans(Tm), dT, input_precision=DOT_PREC), tl.trans(Tm), input_precision=DOT_PREC)
        o_j = tl.arange(0, 64)
        dA = tl.where(o_j[None, :] < o_j[:, None], dA, 0.0)
        db += tl.sum(dA * Akk, 1)
        dPk = bb[:, None] * dA
        dPq = tl.where(o_j[None, :] <= o_j[:, None], dAqk, 0.0)

        # row tiles again (re-loaded; cache hits) and the per-tile decay references
        G0, G1, G2, G3, c1, c2, c3, c4 = _g_tiles(g, dt_bias, a, lb, bos, t0, L, i_h, H, K, BOUNDED)
        r0 = _ref(tl.zeros_like(c1), c1, FAST_DIAG)
        r1 = _ref(c1, c2, FAST_DIAG)
        r2 = _ref(c2, c3, FAST_DIAG)
        r3 = _ref(c3, c4, FAST_DIAG)
        qn0, kn0 = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 0)
        qn1, kn1 = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 1)
        qn2, kn2 = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 2)
        qn3, kn3 = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 3)
        dPq0, dPq1, dPq2, dPq3 = _split4(dPq, 64)
        dPk0, dPk1, dPk2, dPk3 = _split4(dPk, 64)
        Rq0, Rk0, Cd0 = _row_grads(dPq0, dPk0, qn0, kn0, G0, kn, G, r0, 0, FAST_DIAG, tl.float32)
        Rq1, Rk1, Cd1 = _row_grads(dPq1, dPk1, qn1, kn1, G1, kn, G, r1, 1, FAST_DIAG, tl.float32)
        Rq2, Rk2, Cd2 = _row_grads(dPq2, dPk2, qn2, kn2, G2, kn, G, r2, 2, FAST_DIAG, tl.float32)
        Rq3, Rk3, Cd3 = _row_grads(dPq3, dPk3, qn3, kn3, G3, kn, G, r3, 3, FAST_DIAG, tl.float32)
        dPqT0, dPqT1, dPqT2, dPqT3 = _split4(tl.trans(dPq), 64)
        dPkT0, dPkT1, dPkT2, dPkT3 = _split4(tl.trans(dPk), 64)
        if FAST_DIAG:
            s0, s1, s2, s3 = r0, r1, r2, r3
        else:
            s0, s1, s2, s3 = c1, c2, c3, c4
        C0 = _col_grads(dPqT0, dPkT0, G0, qn, kn, G, s0, 0, FAST_DIAG, tl.float32) + Cd0
        C1 = _col_grads(dPqT1, dPkT1, G1, qn, kn, G, s1, 1, FAST_DIAG, tl.float32) + Cd1
        C2 = _col_grads(dPqT2, dPkT2, G2, qn, kn, G, s2, 2, FAST_DIAG, tl.float32) + Cd2
        C3 = _col_grads(dPqT3, dPkT3, G3, qn, kn, G, s3, 3, FAST_DIAG, tl.float32) + Cd3
        Rq = _join4(Rq0, Rq1, Rq2, Rq3, K)
        Rk = _join4(Rk0, Rk1, Rk2, Rk3, K)
        Cc = _join4(C0, C1, C2, C3, K)

        eEnd = tl.exp(Gend[None, :] - G)
        Kd = kn * eEnd
        dqn = Rq + dQg * eG
        dkn = Rk + Cc + dKg * eG + dKd * eEnd
        dG = qn * Rq + kn * Rk - kn * Cc + dQg * qn * eG + dKg * Kg - dKd * Kd
        dGend = tl.sum(dKd * Kd, 0) + dgam * tl.exp(Gend)
        dga = tl.cumsum(dG, 0, reverse=True) + dGend[None, :]
        dga = tl.where(m_t[:, None], dga, 0.0)

        # gate activation
        graw = tl.load(g + pk, mask=m_t[:, None], other=0.0).to(tl.float32)
        bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
        z = graw + bias[None, :]
        if BOUNDED:
            s = tl.sigmoid(a * z)
            dz = dga * (lb * a) * s * (1.0 - s)
            dAl = tl.sum(tl.sum(dz * z, 1), 0)
        else:
            ga = _gate(graw, bias[None, :], a, lb, BOUNDED)
            dz = dga * (-a) * tl.sigmoid(z)
            dAl = tl.sum(tl.sum(dga * ga, 1), 0)
        tl.store(dg + pk, dz.to(dg.dtype.element_ty), mask=m_t[:, None])
        tl.store(dA_part + slot, dAl)
        tl.store(dbias_part + slot * K + o_k, tl.sum(dz, 0))

        # l2 norms and beta sigmoid
        nq = bq * rq[:, None]
        dnq = dqn * scale
        tl.store(dq + pk, (rq[:, None] * (dnq - nq * tl.sum(nq * dnq, 1)[:, None])).to(dq.dtype.element_ty),
                 mask=m_t[:, None])
        bk = tl.load(k + pk, mask=m_t[:, None], other=0.0).to(tl.float32)
        rk = tl.rsqrt(tl.sum(bk * bk, 1) + 1e-6)
        tl.store(dk + pk, (rk[:, None] * (dkn - kn * tl.sum(kn * dkn, 1)[:, None])).to(dk.dtype.element_ty),
                 mask=m_t[:, None])
        tl.store(dbeta + tok, db * bb * (1.0 - bb), mask=m_t)


def chunk_kda_bwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, cu_seqlens, do, dht):
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) of ``chunk_kda_fwd``'s (o, ht).

    dq/dk/dg/dbeta/dv come back in the inputs' dtypes, dA_log/ddt_bias fp32, dh0 fp32 (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    W, Qp, Kd, gam, hbuf, dbuf, _, (chunk_indices, chunk_offsets, NS, N) = chunk_kda_fwd(
        q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, False, cu_seqlens, for_backward=True)
    MMA = mm_dtype(v)
    if CONFIG["stop_after"] == "bwd_recompute":
        return None
    do = do.contiguous()
    dhbuf = torch.empty_like(hbuf)
    dh0 = torch.empty(N, H, K, V, device=q.device, dtype=torch.float32) if initial_state is not None else None
    BVs = min(V, 32)
    _scan_bwd_kernel[(triton.cdiv(V, BVs), N * H)](
        W, Qp, Kd, gam, do, dht, dh0, dhbuf, cu_seqlens, chunk_offsets, T, H=H, K=K, V=V, BV=BVs,
        IS_VARLEN=cu_seqlens is not None, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, MMA=MMA,
        num_warps=4, num_stages=2)
    if CONFIG["stop_after"] == "bwd_scan":
        return None
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    dA_part = torch.zeros(NS, H, device=q.device, dtype=torch.float32)
    dbias_part = torch.zeros(NS, H, K, device=q.device, dtype=torch.float32)
    BOUNDED = gate_lower_bound is not None
    _intra_bwd_kernel[(NS, H)](
        q, k, v, g, beta, A_log, dt_bias, W, Kd, hbuf, dbuf, dhbuf, do, dq, dk, dv, dg, dbeta, dA_part, dbias_part,
        cu_seqlens, chunk_indices, T, scale, float(gate_lower_bound) if BOUNDED else 0.0, H=H, K=K, V=V,
        BV=min(V, CONFIG["bwd_bv"]), IS_VARLEN=cu_seqlens is not None, BOUNDED=BOUNDED, FAST_DIAG=fast_diag(gate_lower_bound),
        MMA=MMA, DOT_PREC="tf32", num_warps=CONFIG["bwd_intra_warps"] or (8 if K >= 128 else 4), num_stages=1)
    dA_log = dA_part.sum(0).to(A_log.dtype)
    ddt = dbias_part.sum(0).reshape(-1).to(dt_bias.dtype)
    return dq, dk, dv, dg, dbeta, dA_log, ddt, dh0
