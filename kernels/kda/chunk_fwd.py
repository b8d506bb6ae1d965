"""Chunked KDA forward: two Triton kernels.

``_intra_kernel`` (one program per 64-token chunk and head, fully parallel) fuses the gate
activation, the in-chunk cumulative decay ``G``, the q/k L2 norm, q's scale and beta's sigmoid, then
builds the chunk's WY form and writes, in the storage dtype (bf16 for bf16 inputs, else fp32):

* ``W  = T diag(beta) (k * exp(G))``, ``U = T diag(beta) v`` with ``T = (I + A_kk)^-1``,
* ``Qp = q * exp(G) - A_qk W`` and ``Oi = A_qk U`` (the output folded so the scan needs no ``A_qk``),
* ``Kd = k * exp(G_end - G)`` and ``gamma = exp(G_end)`` (fp32, one row per chunk).

``_scan_kernel`` (one program per sequence, head and V tile) walks the chunks in order with the
fp32 state ``S [K, BV]`` in registers: ``delta = U - W S``, ``o = Oi + Qp S``,
``S <- gamma * S + Kd^T delta``. The backward reuses it to store ``S`` per chunk and ``delta``.

Decay inside a chunk is only ever formed as a product of two factors that cannot overflow: per
16-row tile ``r`` a reference ``c_r`` splits ``exp(G_i - G_j) = exp(G_i - c_r) exp(c_r - G_j)``.
With the bounded gate (``g >= lower_bound >= -5.9``) ``c_r`` is the tile's mid decay, so every
factor is within ``exp(8 * 5.9)`` and the whole causal row tile, diagonal 16x16 block included, is
one tensor-core ``tl.dot``. The unbounded softplus gate uses ``c_r`` = decay at the tile start
(factors <= 1) for the blocks left of the diagonal and a per-column loop on the diagonal block.
"""

import torch
import triton
import triton.language as tl

BT = 64  # chunk length
BC = 16  # sub-tile rows
SAFE_LOWER_BOUND = 5.9  # |gate_lower_bound| up to which the diagonal tiles are dense GEMMs
# launch knobs (benchmarks/kda.py times the alternatives); None = the default heuristic.
# stop_after: "intra" / "bwd_recompute" / "bwd_scan" end a pipeline early (for per-stage timing only).
CONFIG = dict(intra_warps=None, scan_warps=4, scan_bv=None, bwd_intra_warps=None, bwd_bv=32, stop_after=None)


@triton.jit
def _gate(graw, bias, a, lb, BOUNDED: tl.constexpr):
    """log decay from raw logits (fp32): lb*sigmoid(a z) or -a*softplus(z), z = graw + bias."""
    z = graw + bias
    if BOUNDED:
        ga = lb * tl.sigmoid(a * z)
    else:
        ez = tl.exp(tl.minimum(z, 20.0))
        sp = tl.where(z > 20.0, z, tl.where(z < -15.0, ez, tl.log(1.0 + ez)))
        ga = -a * sp
    return ga


@triton.jit
def _join4(x0, x1, x2, x3, N: tl.constexpr):
    """Stack four [16, N] row tiles into [64, N]."""
    x = tl.join(tl.join(x0, x1), tl.join(x2, x3))  # [16, N, 2(lo), 2(hi)]
    x = tl.permute(x, (3, 2, 0, 1))  # [2(hi), 2(lo), 16, N]
    return tl.reshape(x, (64, N))


@triton.jit
def _split4(x, N: tl.constexpr):
    """Inverse of _join4: [64, N] -> four [16, N] row tiles."""
    x = tl.reshape(x, (2, 2, 16, N))  # [hi, lo, 16, N]
    x = tl.permute(x, (2, 3, 1, 0))  # [16, N, lo, hi]
    a, b = tl.split(x)  # tl.split takes the last axis: hi = 0, 1 -> [16, N, lo]
    x0, x1 = tl.split(a)
    x2, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _ref(carry_r, carry_r1, FAST_DIAG: tl.constexpr):
    """Per-tile decay reference: tile mid (bounded gate) or tile start (unbounded)."""
    if FAST_DIAG:
        c = 0.5 * (carry_r + carry_r1)
    else:
        c = carry_r
    return c


