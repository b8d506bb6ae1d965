"""Block AttnRes mix: Triton forward and backward.

Every program holds whole token rows (``rows`` of them, all d channels in registers: 4 rows at d = 1024, one at K3's
7168) and reads the N blocks and the partial sum in place (no concatenated copy). The forward reads each source once:
its sum of squares and its dot product with the pseudo-query give its score, and an online softmax over the sources
(a running maximum, the denominator and the weighted sum rescaled as it rises) forms the output as it goes; each
row's softmax weights and inverse RMS ([N + 1, rows] fp32) are saved. The backward, ``backward_blocks`` row blocks a
program, reads each source twice: its product with the output gradient and with the pseudo-query first, then, the
scores' gradient known, it writes the source's gradient; the pseudo-query's gradient (a sum over rows) stays in
registers and goes to a per-program fp32 buffer [programs, d], summed afterwards in a fixed order. Both loop over
the blocks with their loads issued ahead (software pipelining), then take the partial sum (which may differ from the
blocks in dtype, so it cannot share the loop's load). All math in fp32; the output in the partial sum's dtype, each
source's gradient in that source's dtype (fp32 blocks and a bf16 partial sum under autocast are read as they are). A
row's output depends on that row alone, the same wherever the row sits in the batch. Both directions are
``torch.library.custom_op``s with fake implementations.
"""

from dataclasses import dataclass

import torch

from ..backend import op_for_call, tl, triton


@dataclass(frozen=True)
class MixLaunch:
    """How the mix kernels are launched; ``mix_launch`` picks one per call."""

    rows: int  # token rows of every program (forward) and of every row block (backward)
    block_d: int  # channels of a row tile: at least d (the whole row)
    warps: int  # warps per program
    backward_blocks: int  # row blocks per backward program: one partial pseudo-query gradient per blocks * rows rows
    stages: int  # software-pipelining depth of the loops over the blocks: loads issued stages - 1 blocks ahead


