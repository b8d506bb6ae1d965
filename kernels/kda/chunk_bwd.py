"""Chunked KDA backward: recompute, one reverse scan, three chunk-parallel kernels.

1. ``chunk_fwd.recompute_for_backward`` recomputes the chunk buffers from the forward's ``A_qk``, ``T`` and
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
   In steep chunks (``steep_chunks.py``) it checks every K slice, and adds the diagonal blocks' pairs apart where a
   slice's tiles decay too far for the GEMMs (``diagonal_blocks.diagonal_grads``).

``backward_launch`` picks the kernels' launch settings (a ``BackwardLaunch``) from the shape, dtype and gate;
``chunk_kda_bwd`` runs the stages in order (``launch_scan_bwd``, ``launch_state_grads``, ``launch_wy_grads``,
``launch_gate_grads`` after the recompute).
"""

from dataclasses import dataclass

import torch

from ..backend import tl, triton
from .chunk_fwd import (ChunkBuffers, ForwardLaunch, KdaCall, check_scan_launch, forward_launch, kda_call, mm_dtype,
                        recompute_for_backward, scan_tile, storage_dtype)
from .chunk_tiles import (BT, chunk_coords, chunk_decay, chunk_end, chunk_offsets64, column_factor, gate,
                          load_row_norms, scan_start, as_mma_reads, tile_ends, tile_references)
from .diagonal_blocks import diagonal_grads, slice_diagonals_in_gemms
from .steep_chunks import chunk_launches, takes_chunk

GATE_PRECISIONS = ("bf16", "tf32", "tf32x3")


@dataclass(frozen=True)
class BackwardLaunch:
    """How the backward's kernels are launched; ``backward_launch`` picks one per call. Slice and tile widths are
    capped at K and V."""

    recompute: ForwardLaunch  # the forward's kernels, rerun for the buffers the backward reads
    scan_warps: int  # warps of the reverse scan
    scan_bv: int  # width of its V tiles
    scan_stages: int  # its software-pipelining depth
    state_warps: int  # warps of the state-gradient kernel (one program per chunk, head and K slice)
    state_bk: int  # width of its K slices, and of the WY kernel's K loop
    state_bv: int  # width of its V loop's tiles
    state_stages: int  # its software-pipelining depth
    state_maxnreg: int | None  # its register cap (None: the compiler's choice)
    wy_warps: int  # warps of the WY-gradient kernel (one program per chunk and head)
    wy_bv: int  # width of its V loop's tiles
    wy_stages: int  # its software-pipelining depth
    gate_warps: int  # warps of the gate-gradient kernel (one program per chunk and head)
    gate_bk: int  # width of its K slices
    gate_stages: int  # its software-pipelining depth
    gate_maxnreg: int | None  # its register cap
    # operands of the gate kernel's score-gradient products: "bf16" (bf16 for bf16 inputs, fp32 read as tf32
    # otherwise), "tf32", or "tf32x3" (three tf32 products, about fp32)
    gate_prec: str

    def __post_init__(self):
        if self.gate_prec not in GATE_PRECISIONS:
            raise ValueError(f"gate_prec must be one of {GATE_PRECISIONS}, got {self.gate_prec!r}.")


def gate_operands(gate_prec: str, dtype: torch.dtype):
    """(operand dtype, input precision) of the gate kernel's score-gradient products for inputs of ``dtype``."""
    return (mm_dtype(dtype), "tf32") if gate_prec == "bf16" else (tl.float32, gate_prec)


