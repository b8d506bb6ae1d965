"""Absorbed-MLA decode attention in Triton: every head of a few new tokens of a sequence against its latent cache.

With ``W_UK`` folded into the query, MLA decoding is one-head MQA: keys ``latent | k_rope`` ``[S, L + R]`` and values
``latent`` ``[S, L]``, shared by all heads. A program takes a block of query rows of one sequence (heads x new tokens,
row ``t * H + h``: the M of its tile GEMMs) and walks a range of cache positions in tiles of ``block_n``. Each tile is
loaded once and serves both products for every row of the block: ``scores = q_latent latent^T + q_rope k_rope^T`` and
``out += p latent``. Long caches are split over programs (flash-decoding): a split keeps a running max and sum (online
softmax) and writes its normalised partial output and log-sum-exp, and a second kernel combines the splits; a cache
covered by one split is written out directly.

Masking as in ``reference.py``: query token t sees positions ``<= S - T + t`` where the attention mask allows. Cache
positions that no row of a block sees are never loaded (predicated loads), so the unfilled tail of a static cache
costs its mask reads only.

Accumulation in fp32. bf16 / fp16 inputs go through the tensor cores, the probabilities rounded to the input dtype for
the value product (as flash attention does); fp32 inputs multiply in IEEE fp32. Launched as dependent
(``dependent_launch``), both kernels' programs start while the kernel before them still runs and wait for its results.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ..backend import multiprocessor_count, op_for_call, refuse_autograd, tl, triton
from ..dependent_launch import dependent_launch, wait_for_inputs
from .limits import KERNEL_DTYPES

MAX_TILES_PER_SPLIT = 8  # a split is a serial chain of tiles: longer chains leave the GPU waiting on latency


@dataclass(frozen=True)
class MlaDecodeLaunch:
    """How the decode attention is launched; ``mla_decode_launch`` picks one per call."""

    block_m: int  # query rows (heads x new tokens of one sequence) per program: the M of its tile GEMMs
    block_n: int  # cache positions per tile
    split_len: int  # cache positions per split, a multiple of block_n; one split covering the cache skips the combine
    warps: int  # warps per program
    stages: int  # software-pipeline depth of the tile loads


def mla_decode_launch(batch: int, rows: int, S: int, L: int, dtype: torch.dtype,
                      multiprocessors: int) -> MlaDecodeLaunch:
    """16-bit inputs: blocks of up to 32 query rows, so the ``[block_m, L]`` fp32 accumulator stays at 64 values a
    thread at 8 warps (L = 512: 210 registers and no spill for sm_90 in Triton 3.9's compile report; 64 rows spill,
    and more blocks only re-read a tile from L2), 64-position tiles double-buffered (72 KB of latent + rope a stage at
    L = 512, R = 64), and a warp per 1024 accumulator values (4 warps for 16 rows at L = 256, 8 for 32 rows at 512).
    fp32 operands take twice the registers: 16 x 16 tiles at 8 warps, single-buffered (at L = 512 still ~3 KB of
    spill a thread: fp32 decoding is for exact checks, not for speed).

    A split is a serial chain of tiles, and a decoding step's grid is small, so a cache is cut into short splits:
    about two programs per multiprocessor, at most ``MAX_TILES_PER_SPLIT`` tiles and at least one each (a 2K cache at
    batch 1: 32 one-tile splits). On an H100 these picks were the fastest of 24 settings (tile 32 / 64, 2 / 4 / 8
    warps, 1-8 tiles a split), or within 11% of it, for the anchor's and K3's MLA at batch 1 and 32 with 2K and 32K
    caches (``benchmarks/mla_decode.py``). A batch whose row blocks alone cover the multiprocessors takes one split:
    cut further, K3's partial outputs (fp32 rows of 96 heads) would add two thirds to the cache's bytes."""
    wide = dtype.itemsize <= 2
    DL = max(16, triton.next_power_of_2(L))
    block_m = min(32 if wide else 16, max(16, triton.next_power_of_2(rows)))
    block_n = 64 if wide else 16
    warps = max(1, min(8, block_m * DL // 1024)) if wide else 8
    tiles = triton.cdiv(S, block_n)
    programs = batch * triton.cdiv(rows, block_m)
    per_split = tiles
    if programs < multiprocessors:
        per_split = min(MAX_TILES_PER_SPLIT, max(triton.cdiv(tiles * programs, 2 * multiprocessors),
                                                 triton.cdiv(tiles, multiprocessors)))
    return MlaDecodeLaunch(block_m=block_m, block_n=block_n, split_len=per_split * block_n, warps=warps,
                           stages=2 if wide else 1)


@triton.jit
def _mla_split_kernel(q, q_rope, latent, k_rope, mask, o, lse,
                      sq_b, sq_h, sq_t, sqr_b, sqr_h, sqr_t, sl_b, sl_s, skr_b, skr_s, sm_b, sm_h, sm_t, sm_s,
                      S, n_splits, split_len, scale,
                      H: tl.constexpr, T: tl.constexpr, L: tl.constexpr, R: tl.constexpr, DL: tl.constexpr,
                      DR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
                      WRITE_LSE: tl.constexpr, PREC: tl.constexpr, DEPENDENT: tl.constexpr):
    """One block of query rows of sequence i_b over split i_split of its cache. MASK: 0 none, 1 bool (as uint8),
    2 float (added to the scores). Writes rows of o ``[B, n_splits, T*H, L]`` (normalised) and, with WRITE_LSE, of lse
    ``[B, n_splits, T*H]`` (-inf where a row saw nothing)."""
    i_m, i_split, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = i_m * BM + tl.arange(0, BM)
    row_ok = rows < H * T
    t, h = rows // H, rows % H
    o_l, o_r = tl.arange(0, DL), tl.arange(0, DR)
    in_l, in_r = (o_l < L)[None, :], (o_r < R)[None, :]
    wait_for_inputs(DEPENDENT)
    bq = tl.load(q + i_b * sq_b + (h * sq_h + t * sq_t)[:, None] + o_l[None, :], mask=row_ok[:, None] & in_l,
                 other=0.0)  # [BM, DL]
    bqr = tl.load(q_rope + i_b * sqr_b + (h * sqr_h + t * sqr_t)[:, None] + o_r[None, :],
                  mask=row_ok[:, None] & in_r, other=0.0)  # [BM, DR]
    last = S - T + t  # the last position each row sees
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DL], tl.float32)
    start = i_split * split_len
    for n0 in range(start, tl.minimum(start + split_len, S), BN):
        cols = n0 + tl.arange(0, BN)
        visible = row_ok[:, None] & (cols[None, :] <= last[:, None])  # [BM, BN]
        if MASK > 0:
            pm = mask + i_b * sm_b + (h * sm_h + t * sm_t)[:, None] + cols[None, :] * sm_s
            if MASK == 1:
                visible = visible & (tl.load(pm, mask=visible, other=0) != 0)
            else:
                bias = tl.load(pm, mask=visible, other=0.0).to(tl.float32)
                visible = visible & (bias != float("-inf"))
        live = (tl.max(visible.to(tl.int32), axis=0) > 0)[:, None]  # [BN, 1]: positions some row of the block sees
        kv = tl.load(latent + i_b * sl_b + cols[:, None] * sl_s + o_l[None, :], mask=live & in_l, other=0.0)
        kr = tl.load(k_rope + i_b * skr_b + cols[:, None] * skr_s + o_r[None, :], mask=live & in_r, other=0.0)
        s = tl.dot(bq, tl.trans(kv), input_precision=PREC) + tl.dot(bqr, tl.trans(kr), input_precision=PREC)
        s = s * scale
        if MASK == 2:
            s = s + bias
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet keeps l = acc = 0
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=PREC)
        m_i = m_new
    seen = l_i > 0
    out_rows = (i_b * n_splits + i_split) * (H * T) + rows
    tl.store(o + out_rows[:, None] * L + o_l[None, :], (acc / tl.where(seen, l_i, 1.0)[:, None]).to(o.dtype.element_ty),
             mask=row_ok[:, None] & in_l)
    if WRITE_LSE:
        tl.store(lse + out_rows, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf")), mask=row_ok)


@triton.jit
def _mla_combine_kernel(part_o, part_lse, o, n_splits, ROWS: tl.constexpr, L: tl.constexpr, DL: tl.constexpr,
                        NS: tl.constexpr, SB: tl.constexpr, DEPENDENT: tl.constexpr):
    """Row i_r of sequence i_b: the splits' partial outputs weighted by their share of the softmax sum. The weights
    come from all ``NS >= n_splits`` log-sum-exps at once; the partial outputs are summed ``SB`` splits a step, each
    step's loads independent of the others."""
    i_r, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_l = tl.arange(0, DL)
    first = i_b * n_splits * ROWS + i_r  # the row in split 0; split s is s * ROWS further
    splits = tl.arange(0, NS)
    wait_for_inputs(DEPENDENT)
    lse = tl.load(part_lse + first + splits * ROWS, mask=splits < n_splits, other=float("-inf"))  # [NS]
    m = tl.max(lse, axis=0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lse - m_ref), axis=0)
    acc = tl.zeros([DL], tl.float32)
    for s0 in range(0, n_splits, SB):
        s = s0 + tl.arange(0, SB)
        w = tl.exp(tl.load(part_lse + first + s * ROWS, mask=s < n_splits, other=float("-inf")) - m_ref)  # [SB]
        part = tl.load(part_o + (first + s * ROWS)[:, None] * L + o_l[None, :],
                       mask=(s < n_splits)[:, None] & (o_l < L)[None, :], other=0.0)  # [SB, DL]
        acc += tl.sum(w[:, None] * part, axis=0)
    tl.store(o + (i_b * ROWS + i_r) * L + o_l, (acc / tl.where(total > 0, total, 1.0)).to(o.dtype.element_ty),
             mask=o_l < L)


