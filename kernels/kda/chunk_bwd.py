"""Chunked KDA backward: recompute, one reverse scan, three chunk-parallel kernels.

1. ``chunk_kda_fwd(..., for_backward=True)`` recomputes the chunk buffers from the forward's ``A_qk``, ``T`` and
   the rows' inverse L2 norms of q and k (the gated scores, the inverse and the norms are not redone; the kernels
   below load the norms too), the state ``h`` at every chunk start and ``delta = U - W h``.
2. ``_scan_bwd_kernel`` walks the chunks backwards per (sequence, head, V tile) with the fp32 state
   gradient ``dS`` in registers. Per chunk it stores ``dS`` (the gradient at the chunk END, in the storage dtype) and
   ``ddelta = A_qk^T dO + Kd dS``, then steps ``dS <- gamma * dS + Qg^T dO - W^T ddelta``.
3. ``_state_grads_kernel`` (per chunk, head and K slice) contracts the states over V: the direct
   gradients of q, k and G through ``Qg``, ``W`` and ``Kd`` (scratch: q's and k's in the storage dtype, G's in
   fp32; the gradient of ``G_end`` is added on the chunk's last row, where the reverse cumsum spreads it to every
   row; the last key's own term, of decay 1, is left out of both sides), and ``dW``.
   ``_wy_grads_kernel`` (per chunk and head): ``dv = (T diag(beta))^T ddelta``, ``dA_qk = dO delta^T``,
   the WY gradient ``dL = -T^T dT T^T`` (``L = diag(beta) A_kk``) and beta's column-side gradient.
4. ``_gate_grads_kernel`` (per chunk and head, over K in BK-wide slices) back-propagates ``dL`` and
   ``dA_qk`` through the gated scores with the forward's tile factors (``chunk_tiles.py``), then
   through the decay cumsum, the gate activation, the L2 norms and beta's sigmoid; it writes dq, dk,
   dg, dbeta and per-chunk partial sums of dA_log and ddt_bias. The row and column sides of every score
   gradient's pair term are formed from the same MMA-rounded operands, and the pairs of decay 1 (A_qk's diagonal)
   go to dq and dk only: in steep channels they are the largest terms, and a residual of their two sides would be
   multiplied by G in the cumsum's backward.
"""

import torch

from ..backend import tl, triton
from .chunk_fwd import chunk_kda_fwd, mm_dtype, scan_launch, storage_dtype
from .chunk_tiles import (BT, chunk_coords, chunk_decay, chunk_end, chunk_offsets64, column_factor, diagonal_grads,
                          fast_diag, gate, load_row_norms, scan_start, as_mma_reads, tile_ends, tile_references)