@triton.jit
def _col_factor(kn, G, c, R: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    """Column operand of row tile R: k_j * exp(c - G_j) on the columns it may touch, else 0. [64, K]"""
    o_t = tl.arange(0, 64)
    if FAST_DIAG:
        ok = o_t < 16 * (R + 1)
    else:
        ok = o_t < 16 * R
    return (kn * tl.exp(tl.where(ok[:, None], c[None, :] - G, float("-inf")))).to(MMA)


@triton.jit
def _a_rows(qn_r, kn_r, G_r, Y, c, R: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr):
    """Row tile R of A_kk (raw: without beta, strictly causal) and A_qk (causal), [16, 64] fp32."""
    rowf = tl.exp(G_r - c[None, :])
    o_i = tl.arange(0, 16)
    o_j = tl.arange(0, 64)
    akk = tl.dot((kn_r * rowf).to(MMA), tl.trans(Y))
    aqk = tl.dot((qn_r * rowf).to(MMA), tl.trans(Y))
    if not FAST_DIAG:
        # safe diagonal block: one column at a time, decay exp(G_i - G_j) <= 1 formed directly
        for jj in range(16):
            sel = (o_i == jj)[:, None]
            kj = tl.sum(tl.where(sel, kn_r, 0.0), 0)
            Gj = tl.sum(tl.where(sel, G_r, 0.0), 0)
            e = tl.exp(tl.where((o_i >= jj)[:, None], G_r - Gj[None, :], float("-inf"))) * kj[None, :]
            colsel = (o_j == R * 16 + jj)[None, :]
            akk = tl.where(colsel, tl.sum(kn_r * e, 1)[:, None], akk)
            aqk = tl.where(colsel, tl.sum(qn_r * e, 1)[:, None], aqk)
    row = R * 16 + o_i[:, None]
    akk = tl.where(o_j[None, :] < row, akk, 0.0)
    aqk = tl.where(o_j[None, :] <= row, aqk, 0.0)
    return akk, aqk


@triton.jit
def _diag_block(a_r, R: tl.constexpr):
    """The 16x16 diagonal block of a [16, 64] row tile."""
    a3 = tl.reshape(a_r, (16, 4, 16))
    blk = tl.arange(0, 4)[None, :, None]
    return tl.sum(tl.where(blk == R, a3, 0.0), 1)


@triton.jit
def _inverse(A, d0, d1, d2, d3, bb, DOT_PREC: tl.constexpr):
    """T = (I + A)^-1 for strictly lower-triangular A [64, 64] (fp32), given its diagonal blocks.

    The four 16x16 diagonal blocks are inverted together by forward substitution; with
    D = blockdiag, L = A - D and M = (I + D)^-1 L (nilpotent of order 4):
    T = (I - M + M^2 - M^3) (I + D)^-1."""
    D = tl.reshape(tl.permute(tl.join(tl.join(d0, d1), tl.join(d2, d3)), (3, 2, 0, 1)), (4, 16, 16))
    D = D * tl.reshape(bb, (4, 16))[:, :, None]  # rows scaled by beta
    o_i = tl.arange(0, 16)
    i3 = o_i[None, :, None]
    j3 = o_i[None, None, :]
    X = tl.where(i3 == j3, 1.0, 0.0) + tl.zeros((4, 16, 16), dtype=tl.float32)
    for i in range(1, 16):
        d_i = tl.sum(tl.where(i3 == i, D, 0.0), 1)  # [4, 16] row i of each block
        new = tl.where(o_i[None, :] == i, 1.0, 0.0) - tl.sum(d_i[:, :, None] * X, 1)
        X = tl.where(i3 == i, new[:, None, :], X)
    b4 = tl.arange(0, 4)
    Dinv = tl.where(b4[:, None, None, None] == b4[None, None, :, None], X[:, :, None, :], 0.0)
    Dinv = tl.reshape(Dinv, (64, 64))
    o_t = tl.arange(0, 64)
    Lm = tl.where((o_t[:, None] // 16) > (o_t[None, :] // 16), A, 0.0)
    M = tl.dot(Dinv, Lm, input_precision=DOT_PREC)
    M2 = tl.dot(M, M, input_precision=DOT_PREC)
    M3 = tl.dot(M, M2, input_precision=DOT_PREC)
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    return tl.dot(eye - M + M2 - M3, Dinv, input_precision=DOT_PREC)


@triton.jit
def _g_tiles(g, dt_bias, a, lb, bos, t0, L, i_h, H: tl.constexpr, K: tl.constexpr, BOUNDED: tl.constexpr):
    """Inclusive in-chunk decay cumsum as four [16, K] tiles plus the carries into tiles 1..3 and the
    chunk total. The full [64, K] G is always the join of these tiles, so every factorised product
    exp(G_i - c) exp(c - G_j) sees bit-identical G values in the forward and the backward."""
    o_k = tl.arange(0, K)
    bias = tl.load(dt_bias + i_h * K + o_k).to(tl.float32)
    o_r = t0 + tl.arange(0, 16)
    p = ((bos + o_r) * H + i_h).to(tl.int64)[:, None] * K + o_k[None, :]
    ga0 = tl.where((o_r < L)[:, None], _gate(tl.load(g + p, mask=(o_r < L)[:, None], other=0.0).to(tl.float32),
                                             bias[None, :], a, lb, BOUNDED), 0.0)
    ga1 = tl.where((o_r + 16 < L)[:, None], _gate(tl.load(g + p + 16 * H * K, mask=(o_r + 16 < L)[:, None],
                                                          other=0.0).to(tl.float32), bias[None, :], a, lb, BOUNDED), 0.0)
    ga2 = tl.where((o_r + 32 < L)[:, None], _gate(tl.load(g + p + 32 * H * K, mask=(o_r + 32 < L)[:, None],
                                                          other=0.0).to(tl.float32), bias[None, :], a, lb, BOUNDED), 0.0)
    ga3 = tl.where((o_r + 48 < L)[:, None], _gate(tl.load(g + p + 48 * H * K, mask=(o_r + 48 < L)[:, None],
                                                          other=0.0).to(tl.float32), bias[None, :], a, lb, BOUNDED), 0.0)
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
def _qk_tile(q, k, scale, bos, t0, L, i_h, H: tl.constexpr, K: tl.constexpr, R: tl.constexpr):
    """l2-normed (scaled) q and l2-normed k of row tile R, fp32 [16, K]."""
    o_r = t0 + R * 16 + tl.arange(0, 16)
    m_r = (o_r < L)[:, None]
    p = ((bos + o_r) * H + i_h).to(tl.int64)[:, None] * K + tl.arange(0, K)[None, :]
    bq = tl.load(q + p, mask=m_r, other=0.0).to(tl.float32)
    bk = tl.load(k + p, mask=m_r, other=0.0).to(tl.float32)
    return bq * (tl.rsqrt(tl.sum(bq * bq, 1) + 1e-6) * scale)[:, None], bk * tl.rsqrt(tl.sum(bk * bk, 1) + 1e-6)[:, None]


@triton.jit
def _load_full(x, bos, t0, L, i_h, H: tl.constexpr, K: tl.constexpr):
    o_t = t0 + tl.arange(0, 64)
    m_t = o_t < L
    p = ((bos + o_t) * H + i_h).to(tl.int64)[:, None] * K + tl.arange(0, K)[None, :]
    return tl.load(x + p, mask=m_t[:, None], other=0.0).to(tl.float32)


@triton.jit
def _chunk_intra(q, k, g, beta, dt_bias, a, lb, scale, bos, t0, L, i_h,
                 H: tl.constexpr, K: tl.constexpr, BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr,
                 MMA: tl.constexpr, DOT_PREC: tl.constexpr):
    """Everything about one chunk that does not depend on the state (fp32): kn [64, K], beta [64],
    G (inclusive cumsum of the gate) [64, K], G_end [K], A_kk raw (no beta), A_qk and T [64, 64].
    Row tiles are re-loaded one at a time (cache hits) so that only one tile set is live."""
    o_t = t0 + tl.arange(0, 64)
    m_t = o_t < L
    bk = _load_full(k, bos, t0, L, i_h, H, K)
    kn = bk * tl.rsqrt(tl.sum(bk * bk, 1) + 1e-6)[:, None]
    bb = tl.load(beta + ((bos + o_t) * H + i_h).to(tl.int64), mask=m_t, other=0.0).to(tl.float32)
    bb = tl.where(m_t, tl.sigmoid(bb), 0.0)

    G0, G1, G2, G3, c1, c2, c3, c4 = _g_tiles(g, dt_bias, a, lb, bos, t0, L, i_h, H, K, BOUNDED)
    G = _join4(G0, G1, G2, G3, K)
    Gend = c4
    r = _ref(tl.zeros_like(c1), c1, FAST_DIAG)
    qn_r, kn_r = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 0)
    akk0, aqk0 = _a_rows(qn_r, kn_r, G0, _col_factor(kn, G, r, 0, FAST_DIAG, MMA), r, 0, FAST_DIAG, MMA)
    r = _ref(c1, c2, FAST_DIAG)
    qn_r, kn_r = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 1)
    akk1, aqk1 = _a_rows(qn_r, kn_r, G1, _col_factor(kn, G, r, 1, FAST_DIAG, MMA), r, 1, FAST_DIAG, MMA)
    r = _ref(c2, c3, FAST_DIAG)
    qn_r, kn_r = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 2)
    akk2, aqk2 = _a_rows(qn_r, kn_r, G2, _col_factor(kn, G, r, 2, FAST_DIAG, MMA), r, 2, FAST_DIAG, MMA)
    r = _ref(c3, c4, FAST_DIAG)
    qn_r, kn_r = _qk_tile(q, k, scale, bos, t0, L, i_h, H, K, 3)
    akk3, aqk3 = _a_rows(qn_r, kn_r, G3, _col_factor(kn, G, r, 3, FAST_DIAG, MMA), r, 3, FAST_DIAG, MMA)
    Akk = _join4(akk0, akk1, akk2, akk3, 64)
    Aqk = _join4(aqk0, aqk1, aqk2, aqk3, 64)
    Tm = _inverse(bb[:, None] * Akk, _diag_block(akk0, 0), _diag_block(akk1, 1), _diag_block(akk2, 2),
                  _diag_block(akk3, 3), bb, DOT_PREC)
    return kn, bb, G, Gend, Akk, Aqk, Tm


