"""Block AttnRes mix: Triton forward and backward.

Each program takes ``rows`` token rows and reads the N blocks and the partial sum in place (no concatenated copy),
looping over d in ``block_d`` slices, so K3's d = 7168 fits as well as d = 1024. The forward makes two passes over
the sources: the first sums each source's squares and its dot product with the pseudo-query, the softmax over the
N + 1 sources of every row follows, the second forms the weighted sum. It saves each row's weights and inverse RMS
([N + 1, rows] fp32). The backward recomputes the dot products and the output gradient's product with each source in
a first pass, then writes every source's gradient in a second; the pseudo-query's gradient (a sum over rows) goes to a
per-program fp32 buffer [programs, d], summed afterwards in a fixed order. All math in fp32; the output in the partial
sum's dtype, each source's gradient in that source's dtype (fp32 blocks and a bf16 partial sum under autocast are
read as they are). A row's output depends on that row alone, the same wherever the row sits in the batch. Both
directions are ``torch.library.custom_op``s with fake implementations.
"""

from dataclasses import dataclass

import torch

from ..backend import op_for_call, tl, triton


@dataclass(frozen=True)
class MixLaunch:
    """How the mix kernels are launched; ``mix_launch`` picks one per call."""

    rows: int  # token rows of every program (forward) and of every row block (backward)
    block_d: int  # channels per loop step
    warps: int  # warps per program
    backward_blocks: int  # row blocks per backward program: one partial pseudo-query gradient per blocks * rows rows