# Launch knobs, measured on an H200 (bf16, 16x4096x16; how and when: benchmarks/PERFORMANCE.md).
# gate_prec: the operands of the gate kernel's score-gradient products: "bf16" (bf16 for bf16 inputs, fp32 read as
#   tf32 otherwise), "tf32" or "tf32x3" (three tf32 products, about fp32). Both sides of every pair term are formed
#   from the same rounded operands (``_row_tile_grads``), so their chunk sum in dg is that of perturbed inputs at any
#   precision (until stop 12 it was not, and dg lost that precision: PERFORMANCE.md). Forward +
#   backward and the worst gate-side errors against the fp32 reference, dg / dA_log / ddt_bias (stop 12): "bf16"
#   19.17 ms, 4.1e-3 / 4.4e-3 / 3.8e-3; "tf32" 22.54 ms, 3.1e-3 / 3.5e-3 / 2.7e-3; "tf32x3" 31.71 ms, 2.9e-3 /
#   3.4e-3 / 2.5e-3 (fla 0.6.0: 15.32 ms, 3.9e-3 / 4.3e-3 / 4.7e-3).
# gate_warps None: 4 with bf16 operands (8: 14.16 -> 16.14 ms, and an illegal memory access with the softplus gate's
#   quarter tiles under triton 3.6, not investigated), 8 with fp32 ones (4 warps spill 1.2-2.6 KB).
#   gate_stages 2: its loads pipelined (15.86 -> 15.73 ms; 3: softplus 27.2 -> 28.3 ms). gate_bk 32: 32-wide K
#   slices where the gate's bound keeps every tile within DIAG_SPAN (16-wide: 14.16 -> 14.55 ms). safe_gate_bk, where
#   the kernel checks each slice's decay: 16 measured faster (softplus 25.67 -> 22.19 ms, at 4x16384x16 26.57 ->
#   23.00; spills 1456 -> 424 B) but has not yet run the GPU test module, so it stays 32.
# state_*: the products with the per-chunk states, one program per chunk and K slice, at 8 warps and 128 registers
#   without spilling (two programs per SM; one kernel doing the WY part too needed 255 and ran one: 23.44 -> 22.01 ms
#   for the split), V in one 128-wide pass (16.46 -> 16.05 ms). wy_*: the WY part, one program per chunk, its loads
#   pipelined 3 deep (14.51 -> 14.24 ms; 78 KB shared memory).
# scan_*: the reverse scan's V tile (None: ``chunk_fwd.scan_launch`` picks), warps and pipelining (3 deep, on top of
#   wy_stages 3: 14.24 -> 14.16 ms, at 4x16384x16 15.28 -> 15.01 ms).
# stop_after "recompute" / "scan" / "state": the backward ends after that stage (per-stage timing only).
CONFIG = dict(scan_bv=None, scan_warps=4, scan_stages=3, state_warps=8, state_bk=32, state_bv=128, state_stages=2,
              state_maxnreg=128, wy_warps=8, wy_bv=32, wy_stages=3, gate_warps=None, gate_bk=32, safe_gate_bk=32,
              gate_stages=2, gate_maxnreg=None, gate_prec="bf16", stop_after=None)