def backward_launch(K: int, V: int, pairs: int, dtype: torch.dtype, *, loads_scores: bool = True,
                    gate_prec: str = "bf16") -> BackwardLaunch:
    """The launch of a backward over ``pairs`` (sequence, head) pairs with head dims K, V and inputs of ``dtype``;
    ``loads_scores``: its recompute loads the forward's kept T, A_qk and norms. The values
    ran fastest on an H200 (bf16, B x T x H = 16 x 4096 x 16, K = V = 128, unless a comment names other shapes).
    ``gate_prec`` "bf16" keeps the gate-side gradient errors on a par with fla 0.6.0's; "tf32" and "tf32x3" cut them by
    about a quarter for 1.2x and 1.7x the forward + backward time on the H200."""
    scan_bv, scan_stages = scan_tile(V, pairs, storage_dtype(dtype), 3, stores_states=True)
    fp32_operands = gate_operands(gate_prec, dtype)[0] == tl.float32
    return BackwardLaunch(
        recompute=forward_launch(K, V, pairs, dtype, for_backward=True, loads_scores=loads_scores),
        scan_warps=4,
        scan_bv=scan_bv,
        scan_stages=scan_stages,  # 3 where the tile allows it (also fastest at 4 x 16384 x 16)
        state_warps=8,  # 8 warps at 128 registers: two programs per SM without spilling
        state_bk=32,
        state_bv=128,  # V in one 128-wide pass (narrower passes are slower)
        state_stages=2,
        state_maxnreg=128,
        wy_warps=8,
        wy_bv=32,
        wy_stages=3,  # its loads pipelined 3 deep (78 KB of shared memory)
        # 4 with bf16 operands (8 are slower, and hit an illegal address with the softplus gate under Triton 3.6);
        # 8 with fp32 ones (4 spill)
        gate_warps=8 if fp32_operands else 4,
        # 32 (16 is slower where the gate's bound keeps every tile a GEMM; where the safe path may run, 16 measured
        # faster on the H200 but has not run the GPU test module)
        gate_bk=32,
        gate_stages=2,  # its loads pipelined (3 are slower with the softplus gate)
        gate_maxnreg=None,
        gate_prec=gate_prec,
    )


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
                       dq, dk, dg, dbeta, dA_part, dbias_part, cu_seqlens, chunk_indices, steep, T, scale, lb,
                       H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
                       BOUNDED: tl.constexpr, CHUNKS: tl.constexpr, FAST_DIAG: tl.constexpr, MMA: tl.constexpr,
                       PREC: tl.constexpr):
    """Per chunk and head (step 4 of the module docstring): the score gradients dL / dA_qk through the gated scores,
    one BK-wide K slice at a time, then the decay cumsum, the gate, beta's sigmoid and, once rho sums over all of K,
    the L2 norms."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    ok, bos, t0, L = chunk_coords(cu_seqlens, chunk_indices, i_p, T, IS_VARLEN)
    if takes_chunk(ok, steep, i_p * H + i_h, CHUNKS):  # the chunks of this launch (steep_chunks.py)
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
            diag = slice_diagonals_in_gemms(c1, c2, c3, c4, FAST_DIAG)
            r0, r1, r2, r3, f = tile_references(G, c1, c2, c3, c4, diag)
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


def launch_scan_bwd(call: KdaCall, bufs: ChunkBuffers, launch: BackwardLaunch, do: torch.Tensor,
                    dht: torch.Tensor | None, with_dh0: bool):
    """The reverse scan: ``(dh, ddelta, dh0)``, the state gradient at every chunk end [NS, H, K, V] and ``ddelta``
    [B, T, H, V] in the storage dtype, and the initial state's gradient [N, H, K, V] fp32 (or None)."""
    B, T, H, K = call.q.shape
    V = call.v.shape[-1]
    dev = call.q.device
    sd = storage_dtype(call.v.dtype)
    dh = torch.empty(call.NS, H, K, V, device=dev, dtype=sd)
    ddelta = torch.empty(B, T, H, V, device=dev, dtype=sd)
    dh0 = torch.empty(call.N, H, K, V, device=dev, dtype=torch.float32) if with_dh0 else None
    check_scan_launch(launch.scan_bv, launch.scan_stages, sd)
    _scan_bwd_kernel[(triton.cdiv(V, launch.scan_bv), call.pairs)](
        bufs.W, bufs.Qg, bufs.Kd, bufs.Aqk, bufs.gam, do, dht, dh0, dh, ddelta, call.cu_seqlens, call.chunk_offsets,
        T, H=H, K=K, V=V, BV=launch.scan_bv, IS_VARLEN=call.cu_seqlens is not None, HAS_DHT=dht is not None,
        STORE_DH0=dh0 is not None, MMA=mm_dtype(call.v.dtype), num_warps=launch.scan_warps,
        num_stages=launch.scan_stages)
    return dh, ddelta, dh0