@triton.jit
def _chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN: tl.constexpr):
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
def _intra_kernel(q, k, v, g, beta, A_log, dt_bias, Wb, Ub, Qpb, Kdb, Oib, gam, cu_seqlens, chunk_indices,
                  T, scale, lb, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                  IS_VARLEN: tl.constexpr, BOUNDED: tl.constexpr, FAST_DIAG: tl.constexpr,
                  MMA: tl.constexpr, DOT_PREC: tl.constexpr, STORE_OI: tl.constexpr):
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = _chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if ok:
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        kn, bb, G, Gend, Akk, Aqk, Tm = _chunk_intra(
            q, k, g, beta, dt_bias, a, lb, scale, bos, t0, L, i_h, H, K, BOUNDED, FAST_DIAG, MMA, DOT_PREC)
        bq = _load_full(q, bos, t0, L, i_h, H, K)
        qn = bq * (tl.rsqrt(tl.sum(bq * bq, 1) + 1e-6) * scale)[:, None]
        o_t = t0 + tl.arange(0, 64)
        m_t = o_t < L
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        o_k = tl.arange(0, K)
        eG = tl.exp(G)
        Tmm = Tm.to(MMA)
        Aqm = Aqk.to(MMA)
        Wm = tl.dot(Tmm, (bb[:, None] * kn * eG).to(MMA))
        Qp = qn * eG - tl.dot(Aqm, Wm.to(MMA))
        Kd = kn * tl.exp(Gend[None, :] - G)
        pk = tok[:, None] * K + o_k[None, :]
        tl.store(Wb + pk, Wm.to(Wb.dtype.element_ty), mask=m_t[:, None])
        tl.store(Qpb + pk, Qp.to(Qpb.dtype.element_ty), mask=m_t[:, None])
        tl.store(Kdb + pk, Kd.to(Kdb.dtype.element_ty), mask=m_t[:, None])
        tl.store(gam + (i_p * H + i_h).to(tl.int64) * K + o_k, tl.exp(Gend))
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            pv = tok[:, None] * V + o_v[None, :]
            bv = tl.load(v + pv, mask=m_t[:, None], other=0.0).to(tl.float32)
            bu = tl.dot(Tmm, (bb[:, None] * bv).to(MMA))
            tl.store(Ub + pv, bu.to(Ub.dtype.element_ty), mask=m_t[:, None])
            if STORE_OI:
                tl.store(Oib + pv, tl.dot(Aqm, bu.to(MMA)).to(Oib.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _seq_coords(cu_seqlens, chunk_offsets, i_n, T, IS_VARLEN: tl.constexpr):
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        L = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
        c_off = tl.load(chunk_offsets + i_n).to(tl.int32)
    else:
        bos = i_n * T
        L = T
        c_off = i_n * tl.cdiv(T, 64)
    return bos, L, c_off


@triton.jit
def _scan_kernel(Wb, Ub, Qpb, Kdb, Oib, gam, o, h0, ht, hbuf, dbuf, cu_seqlens, chunk_offsets, T,
                 H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 IS_VARLEN: tl.constexpr, HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
                 STORE_H: tl.constexpr, STORE_D: tl.constexpr, WRITE_O: tl.constexpr, MMA: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, L, c_off = _seq_coords(cu_seqlens, chunk_offsets, i_n, T, IS_VARLEN)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    ps = (i_nh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + ps).to(tl.float32)
    else:
        S = tl.zeros((K, BV), dtype=tl.float32)
    for i_c in range(tl.cdiv(L, 64)):
        slot = (c_off + i_c).to(tl.int64)
        if STORE_H:
            tl.store(hbuf + ((slot * H + i_h) * K + o_k)[:, None] * V + o_v[None, :], S.to(hbuf.dtype.element_ty))
        o_t = i_c * 64 + tl.arange(0, 64)
        m_t = (o_t < L)[:, None]
        tok = ((bos + o_t) * H + i_h).to(tl.int64)
        pk = tok[:, None] * K + o_k[None, :]
        pv = tok[:, None] * V + o_v[None, :]
        bw = tl.load(Wb + pk, mask=m_t, other=0.0).to(MMA)
        bkd = tl.load(Kdb + pk, mask=m_t, other=0.0).to(MMA)
        bu = tl.load(Ub + pv, mask=m_t, other=0.0).to(tl.float32)
        Sm = S.to(MMA)
        delta = bu - tl.dot(bw, Sm)
        if STORE_D:
            tl.store(dbuf + pv, delta.to(dbuf.dtype.element_ty), mask=m_t)
        if WRITE_O:
            bqp = tl.load(Qpb + pk, mask=m_t, other=0.0).to(MMA)
            boi = tl.load(Oib + pv, mask=m_t, other=0.0).to(tl.float32)
            tl.store(o + pv, (boi + tl.dot(bqp, Sm)).to(o.dtype.element_ty), mask=m_t)
        gm = tl.load(gam + (slot * H + i_h) * K + o_k)
        S = S * gm[:, None] + tl.dot(tl.trans(bkd), delta.to(MMA))
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


def fast_diag(gate_lower_bound) -> bool:
    return gate_lower_bound is not None and -gate_lower_bound <= SAFE_LOWER_BOUND


def chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, output_final_state,
                  cu_seqlens, *, for_backward=False):
    """Launch the forward. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H] (raw logits).

    Returns (o [B, T, H, V] in v.dtype, final_state fp32 or None). With ``for_backward`` it skips o
    and instead returns the buffers the backward needs: (W, Qp, Kd, gamma, h per chunk, delta)."""
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
    Qp = torch.empty_like(W)
    Kd = torch.empty_like(W)
    U = torch.empty(B, T, H, V, device=dev, dtype=sd)
    Oi = None if for_backward else torch.empty(B, T, H, V, device=dev, dtype=torch.float32)  # fp32: one rounding less
    gam = torch.empty(NS, H, K, device=dev, dtype=torch.float32)
    BOUNDED = gate_lower_bound is not None
    lb = float(gate_lower_bound) if BOUNDED else 0.0
    BV = min(V, 64)
    _intra_kernel[(NS, H)](
        q, k, v, g, beta, A_log, dt_bias, W, U, Qp, Kd, Oi if Oi is not None else U, gam, cu_seqlens, chunk_indices,
        T, scale, lb, H=H, K=K, V=V, BV=BV, IS_VARLEN=cu_seqlens is not None, BOUNDED=BOUNDED,
        FAST_DIAG=fast_diag(gate_lower_bound), MMA=MMA, DOT_PREC="tf32", STORE_OI=not for_backward,
        num_warps=CONFIG["intra_warps"] or (8 if K >= 128 else 4), num_stages=1)
    if CONFIG["stop_after"] == "intra":
        return None, None
    o = None if for_backward else torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    ht = torch.empty(N, H, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    hbuf = torch.empty(NS, H, K, V, device=dev, dtype=torch.float32) if for_backward else None
    dbuf = torch.empty_like(U) if for_backward else None
    # BV 64 only for 2-byte operands: the fp32 [64, K] tiles of W / Qp / Kd would overflow shared memory
    BVs = min(V, CONFIG["scan_bv"] or (64 if N * H >= 128 and sd == torch.bfloat16 else (32 if N * H >= 32 else 16)))
    _scan_kernel[(triton.cdiv(V, BVs), N * H)](
        W, U, Qp, Kd, Oi if Oi is not None else U, gam, o if o is not None else U, initial_state,
        ht, hbuf, dbuf, cu_seqlens, chunk_offsets, T, H=H, K=K, V=V, BV=BVs, IS_VARLEN=cu_seqlens is not None,
        HAS_H0=initial_state is not None, STORE_HT=output_final_state, STORE_H=for_backward, STORE_D=for_backward,
        WRITE_O=not for_backward, MMA=MMA, num_warps=CONFIG["scan_warps"], num_stages=2)
    if for_backward:
        return W, Qp, Kd, gam, hbuf, dbuf, ht, (chunk_indices, chunk_offsets, NS, N)
    return o, ht