def mix_launch(d: int) -> MixLaunch:
    """4 rows a program, slices of up to 512 channels and a warp per 256 elements of a [rows, slice] tile: an fp32 tile
    is then 8 registers a thread, and the sm_90 compile (benchmarks/compile_report.py) gives 48-63 registers in the
    forward and 108-119 in the backward at d = 1024 and 7168, no spills, where 1024-channel slices on 4 warps take 255
    in the backward. 32 rows per backward program keep the gradient buffer at 1/32 of a source. Not tuned on a GPU yet."""
    rows, block_d = 4, min(triton.next_power_of_2(d), 512)
    return MixLaunch(rows=rows, block_d=block_d, warps=max(1, rows * block_d // 256), backward_blocks=8)


@triton.jit
def _load_source(blocks, partial, s, N, M, offsets, mask, D: tl.constexpr):
    """Source s at `offsets` of its [M, D] rows, in fp32: block s ([N, M, D]) for s < N, the partial sum for s == N.
    The two may differ in dtype (fp32 blocks and a bf16 partial sum under autocast)."""
    if s < N:
        v = tl.load(blocks + s * tl.cast(M, tl.int64) * D + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        v = tl.load(partial + offsets, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _store_source(grad_blocks, grad_partial, s, N, M, offsets, value, mask, D: tl.constexpr):
    """Stores `value` as source s's gradient, each in its own dtype (the layout of `_load_source`)."""
    if s < N:
        tl.store(grad_blocks + s * tl.cast(M, tl.int64) * D + offsets, value.to(grad_blocks.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(grad_partial + offsets, value.to(grad_partial.dtype.element_ty), mask=mask)


@triton.jit
def _query_slice(norm_w, query_w, o_d, m_d):
    """The pseudo-query's slice ``norm_w * query_w`` at channels o_d, fp32."""
    return (tl.load(norm_w + o_d, mask=m_d, other=0.0).to(tl.float32)
            * tl.load(query_w + o_d, mask=m_d, other=0.0).to(tl.float32))


@triton.jit
def _attn_res_fwd_kernel(blocks, partial, norm_w, query_w, out, weights, rstd, M, N, eps, D: tl.constexpr,
                         BD: tl.constexpr, ROWS: tl.constexpr, SP: tl.constexpr):
    o_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_m = o_m < M
    row = o_m.to(tl.int64)[:, None] * D  # [ROWS, 1]
    o_s = tl.arange(0, SP)[None, :]  # [1, SP] source index; columns past N are padding
    sum_sq = tl.zeros((ROWS, SP), dtype=tl.float32)
    dot = tl.zeros((ROWS, SP), dtype=tl.float32)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m_d = o_d < D
        q = _query_slice(norm_w, query_w, o_d, m_d)
        m = m_m[:, None] & m_d[None, :]
        for s in range(N + 1):
            v = _load_source(blocks, partial, s, N, M, row + o_d[None, :], m, D)
            sum_sq = tl.where(o_s == s, sum_sq + tl.sum(v * v, 1)[:, None], sum_sq)
            dot = tl.where(o_s == s, dot + tl.sum(v * q[None, :], 1)[:, None], dot)
    r = tl.rsqrt(sum_sq / D + eps)
    logits = tl.where(o_s <= N, dot * r, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]  # [ROWS, SP]
    m_stats = m_m[:, None] & (o_s <= N)
    tl.store(weights + o_s * M + o_m[:, None], p, mask=m_stats)
    tl.store(rstd + o_s * M + o_m[:, None], r, mask=m_stats)
    for d0 in range(0, D, BD):
        o_d = d0 + tl.arange(0, BD)
        m = m_m[:, None] & (o_d < D)[None, :]
        acc = tl.zeros((ROWS, BD), dtype=tl.float32)
        for s in range(N + 1):
            v = _load_source(blocks, partial, s, N, M, row + o_d[None, :], m, D)
            acc += tl.sum(tl.where(o_s == s, p, 0.0), 1)[:, None] * v
        tl.store(out + row + o_d[None, :], acc.to(out.dtype.element_ty), mask=m)


@triton.jit
def _backward_slice(norm_w, query_w, grad_out, row, m_m, d0, D: tl.constexpr, BD: tl.constexpr):
    """The backward's channel slice from d0, as both its passes take it: (channels o_d, their mask, the
    pseudo-query's slice, the [rows, slice] mask, the output gradient's slice in fp32)."""
    o_d = d0 + tl.arange(0, BD)
    m_d = o_d < D
    m = m_m[:, None] & m_d[None, :]
    g = tl.load(grad_out + row + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    return o_d, m_d, _query_slice(norm_w, query_w, o_d, m_d), m, g


@triton.jit
def _attn_res_bwd_kernel(blocks, partial, norm_w, query_w, weights, rstd, grad_out, grad_blocks, grad_partial,
                         grad_query_part, M, N, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr,
                         SP: tl.constexpr, ITERS: tl.constexpr):
    o_s = tl.arange(0, SP)[None, :]
    for it in range(ITERS):
        o_m = (tl.program_id(0) * ITERS + it) * ROWS + tl.arange(0, ROWS)
        m_m = o_m < M
        row = o_m.to(tl.int64)[:, None] * D
        m_stats = m_m[:, None] & (o_s <= N)
        p = tl.load(weights + o_s * M + o_m[:, None], mask=m_stats, other=0.0)  # [ROWS, SP]
        r = tl.load(rstd + o_s * M + o_m[:, None], mask=m_stats, other=0.0)
        grad_p = tl.zeros((ROWS, SP), dtype=tl.float32)  # output gradient . source
        dot = tl.zeros((ROWS, SP), dtype=tl.float32)  # source . pseudo-query
        for d0 in range(0, D, BD):
            o_d, m_d, q, m, g = _backward_slice(norm_w, query_w, grad_out, row, m_m, d0, D, BD)
            for s in range(N + 1):
                v = _load_source(blocks, partial, s, N, M, row + o_d[None, :], m, D)
                grad_p = tl.where(o_s == s, grad_p + tl.sum(g * v, 1)[:, None], grad_p)
                dot = tl.where(o_s == s, dot + tl.sum(v * q[None, :], 1)[:, None], dot)
        grad_logit = p * (grad_p - tl.sum(p * grad_p, 1)[:, None])
        # logit = r * (v . q) with r = rsqrt(mean(v^2) + eps): its gradient in v is r q - (v . q) r^3 v / D
        coef_q = grad_logit * r
        coef_v = -grad_logit * dot * r * r * r / D
        for d0 in range(0, D, BD):
            o_d, m_d, q, m, g = _backward_slice(norm_w, query_w, grad_out, row, m_m, d0, D, BD)
            grad_q = tl.zeros((BD,), dtype=tl.float32)
            for s in range(N + 1):
                v = _load_source(blocks, partial, s, N, M, row + o_d[None, :], m, D)
                pick = o_s == s
                p_s = tl.sum(tl.where(pick, p, 0.0), 1)[:, None]
                cq_s = tl.sum(tl.where(pick, coef_q, 0.0), 1)[:, None]
                cv_s = tl.sum(tl.where(pick, coef_v, 0.0), 1)[:, None]
                grad_v = p_s * g + cq_s * q[None, :] + cv_s * v
                _store_source(grad_blocks, grad_partial, s, N, M, row + o_d[None, :], grad_v, m, D)
                grad_q += tl.sum(cq_s * v, 0)
            part = grad_query_part + tl.program_id(0) * D + o_d
            tl.store(part, tl.load(part, mask=m_d, other=0.0) + grad_q, mask=m_d)


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
        ROWS=launch.rows, SP=triton.next_power_of_2(N + 1), num_warps=launch.warps)
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
    grad_query_part = torch.zeros(grid, D, device=partial.device, dtype=torch.float32)
    _attn_res_bwd_kernel[(grid,)](
        blocks, partial, norm_weight, query_weight, weights, rstd, grad_out.contiguous(), grad_blocks, grad_partial,
        grad_query_part, M, N, D=D, BD=launch.block_d, ROWS=launch.rows, SP=triton.next_power_of_2(N + 1),
        ITERS=launch.backward_blocks, num_warps=launch.warps)
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