@triton.jit
def _scan_bwd_kernel(Wb, Qgb, Kdb, Aqb, gam, do, dht, dh0, dhbuf, ddbuf, cu_seqlens, chunk_offsets, T,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                     IS_VARLEN: tl.constexpr, HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr, MMA: tl.constexpr):
    i_h, bos, L, c_off, o_k, o_v, ps, dS = scan_start(dht, cu_seqlens, chunk_offsets, T, H, K, V, BV, IS_VARLEN,
                                                       HAS_DHT)
    o_c = tl.arange(0, BT)
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
def _state_grads_kernel(q, k, g, beta, A_log, dt_bias, do, Tb, Nb, hbuf, dhbuf, dbuf, ddbuf, dWb, kgb,
                        dqn_s, dkn_s, dG_s, cu_seqlens, chunk_indices, T, scale, lb,
                        H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr, MMA: tl.constexpr):
    """Per chunk, head and BK-wide slice of K: the direct gradients of q, k and G through ``Qg``, ``W`` and ``Kd``
    (contracting the states over V); ``dW`` and ``kg`` are stored as the operands of ``dW kg^T``, the rest of the
    gradient of ``T diag(beta)``, which ``_wy_grads_kernel`` contracts over K."""
    # the K slices of a chunk are neighbours in the launch order, so they share its dO / delta / ddelta tiles in L2
    i_k, i_p, i_h = tl.program_id(0) % (K // BK), tl.program_id(0) // (K // BK), tl.program_id(1)
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
        Aw = (tl.load(Tb + pT, mask=m_t, other=0.0).to(tl.float32) * bb[None, :]).to(MMA)
        rk, rq = load_row_norms(Nb, tok, m_r)
        rq = rq * scale

        o_k = i_k * BK + tl.arange(0, BK)
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
        # decay of this channel slice, computed as the forward computes it
        pk, _ = chunk_offsets64(bos, t0, L, i_h, o_k, H, K)
        _, G = chunk_decay(g, dt_bias, a, lb, pk, m_t, i_h, o_k, K, BOUNDED)
        Gend = chunk_end(G)
        eG = tl.exp(G)
        eK = tl.exp(Gend[None, :] - G)
        kn = tl.load(k + pk, mask=m_t, other=0.0).to(tl.float32) * rk[:, None]
        qn = tl.load(q + pk, mask=m_t, other=0.0).to(tl.float32) * rq[:, None]
        kg = kn * eG
        tl.store(dWb + pk, dW.to(dWb.dtype.element_ty), mask=m_t)
        tl.store(kgb + pk, kg.to(kgb.dtype.element_ty), mask=m_t)
        dkg = tl.dot(tl.trans(Aw), dW.to(MMA))
        last = (o_t == tl.minimum(t0 + BT, L) - 1)[:, None]  # the chunk's last row: where dG_end goes
        # row j's key term moves dG by -X_j at j and +X_j at the end; the last row's (decay 1) moves it by nothing
        X = tl.where(last, 0.0, dKd * kn * eK)
        dG = dQg * qn * eG + dkg * kg - X + tl.where(last, (tl.sum(X, 0) + dgam * tl.exp(Gend))[None, :], 0.0)
        tl.store(dqn_s + pk, (dQg * eG).to(dqn_s.dtype.element_ty), mask=m_t)
        tl.store(dkn_s + pk, (dkg * eG + dKd * eK).to(dkn_s.dtype.element_ty), mask=m_t)
        tl.store(dG_s + pk, dG, mask=m_t)


@triton.jit
def _wy_grads_kernel(beta, v, do, Tb, dbuf, ddbuf, dWb, kgb, dv, dLb, dAqb, dbeta_col, cu_seqlens, chunk_indices, T,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     IS_VARLEN: tl.constexpr, MMA: tl.constexpr, DOT_PREC: tl.constexpr):
    """Per chunk and head: ``dv = (T diag(beta))^T ddelta`` and ``dA_qk = dO delta^T`` (over V), the gradient of
    ``T diag(beta)``, ``ddelta v^T + dW kg^T`` (over V, then K), beta's column-side gradient and the WY gradient
    ``dL = -T^T dT T^T`` (``L = diag(beta) A_kk``)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
        o_c = tl.arange(0, BT)
        o_t = t0 + o_c
        m_r = o_t < L
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        bb = tl.where(m_r, tl.sigmoid(tl.load(beta + tok, mask=m_r, other=0.0).to(tl.float32)), 0.0)
        pT, m_t = chunk_offsets64(bos, t0, L, i_h, o_c, H, BT)
        Tm = tl.load(Tb + pT, mask=m_t, other=0.0).to(tl.float32)
        Aw = (Tm * bb[None, :]).to(MMA)
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
        for kb in range(0, K, BK):
            pk, _ = chunk_offsets64(bos, t0, L, i_h, kb + tl.arange(0, BK), H, K)
            bdW = tl.load(dWb + pk, mask=m_t, other=0.0).to(MMA)
            dAw = tl.dot(bdW, tl.trans(tl.load(kgb + pk, mask=m_t, other=0.0).to(MMA)), dAw)
        # Aw = T diag(beta): dT = dAw diag(beta), dbeta_j = sum_i dAw_ij T_ij; dL = -T^T dT T^T (strictly causal)
        tl.store(dbeta_col + tok, tl.sum(dAw * Tm, 0), mask=m_r)
        dT = dAw * bb[None, :]
        dL = -tl.dot(tl.dot(tl.trans(Tm), dT, input_precision=DOT_PREC), tl.trans(Tm), input_precision=DOT_PREC)
        dL = tl.where(o_c[None, :] < o_c[:, None], dL, 0.0)
        dAq = tl.where(o_c[None, :] <= o_c[:, None], dAq, 0.0)
        tl.store(dLb + pT, dL.to(dLb.dtype.element_ty), mask=m_t)
        tl.store(dAqb + pT, dAq.to(dAqb.dtype.element_ty), mask=m_t)


@triton.jit
def _row_tile_grads(rl, rq, C, E, dl, da, dlt, dat, kn, pb, pq, G, r, R: tl.constexpr, tile, diag, MMA: tl.constexpr,
                    PREC: tl.constexpr):
    """Row tile R's share of the score gradients, with the forward's factoring (``chunk_fwd._row_tile_scores``),
    before the row factors ``e^(G_i - r)``: rows of tile R: ``rl_i += sum_j dL_ij kc_j``, ``rq_i`` likewise with
    dA_qk, where ``kc_j = kn_j e^(r - G_j)``; columns: ``s_j = sum_{i in R} dL_ij pb_i + dA_ij pq_i``, added to
    ``C_j`` times ``e^(r - G_j)`` (for dk) and to ``E_j`` times ``kc_j`` (for dG).

    kc, pb and pq are rounded as the MMA reads them (``as_mma_reads``), so the row side ``pb_i dL_ij kc_j`` of a
    pair and its column side ``kc_j dL_ij pb_i`` are products of the same numbers: the gate gradient is that of
    slightly perturbed inputs, and the two sides cancel in its chunk sum up to the rounding of the sums they enter
    (which is why A_qk's diagonal, the pairs of decay 1, stays out of them). dl, da are dL and dA_qk as MMA
    operands (their pairs j < i), dlt, dat their transposes."""
    cf = column_factor(G, r, R, diag)
    kc = as_mma_reads(kn * cf, MMA, PREC)
    col = kc.to(MMA)
    own = (tile == R)[:, None]
    zero = tl.zeros_like(rl)
    rl = tl.where(own, tl.dot(dl, col, zero, input_precision=PREC), rl)
    rq = tl.where(own, tl.dot(da, col, zero, input_precision=PREC), rq)
    s = tl.dot(dlt, tl.where(own, pb, 0.0).to(MMA), tl.dot(dat, tl.where(own, pq, 0.0).to(MMA), zero,
                                                             input_precision=PREC), input_precision=PREC)
    return rl, rq, C + cf * s, E + kc * s


@triton.jit
def _gate_back(dga, z, a, lb, BOUNDED: tl.constexpr):
    """The gate's backward: (dz, the dA_log term) from the decay gradient dga at logits z = g + dt_bias."""
    if BOUNDED:
        s = tl.sigmoid(a * z)
        dz = dga * (lb * a) * s * (1.0 - s)
        dal = dz * z
    else:
        dz = dga * (-a) * tl.sigmoid(z)
        dal = dga * gate(z, 0.0, a, lb, BOUNDED)
    return dz, dal


@triton.jit
def _gate_grads_kernel(q, k, g, beta, A_log, dt_bias, Nb, dLb, dAqb, dbeta_col, dqn_s, dkn_s, dG_s,
                       dq, dk, dg, dbeta, dA_part, dbias_part, cu_seqlens, chunk_indices, T, scale, lb,
                       H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                       BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr, PREC: tl.constexpr):
    """Per chunk and head (step 4 of the module docstring): the score gradients dL / dA_qk through the gated scores,
    one BK-wide K slice at a time, then the decay cumsum, the gate, beta's sigmoid and, once rho sums over all of K,
    the L2 norms."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        slot = (i_p * H + i_h).to(tl.int64)
        o_t = tl.arange(0, BT)
        tile = o_t // 16
        m_r = t0 + o_t < L
        tok = ((bos + t0 + o_t) * H + i_h).to(tl.int64)
        rk, rq = load_row_norms(Nb, tok, m_r)
        b = tl.sigmoid(tl.load(beta + tok, mask=m_r, other=0.0).to(tl.float32))
        pm, mm = chunk_offsets64(bos, t0, L, i_h, o_t, H, BT)
        pairs = mm & (o_t[None, :] < o_t[:, None])  # j < i: the pairs whose decay moves dG
        dlm = tl.load(dLb + pm, mask=pairs, other=0.0).to(MMA)  # stored as MMA (the wy kernel)
        dam = tl.load(dAqb + pm, mask=pairs, other=0.0).to(MMA)
        d_ii = tl.load(dAqb + tok * BT + o_t, mask=m_r, other=0.0).to(tl.float32)[:, None]  # A_qk's diagonal
        dlt, dat = tl.trans(dlm), tl.trans(dam)

        db = tl.zeros((BT,), dtype=tl.float32)
        rho_k = tl.zeros((BT,), dtype=tl.float32)
        rho_q = tl.zeros((BT,), dtype=tl.float32)
        dal = tl.zeros((BT,), dtype=tl.float32)  # dA_log's terms, summed over K per row (a row sum stays in a warp)
        for kb in range(0, K, BK):
            o_k = kb + tl.arange(0, BK)
            pk, mk = chunk_offsets64(bos, t0, L, i_h, o_k, H, K)
            z, G = chunk_decay(g, dt_bias, a, lb, pk, mk, i_h, o_k, K, BOUNDED)
            c1, c2, c3, c4 = tile_ends(G)
            kn = tl.load(k + pk, mask=mk, other=0.0).to(tl.float32) * rk[:, None]
            qn = tl.load(q + pk, mask=mk, other=0.0).to(tl.float32) * (rq * scale)[:, None]
            bk = kn * b[:, None]
            diag, r0, r1, r2, r3, f = tile_references(G, c1, c2, c3, c4, FAST_DIAG)  # the forward's factoring
            pb = as_mma_reads(bk * f, MMA, PREC)
            pq = as_mma_reads(qn * f, MMA, PREC)
            rl = tl.zeros((BT, BK), dtype=tl.float32)
            rqs = tl.zeros((BT, BK), dtype=tl.float32)
            C = tl.zeros((BT, BK), dtype=tl.float32)
            E = tl.zeros((BT, BK), dtype=tl.float32)
            rl, rqs, C, E = _row_tile_grads(rl, rqs, C, E, dlm, dam, dlt, dat, kn, pb, pq, G, r0, 0, tile,
                                            diag, MMA, PREC)
            rl, rqs, C, E = _row_tile_grads(rl, rqs, C, E, dlm, dam, dlt, dat, kn, pb, pq, G, r1, 1, tile,
                                            diag, MMA, PREC)
            rl, rqs, C, E = _row_tile_grads(rl, rqs, C, E, dlm, dam, dlt, dat, kn, pb, pq, G, r2, 2, tile,
                                            diag, MMA, PREC)
            rl, rqs, C, E = _row_tile_grads(rl, rqs, C, E, dlm, dam, dlt, dat, kn, pb, pq, G, r3, 3, tile,
                                            diag, MMA, PREC)
            # the decay gradient from the GEMM tiles, every pair term as the MMA formed it (see _row_tile_grads)
            dG = pb * rl + pq * rqs - E + tl.load(dG_s + pk, mask=mk, other=0.0)
            rl = rl * f
            rqs = rqs * f
            if not diag:
                rl, rqs, C, dG = diagonal_grads(rl, rqs, C, dG, dLb, dAqb, pm, pairs, k, Nb, tok, o_k, L - t0, kn, bk,
                                                qn, G, H, K, MMA, PREC)
            # the pairs i = j (decay 1, the largest pair terms in a steep channel) move dG by nothing. As a row and a
            # column sum their two sides would round differently, and the decay cumsum's backward multiplies that
            # residual by G (~ -1e3 in steep channels): they join dq and dk only
            rqs += d_ii * kn
            C += d_ii * qn
            # totals: the score terms plus the direct terms the state kernel left in scratch
            dkn = b[:, None] * rl + C + tl.load(dkn_s + pk, mask=mk, other=0.0).to(tl.float32)
            dqn = rqs + tl.load(dqn_s + pk, mask=mk, other=0.0).to(tl.float32)
            db += tl.sum(kn * rl, 1)
            rho_k += tl.sum(kn * dkn, 1)
            rho_q += tl.sum(qn * dqn, 1)
            # the totals replace the direct terms in scratch; the norm backward reads them once rho is complete
            tl.store(dkn_s + pk, dkn.to(dkn_s.dtype.element_ty), mask=mk)
            tl.store(dqn_s + pk, dqn.to(dqn_s.dtype.element_ty), mask=mk)
            # decay cumsum backward (dG_end already sits on the last row), then the gate's
            dz, dal_t = _gate_back(tl.where(mk, tl.cumsum(dG, 0, reverse=True), 0.0), z, a, lb, BOUNDED)
            dz = tl.where(mk, dz, 0.0)
            tl.store(dg + pk, dz.to(dg.dtype.element_ty), mask=mk)
            dal += tl.sum(tl.where(mk, dal_t, 0.0), 1)
            tl.store(dbias_part + slot * K + o_k, tl.sum(dz, 0))
        tl.store(dA_part + slot, tl.sum(dal, 0))
        # beta: column side (from the state kernel) + row side sum_d kn dL-row, through the sigmoid
        dbc = tl.load(dbeta_col + tok, mask=m_r, other=0.0)
        tl.store(dbeta + tok, ((dbc + db) * b * (1.0 - b)).to(dbeta.dtype.element_ty), mask=m_r)
        tl.debug_barrier()  # the scratch totals above were written by other threads of this program
        # L2 norms: dx = r (s dxn - n rho) for xn = s x r, n = x r, rho = sum_d xn dxn
        for kb in range(0, K, BK):
            pk, mk = chunk_offsets64(bos, t0, L, i_h, kb + tl.arange(0, BK), H, K)
            nk = tl.load(k + pk, mask=mk, other=0.0).to(tl.float32) * rk[:, None]
            dkn = tl.load(dkn_s + pk, mask=mk, other=0.0).to(tl.float32)
            tl.store(dk + pk, (rk[:, None] * (dkn - nk * rho_k[:, None])).to(dk.dtype.element_ty), mask=mk)
            nq = tl.load(q + pk, mask=mk, other=0.0).to(tl.float32) * rq[:, None]
            dqn = tl.load(dqn_s + pk, mask=mk, other=0.0).to(tl.float32)
            tl.store(dq + pk, (rq[:, None] * (scale * dqn - nq * rho_q[:, None])).to(dq.dtype.element_ty), mask=mk)


def chunk_kda_bwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, cu_seqlens, do, dht,
                  scores=None):
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) of ``chunk_kda_fwd``'s (o, ht); ``scores``: the
    forward's ``(A_qk, T, norms)`` (``keep_scores``), or None to recompute them.

    dq/dk/dg/dbeta/dv come back in the inputs' dtypes, dA_log/ddt_bias fp32, dh0 fp32 (or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    fb = chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, False, cu_seqlens,
                       scores=scores, for_backward=True)
    NS, N, chunk_indices, chunk_offsets = fb["NS"], fb["N"], fb["chunk_indices"], fb["chunk_offsets"]
    MMA = mm_dtype(v)
    IS_VARLEN = cu_seqlens is not None
    BOUNDED = gate_lower_bound is not None
    lb = float(gate_lower_bound) if BOUNDED else 0.0
    if CONFIG["stop_after"] == "recompute":
        return None
    do = do.contiguous()
    sd = storage_dtype(v)
    # every buffer is dropped after its last kernel, so that the caching allocator hands its memory to the next ones
    dhbuf = torch.empty_like(fb["h"], dtype=sd)  # per-chunk state gradients, in the storage dtype
    ddbuf = torch.empty_like(fb["delta"])
    dh0 = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if initial_state is not None else None
    BVs, stages = scan_launch(V, N * H, sd, CONFIG["scan_bv"], CONFIG["scan_stages"])
    _scan_bwd_kernel[(triton.cdiv(V, BVs), N * H)](
        fb["W"], fb["Qg"], fb["Kd"], fb["Aqk"], fb["gam"], do, dht, dh0, dhbuf, ddbuf, cu_seqlens, chunk_offsets, T,
        H=H, K=K, V=V, BV=BVs, IS_VARLEN=IS_VARLEN, HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, MMA=MMA,
        num_warps=CONFIG["scan_warps"], num_stages=stages)
    del fb["W"], fb["Qg"], fb["Kd"], fb["Aqk"], fb["gam"]
    if CONFIG["stop_after"] == "scan":
        return None
    BK = min(K, CONFIG["state_bk"])
    dW = torch.empty(B, T, H, K, device=dev, dtype=sd)  # the operands of dW kg^T, as the MMA takes them
    kg = torch.empty_like(dW)
    # the direct dq / dk terms (then the totals) in the storage dtype; the decay's stays fp32: dt_bias's gradient sums
    # it over every token, and bf16 there took ddt_bias to 1.5e-2 (4x4096x16, against 3.6e-3)
    dqn_s = torch.empty(B, T, H, K, device=dev, dtype=sd)
    dkn_s = torch.empty_like(dqn_s)
    dG_s = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    _state_grads_kernel[(NS * (K // BK), H)](
        q, k, g, beta, A_log, dt_bias, do, fb["T"], fb["norms"], fb["h"], dhbuf, fb["delta"], ddbuf, dW, kg,
        dqn_s, dkn_s, dG_s, cu_seqlens, chunk_indices, T, scale, lb, H=H, K=K, V=V, BK=BK,
        BV=min(V, CONFIG["state_bv"]), IS_VARLEN=IS_VARLEN, BOUNDED=BOUNDED, MMA=MMA, num_warps=CONFIG["state_warps"],
        num_stages=CONFIG["state_stages"], maxnreg=CONFIG["state_maxnreg"])
    del fb["h"], dhbuf
    gate_prec = CONFIG["gate_prec"]
    if gate_prec not in ("bf16", "tf32", "tf32x3"):
        raise ValueError(f'chunk_bwd.CONFIG["gate_prec"] must be "bf16", "tf32" or "tf32x3", got {gate_prec!r}.')
    gate_mma = MMA if gate_prec == "bf16" else tl.float32
    dv = torch.empty_like(v)
    # dL and dA_qk in the gate kernel's operand dtype: bf16 ones feed its tensor cores straight from shared memory
    dL = torch.empty(B, T, H, BT.value, device=dev, dtype=torch.bfloat16 if gate_mma == tl.bfloat16 else torch.float32)
    dAq = torch.empty_like(dL)
    dbeta_col = torch.empty(B, T, H, device=dev, dtype=torch.float32)
    _wy_grads_kernel[(NS, H)](
        beta, v, do, fb["T"], fb["delta"], ddbuf, dW, kg, dv, dL, dAq, dbeta_col, cu_seqlens, chunk_indices, T,
        H=H, K=K, V=V, BK=BK, BV=min(V, CONFIG["wy_bv"]), IS_VARLEN=IS_VARLEN, MMA=MMA, DOT_PREC="tf32",
        num_warps=CONFIG["wy_warps"], num_stages=CONFIG["wy_stages"])
    del fb["T"], fb["delta"], ddbuf, dW, kg
    if CONFIG["stop_after"] == "state":
        return None
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dg = torch.empty_like(g)
    dbeta = torch.empty_like(beta)
    dA_part = torch.zeros(NS, H, device=dev, dtype=torch.float32)
    dbias_part = torch.zeros(NS, H, K, device=dev, dtype=torch.float32)
    FAST_DIAG = fast_diag(gate_lower_bound)
    _gate_grads_kernel[(NS, H)](
        q, k, g, beta, A_log, dt_bias, fb["norms"], dL, dAq, dbeta_col, dqn_s, dkn_s, dG_s, dq, dk, dg, dbeta,
        dA_part, dbias_part, cu_seqlens, chunk_indices, T, scale, lb, H=H, K=K,
        BK=min(K, CONFIG["gate_bk" if FAST_DIAG else "safe_gate_bk"]), IS_VARLEN=IS_VARLEN, BOUNDED=BOUNDED,
        FAST_DIAG=FAST_DIAG, MMA=gate_mma, PREC="tf32" if gate_prec == "bf16" else gate_prec,
        num_warps=CONFIG["gate_warps"] or (8 if gate_mma == tl.float32 else 4), num_stages=CONFIG["gate_stages"],
        maxnreg=CONFIG["gate_maxnreg"])
    dA_log = dA_part.sum(0).to(A_log.dtype)
    ddt = dbias_part.sum(0).reshape(-1).to(dt_bias.dtype)
    return dq, dk, dv, dg, dbeta, dA_log, ddt, dh0