def mix_launch(d: int) -> MixLaunch:
    """Whole rows, about 4096 channels a program (4 rows at d = 1024, one at 7168 in a 8192-wide tile) and a warp per
    512 of them, so that a [rows, block_d] fp32 tile is 16 registers a thread; 32 rows a backward program keep the
    pseudo-query's gradient buffer at 1/32 of a source; the blocks loaded 2 ahead (at 7168 bf16 channels, 32 KB of
    shared memory). Not tuned on a GPU yet."""
    block_d = triton.next_power_of_2(d)
    rows = max(1, 4096 // block_d)
    return MixLaunch(rows=rows, block_d=block_d, warps=min(16, max(1, rows * block_d // 512)),
                     backward_blocks=max(1, 32 // rows), stages=3)


@triton.jit
def _row_tile(block, M, ROWS: tl.constexpr, BD: tl.constexpr, D: tl.constexpr):
    """Rows ``block * ROWS ...`` of [M, D]: (their offsets [ROWS, BD], the mask of real rows and channels, the mask of
    real rows [ROWS])."""
    o_m = block * ROWS + tl.arange(0, ROWS)
    o_d = tl.arange(0, BD)
    m_m = o_m < M
    return o_m.to(tl.int64)[:, None] * D + o_d[None, :], m_m[:, None] & (o_d < D)[None, :], m_m


@triton.jit
def _pseudo_query(norm_w, query_w, BD: tl.constexpr, D: tl.constexpr):
    """``norm_w * query_w`` [BD] in fp32, zero past D."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    return (tl.load(norm_w + o_d, mask=m_d, other=0.0).to(tl.float32)
            * tl.load(query_w + o_d, mask=m_d, other=0.0).to(tl.float32))


@triton.jit
def _fold_source(v, s, q, o_s, scores, r_all, top, denominator, acc, eps, D: tl.constexpr):
    """One step of the forward's online softmax: source s's rows ``v`` [ROWS, BD] (fp32) scored against the
    pseudo-query q, folded into the running maximum ``top``, the ``denominator`` and the weighted sum ``acc``, its
    score and inverse RMS recorded in column s of ``scores`` and ``r_all`` ([ROWS, SP])."""
    r = tl.rsqrt(tl.sum(v * v, 1) / D + eps)
    score = tl.sum(v * q[None, :], 1) * r
    new_top = tl.maximum(top, score)
    rescale = tl.exp(top - new_top)  # 0 for the first source
    e = tl.exp(score - new_top)
    return (tl.where(o_s == s, score[:, None], scores), tl.where(o_s == s, r[:, None], r_all), new_top,
            denominator * rescale + e, acc * rescale[:, None] + e[:, None] * v)


@triton.jit
def _attn_res_fwd_kernel(blocks, partial, norm_w, query_w, out, weights, rstd, M, N, eps, D: tl.constexpr,
                         BD: tl.constexpr, ROWS: tl.constexpr, SP: tl.constexpr, STAGES: tl.constexpr):
    offsets, m, m_m = _row_tile(tl.program_id(0), M, ROWS, BD, D)
    q = _pseudo_query(norm_w, query_w, BD, D)
    o_s = tl.arange(0, SP)[None, :]  # [1, SP] source index; columns past N are padding
    scores = tl.full((ROWS, SP), float("-inf"), dtype=tl.float32)
    r_all = tl.zeros((ROWS, SP), dtype=tl.float32)
    top = tl.full((ROWS,), float("-inf"), dtype=tl.float32)  # the running maximum score
    denominator = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BD), dtype=tl.float32)
    stride = tl.cast(M, tl.int64) * D  # between the blocks
    for s in tl.range(0, N, num_stages=STAGES):  # the blocks, STAGES - 1 loads ahead; then the partial sum
        v = tl.load(blocks + s * stride + offsets, mask=m, other=0.0).to(tl.float32)
        scores, r_all, top, denominator, acc = _fold_source(v, s, q, o_s, scores, r_all, top, denominator, acc, eps, D)
    v = tl.load(partial + offsets, mask=m, other=0.0).to(tl.float32)
    scores, r_all, top, denominator, acc = _fold_source(v, N, q, o_s, scores, r_all, top, denominator, acc, eps, D)
    tl.store(out + offsets, (acc / denominator[:, None]).to(out.dtype.element_ty), mask=m)
    o_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_stats = m_m[:, None] & (o_s <= N)
    tl.store(weights + o_s * M + o_m[:, None], tl.exp(scores - top[:, None]) / denominator[:, None], mask=m_stats)
    tl.store(rstd + o_s * M + o_m[:, None], r_all, mask=m_stats)


@triton.jit
def _source_products(v, s, g, q, o_s, grad_p, dot):
    """Column s of the backward's ``grad_p`` (output gradient . source) and ``dot`` (source . pseudo-query)."""
    return (tl.where(o_s == s, tl.sum(g * v, 1)[:, None], grad_p),
            tl.where(o_s == s, tl.sum(v * q[None, :], 1)[:, None], dot))


@triton.jit
def _source_gradient(v, s, g, q, o_s, p, coef_q, coef_v):
    """Source s's gradient ``p_s g + cq_s q + cv_s v`` ([ROWS, BD]) and its rows' share of the pseudo-query's
    gradient ``sum cq_s v`` ([BD])."""
    pick = o_s == s
    p_s = tl.sum(tl.where(pick, p, 0.0), 1)[:, None]
    cq_s = tl.sum(tl.where(pick, coef_q, 0.0), 1)[:, None]
    cv_s = tl.sum(tl.where(pick, coef_v, 0.0), 1)[:, None]
    return p_s * g + cq_s * q[None, :] + cv_s * v, tl.sum(cq_s * v, 0)


@triton.jit
def _attn_res_bwd_kernel(blocks, partial, norm_w, query_w, weights, rstd, grad_out, grad_blocks, grad_partial,
                         grad_query_part, M, N, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
                         SP: tl.constexpr, ITERS: tl.constexpr, STAGES: tl.constexpr):
    q = _pseudo_query(norm_w, query_w, BD, D)
    o_s = tl.arange(0, SP)[None, :]
    grad_q = tl.zeros((BD,), dtype=tl.float32)
    stride = tl.cast(M, tl.int64) * D  # between the blocks
    for it in range(ITERS):
        block = tl.program_id(0) * ITERS + it
        offsets, m, m_m = _row_tile(block, M, ROWS, BD, D)
        o_m = block * ROWS + tl.arange(0, ROWS)
        m_stats = m_m[:, None] & (o_s <= N)
        p = tl.load(weights + o_s * M + o_m[:, None], mask=m_stats, other=0.0)  # [ROWS, SP]
        r = tl.load(rstd + o_s * M + o_m[:, None], mask=m_stats, other=0.0)
        g = tl.load(grad_out + offsets, mask=m, other=0.0).to(tl.float32)
        grad_p = tl.zeros((ROWS, SP), dtype=tl.float32)
        dot = tl.zeros((ROWS, SP), dtype=tl.float32)
        for s in tl.range(0, N, num_stages=STAGES):  # the blocks, then the partial sum (as in the forward)
            v = tl.load(blocks + s * stride + offsets, mask=m, other=0.0).to(tl.float32)
            grad_p, dot = _source_products(v, s, g, q, o_s, grad_p, dot)
        v = tl.load(partial + offsets, mask=m, other=0.0).to(tl.float32)
        grad_p, dot = _source_products(v, N, g, q, o_s, grad_p, dot)
        grad_score = p * (grad_p - tl.sum(p * grad_p, 1)[:, None])
        # score = r * (v . q) with r = rsqrt(mean(v^2) + eps): its gradient in v is r q - (v . q) r^3 v / D
        coef_q = grad_score * r
        coef_v = -grad_score * dot * r * r * r / D
        for s in tl.range(0, N, num_stages=STAGES):
            v = tl.load(blocks + s * stride + offsets, mask=m, other=0.0).to(tl.float32)
            grad_v, grad_q_s = _source_gradient(v, s, g, q, o_s, p, coef_q, coef_v)
            tl.store(grad_blocks + s * stride + offsets, grad_v.to(grad_blocks.dtype.element_ty), mask=m)
            grad_q += grad_q_s
        v = tl.load(partial + offsets, mask=m, other=0.0).to(tl.float32)
        grad_v, grad_q_s = _source_gradient(v, N, g, q, o_s, p, coef_q, coef_v)
        tl.store(grad_partial + offsets, grad_v.to(grad_partial.dtype.element_ty), mask=m)
        grad_q += grad_q_s
    o_d = tl.arange(0, BD)
    tl.store(grad_query_part + tl.program_id(0) * D + o_d, grad_q, mask=o_d < D)


def _mix_fwd(partial: torch.Tensor, blocks: torch.Tensor, norm_weight: torch.Tensor, query_weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    N, D = blocks.shape[0], partial.shape[-1]
    M = partial.numel() // D
    launch = mix_launch(D)
    out = torch.empty_like(partial)
    weights = torch.empty(N + 1, M, device=partial.device, dtype=torch.float32)
    rstd = torch.empty_like(weights)
    _attn_res_fwd_kernel[(triton.cdiv(M, launch.rows),)](
        blocks, partial, norm_weight, query_weight, out, weights, rstd, M, N, eps, D=D, BD=launch.block_d,
        ROWS=launch.rows, SP=triton.next_power_of_2(N + 1), STAGES=launch.stages, num_warps=launch.warps)
    return out, weights, rstd


attn_res_mix_fwd_op = torch.library.custom_op("kda_moe::attn_res_mix_fwd", _mix_fwd, mutates_args=())


@attn_res_mix_fwd_op.register_fake
def _(partial, blocks, norm_weight, query_weight, eps):
    M = partial.numel() // partial.shape[-1]
    stats = partial.new_empty(blocks.shape[0] + 1, M, dtype=torch.float32)
    return partial.new_empty(partial.shape), stats, stats.new_empty(stats.shape)


@torch.library.custom_op("kda_moe::attn_res_mix_bwd", mutates_args=())
def attn_res_mix_bwd_op(partial: torch.Tensor, blocks: torch.Tensor, norm_weight: torch.Tensor,
                        query_weight: torch.Tensor, weights: torch.Tensor, rstd: torch.Tensor,
                        grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, D = blocks.shape[0], partial.shape[-1]
    M = partial.numel() // D
    launch = mix_launch(D)
    grid = triton.cdiv(M, launch.rows * launch.backward_blocks)
    grad_partial, grad_blocks = torch.empty_like(partial), torch.empty_like(blocks)
    grad_query_part = torch.empty(grid, D, device=partial.device, dtype=torch.float32)
    _attn_res_bwd_kernel[(grid,)](
        blocks, partial, norm_weight, query_weight, weights, rstd, grad_out.contiguous(), grad_blocks, grad_partial,
        grad_query_part, M, N, D=D, BD=launch.block_d, ROWS=launch.rows, SP=triton.next_power_of_2(N + 1),
        ITERS=launch.backward_blocks, STAGES=launch.stages, num_warps=launch.warps)
    grad_query = grad_query_part.sum(0)  # [D]: gradient of norm_weight * query_weight
    return (grad_partial, grad_blocks, (grad_query * query_weight.float()).to(norm_weight.dtype),
            (grad_query * norm_weight.float()).to(query_weight.dtype))


@attn_res_mix_bwd_op.register_fake
def _(partial, blocks, norm_weight, query_weight, weights, rstd, grad_out):
    return (partial.new_empty(partial.shape), blocks.new_empty(blocks.shape), norm_weight.new_empty(norm_weight.shape),
            query_weight.new_empty(query_weight.shape))


def _setup(ctx, inputs, output):
    partial, blocks, norm_weight, query_weight, eps = inputs
    _, weights, rstd = output
    ctx.mark_non_differentiable(weights, rstd)
    ctx.save_for_backward(partial, blocks, norm_weight, query_weight, weights, rstd)


def _backward(ctx, grad_out, grad_weights, grad_rstd):
    partial, blocks, norm_weight, query_weight, weights, rstd = ctx.saved_tensors
    return (*attn_res_mix_bwd_op(partial, blocks, norm_weight, query_weight, weights, rstd, grad_out), None)


torch.library.register_autograd("kda_moe::attn_res_mix_fwd", _backward, setup_context=_setup)


def attn_res_mix_triton(partial: torch.Tensor, blocks: torch.Tensor, norm_weight: torch.Tensor,
                        query_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton ``attn_res_mix``: partial [..., d], blocks [N, ..., d], weights [d]; returns partial.dtype."""
    out, _, _ = op_for_call(attn_res_mix_fwd_op, _mix_fwd)(
        partial.contiguous(), blocks.contiguous(), norm_weight.contiguous(), query_weight.contiguous(), float(eps))
    return out