def launch_mla_decode(q_latent, q_rope, latent, k_rope, attention_mask, scale: float, launch: MlaDecodeLaunch):
    """The kernels on q_latent ``[B, H, T, L]``, q_rope ``[B, H, T, R]``, latent ``[B, 1, S, L]``, k_rope
    ``[B, 1, S, R]`` (one dtype, unit stride in the last dim) and a 4-D mask broadcastable to ``[B, H, T, S]`` or
    None. Returns ``[B, T, H, L]`` in the inputs' dtype."""
    B, H, T, L = q_latent.shape
    S, R = latent.shape[2], k_rope.shape[-1]
    rows, n_splits = H * T, triton.cdiv(S, launch.split_len)
    out = q_latent.new_empty(B, T, H, L)
    part_o, part_lse = out, out  # one split writes the output and no log-sum-exp
    if n_splits > 1:
        part_o = torch.empty(B, n_splits, rows, L, device=out.device, dtype=torch.float32)
        part_lse = torch.empty(B, n_splits, rows, device=out.device, dtype=torch.float32)
    DL, dependent = max(16, triton.next_power_of_2(L)), dependent_launch(latent.device)
    mask, kind = latent, 0  # no mask: a pointer the kernel never reads
    if attention_mask is not None:
        mask = attention_mask.expand(B, H, T, S)
        mask, kind = (mask.view(torch.uint8), 1) if mask.dtype == torch.bool else (mask, 2)
    _mla_split_kernel[(triton.cdiv(rows, launch.block_m), n_splits, B)](
        q_latent, q_rope, latent, k_rope, mask, part_o, part_lse,
        q_latent.stride(0), q_latent.stride(1), q_latent.stride(2), q_rope.stride(0), q_rope.stride(1),
        q_rope.stride(2), latent.stride(0), latent.stride(2), k_rope.stride(0), k_rope.stride(2),
        *(mask.stride() if kind else (0, 0, 0, 0)),
        S, n_splits, launch.split_len, scale,
        H=H, T=T, L=L, R=R, DL=DL, DR=max(16, triton.next_power_of_2(R)),
        BM=launch.block_m, BN=launch.block_n, MASK=kind, WRITE_LSE=n_splits > 1,
        PREC="ieee" if latent.dtype == torch.float32 else "tf32", num_warps=launch.warps, num_stages=launch.stages,
        **dependent)
    if n_splits > 1:
        _mla_combine_kernel[(rows, B)](part_o, part_lse, out, n_splits, ROWS=rows, L=L, DL=DL,
                                       NS=max(16, triton.next_power_of_2(n_splits)), SB=max(1, 4096 // DL),
                                       num_warps=4, **dependent)
    return out


def _decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    B, H, T, L = q_latent.shape
    launch = mla_decode_launch(B, H * T, latent.shape[2], L, latent.dtype, multiprocessor_count(latent.device))
    return launch_mla_decode(q_latent, q_rope, latent, k_rope, attention_mask, scale, launch)


mla_decode_attention_op = torch.library.custom_op("kda_moe::mla_decode_attention", _decode_attention, mutates_args=())


@mla_decode_attention_op.register_fake
def _(q_latent, q_rope, latent, k_rope, attention_mask, scale):
    B, H, T, L = q_latent.shape
    return q_latent.new_empty((B, T, H, L))


def mla_decode_attention_triton(q_latent, q_rope, latent, k_rope, attention_mask=None, *, scale):
    """Absorbed-MLA decode attention in Triton (shapes as in ``reference.mla_decode_attention``); the queries are cast
    to the cache's dtype, which must be fp16, bf16 or fp32. Returns ``[B, T, H, L]`` in that dtype. Decoding only: no
    backward."""
    if latent.dtype not in KERNEL_DTYPES or k_rope.dtype != latent.dtype:
        raise ValueError(
            f"the Triton MLA decode attention reads a latent cache and rotary keys of one dtype among fp16, bf16 and "
            f"fp32, got {latent.dtype} and {k_rope.dtype}; cast the cache, or use kernel_backend=\"torch\" (or "
            "\"auto\", which runs other dtypes on the PyTorch path)."
        )
    inputs = (q_latent, q_rope, latent, k_rope)
    refuse_autograd("the Triton MLA decode attention", inputs, "the attention interface")
    inputs = [t.to(latent.dtype) for t in inputs]  # the queries take the cache's dtype
    q_latent, q_rope, latent, k_rope = (t if t.stride(-1) == 1 else t.contiguous() for t in inputs)
    return op_for_call(mla_decode_attention_op, _decode_attention)(q_latent, q_rope, latent, k_rope, attention_mask,
                                                                   float(scale))