def launch_state_grads(call: KdaCall, bufs: ChunkBuffers, h, dh, delta, ddelta, do, launch: BackwardLaunch):
    """The state-gradient kernel: ``(dW, kg, dqn, dkn, dG)``, the operands of ``dW kg^T`` for the WY kernel and the
    direct gradients of the normalised q and k (storage dtype) and of the decay G (fp32), [B, T, H, K] each."""
    B, T, H, K = call.q.shape
    V = call.v.shape[-1]
    dev = call.q.device
    sd = storage_dtype(call.v.dtype)
    BK = min(K, launch.state_bk)
    dW = torch.empty(B, T, H, K, device=dev, dtype=sd)  # the operands of dW kg^T, as the MMA takes them
    kg = torch.empty_like(dW)
    # the decay's direct gradient stays fp32: dt_bias's gradient sums it over every token (in bf16, ddt_bias came to
    # 1.5e-2 at 4 x 4096 x 16, against 3.6e-3)
    dqn = torch.empty(B, T, H, K, device=dev, dtype=sd)
    dkn = torch.empty_like(dqn)
    dG = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    _state_grads_kernel[(call.NS * (K // BK), H)](
        call.q, call.k, call.g, call.beta, call.A_log, call.dt_bias, do, bufs.T, bufs.norms, h, dh, delta, ddelta,
        dW, kg, dqn, dkn, dG, call.cu_seqlens, call.chunk_indices, T, call.scale, call.lb, H=H, K=K, V=V, BK=BK,
        BV=min(V, launch.state_bv), IS_VARLEN=call.cu_seqlens is not None,
        BOUNDED=call.gate_lower_bound is not None, MMA=mm_dtype(call.v.dtype), num_warps=launch.state_warps,
        num_stages=launch.state_stages, maxnreg=launch.state_maxnreg)
    return dW, kg, dqn, dkn, dG


def launch_wy_grads(call: KdaCall, bufs: ChunkBuffers, delta, ddelta, dW, kg, do, launch: BackwardLaunch):
    """The WY-gradient kernel: ``(dv, dL, dA_qk, dbeta_col)``; dL and dA_qk [B, T, H, 64] in the gate kernel's
    operand dtype (bf16 ones feed its tensor cores straight from shared memory), beta's column-side gradient
    [B, T, H] fp32."""
    B, T, H, K = call.q.shape
    V = call.v.shape[-1]
    dev = call.q.device
    gate_mma = gate_operands(launch.gate_prec, call.v.dtype)[0]
    dv = torch.empty_like(call.v)
    dL = torch.empty(B, T, H, BT.value, device=dev, dtype=torch.bfloat16 if gate_mma == tl.bfloat16 else torch.float32)
    dAq = torch.empty_like(dL)
    dbeta_col = torch.empty(B, T, H, device=dev, dtype=torch.float32)
    _wy_grads_kernel[(call.NS, H)](
        call.beta, call.v, do, bufs.T, delta, ddelta, dW, kg, dv, dL, dAq, dbeta_col, call.cu_seqlens,
        call.chunk_indices, T, H=H, K=K, V=V, BK=min(K, launch.state_bk), BV=min(V, launch.wy_bv),
        IS_VARLEN=call.cu_seqlens is not None, MMA=mm_dtype(call.v.dtype), DOT_PREC="tf32",
        num_warps=launch.wy_warps, num_stages=launch.wy_stages)
    return dv, dL, dAq, dbeta_col


def launch_gate_grads(call: KdaCall, norms, dL, dAq, dbeta_col, dqn, dkn, dG, launch: BackwardLaunch):
    """The gate-gradient kernel: ``(dq, dk, dg, dbeta, dA_log, ddt_bias)`` in the inputs' dtypes."""
    B, T, H, K = call.q.shape
    dev = call.q.device
    gate_mma, prec = gate_operands(launch.gate_prec, call.v.dtype)
    dq = torch.empty_like(call.q)
    dk = torch.empty_like(call.k)
    dg = torch.empty_like(call.g)
    dbeta = torch.empty_like(call.beta)
    dA_part = torch.zeros(call.NS, H, device=dev, dtype=torch.float32)
    dbias_part = torch.zeros(call.NS, H, K, device=dev, dtype=torch.float32)
    for chunks, gemm_only, steep in chunk_launches(call):
        _gate_grads_kernel[(call.NS, H)](
            call.q, call.k, call.g, call.beta, call.A_log, call.dt_bias, norms, dL, dAq, dbeta_col, dqn, dkn, dG, dq,
            dk, dg, dbeta, dA_part, dbias_part, call.cu_seqlens, call.chunk_indices, steep, T, call.scale, call.lb,
            H=H, K=K, BK=min(K, launch.gate_bk), IS_VARLEN=call.cu_seqlens is not None,
            BOUNDED=call.gate_lower_bound is not None, CHUNKS=chunks, FAST_DIAG=gemm_only, MMA=gate_mma, PREC=prec,
            num_warps=launch.gate_warps, num_stages=launch.gate_stages, maxnreg=launch.gate_maxnreg)
    return dq, dk, dg, dbeta, dA_part.sum(0).to(call.A_log.dtype), dbias_part.sum(0).reshape(-1).to(call.dt_bias.dtype)


def chunk_kda_bwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state, cu_seqlens, do, dht,
                  scores=None, *, launch: BackwardLaunch | None = None):
    """Gradients (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0) of ``chunk_kda_fwd``'s (o, ht); ``scores``: the
    forward's ``(A_qk, T, norms)`` (``keep_scores``), or None to recompute them. ``launch``: ``backward_launch``'s
    for this call unless given.

    dq/dk/dg/dbeta/dv come back in the inputs' dtypes, dA_log/ddt_bias fp32, dh0 fp32 (or None)."""
    call = kda_call(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, cu_seqlens)
    launch = launch or backward_launch(q.shape[-1], v.shape[-1], call.pairs, v.dtype,
                                       loads_scores=scores is not None)
    bufs, h, delta = recompute_for_backward(call, launch.recompute, initial_state, scores)
    do = do.contiguous()
    # every buffer is dropped after its last kernel, so that the caching allocator hands its memory to the next ones
    dh, ddelta, dh0 = launch_scan_bwd(call, bufs, launch, do, dht, initial_state is not None)
    bufs.W = bufs.Qg = bufs.Kd = bufs.Aqk = bufs.gam = None
    dW, kg, dqn, dkn, dG = launch_state_grads(call, bufs, h, dh, delta, ddelta, do, launch)
    del h, dh
    dv, dL, dAq, dbeta_col = launch_wy_grads(call, bufs, delta, ddelta, dW, kg, do, launch)
    bufs.T = None
    del delta, ddelta, dW, kg
    dq, dk, dg, dbeta, dA_log, ddt = launch_gate_grads(call, bufs.norms, dL, dAq, dbeta_col, dqn, dkn, dG, launch)
    return dq, dk, dv, dg, dbeta, dA_log, ddt, dh0
