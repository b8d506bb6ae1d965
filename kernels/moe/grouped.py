"""Routed experts for many tokens (training, prefill): grouped GEMMs over the (token, choice) pairs sorted by expert.

``grouped_experts_triton`` computes ``sum_j w_j down_j(act(gate_up_j(x)))`` per token, as every experts path does,
writing each [pairs, width] tensor once:

1. the S = N x k pairs are sorted by expert (a stable argsort of the ids) and the token rows spread to them
   (``x[token of pair]``, an index_select);
2. one grouped GEMM over every expert's gate and up rows: ``gate_up [S, 2I]``;
3. one Triton kernel, ``h = A(gate) U(up) w``, the pair's routing weight w folded in before the down projection
   (which is linear), in fp32, stored in the input dtype: the activation and the weighting in one pass;
4. one grouped GEMM over every expert's down rows: ``y [S, l]`` (both GEMMs decode mxfp4 weights in registers,
   ``mxfp4.py``, where the experts are kept packed);
5. each token's k pair rows gathered back in its own order and summed in fp32 (``y[rank of pair]``, then a sum over
   k): no atomics, so the forward is deterministic.

The backward mirrors it. The spread (1) and the gather-sum (5) are each other's adjoints, so each one's backward is
the other (gathers and a fixed-order sum, never the sort-based scatter that the backward of ``x[index]`` runs); the
kernel's backward forms d gate, d up and d w (a row sum) from the kept ``gate_up``; autograd differentiates the
grouped GEMMs (transformers' dispatcher: torch's grouped_mm where the device and dtype take it, its per-expert
fallback elsewhere).
"""

from dataclasses import dataclass
from typing import Optional

import torch
from transformers.integrations.moe import _grouped_mm as grouped_mm

from ..backend import op_for_call, tl, triton
from .activation import gated_activation, gated_activation_and_grads
from .mxfp4 import mxfp4_grouped_mm_triton
from .reference import Mxfp4Weight, expert_loads


@dataclass(frozen=True)
class GluLaunch:
    """How the weighted-activation kernels are launched; ``glu_launch`` picks one per call."""

    rows: int  # pair rows per program
    block_inter: int  # intermediate channels per loop step
    warps: int  # warps per program


def glu_launch(intermediate: int) -> GluLaunch:
    """8 rows and slices of up to 256 channels: a [8, 256] fp32 tile is 16 values a thread on 4 warps, and every row's
    weight gradient (a sum over I) stays in the program that owns the row. Not tuned on a GPU yet."""
    return GluLaunch(rows=8, block_inter=min(256, triton.next_power_of_2(intermediate)), warps=4)


@triton.jit
def _gate_up_slice(gate_up, row_in, m_r, i0, I: tl.constexpr, BI: tl.constexpr):
    """Channels i0 ... i0 + BI of the rows' gate and up halves: (their offsets, the [rows, BI] mask, gate, up in fp32)."""
    o_i = i0 + tl.arange(0, BI)
    m = m_r[:, None] & (o_i < I)[None, :]
    gate = tl.load(gate_up + row_in + o_i[None, :], mask=m, other=0.0).to(tl.float32)
    up = tl.load(gate_up + row_in + I + o_i[None, :], mask=m, other=0.0).to(tl.float32)
    return o_i, m, gate, up


@triton.jit
def _weighted_glu_fwd_kernel(gate_up, weights, out, S, gate_cap, up_cap, I: tl.constexpr, ROWS: tl.constexpr,
                             BI: tl.constexpr, SITU: tl.constexpr, UP_CAP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = rows < S
    w = tl.load(weights + rows, mask=m_r, other=0.0).to(tl.float32)[:, None]
    row_in, row_out = rows.to(tl.int64)[:, None] * (2 * I), rows.to(tl.int64)[:, None] * I
    for i0 in range(0, I, BI):
        o_i, m, gate, up = _gate_up_slice(gate_up, row_in, m_r, i0, I, BI)
        h = gated_activation(gate, up, gate_cap, up_cap, SITU, UP_CAP) * w
        tl.store(out + row_out + o_i[None, :], h.to(out.dtype.element_ty), mask=m)


@triton.jit
def _weighted_glu_bwd_kernel(gate_up, weights, grad_out, grad_gate_up, grad_weights, S, gate_cap, up_cap,
                             I: tl.constexpr, ROWS: tl.constexpr, BI: tl.constexpr, SITU: tl.constexpr,
                             UP_CAP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = rows < S
    w = tl.load(weights + rows, mask=m_r, other=0.0).to(tl.float32)[:, None]
    row_in, row_out = rows.to(tl.int64)[:, None] * (2 * I), rows.to(tl.int64)[:, None] * I
    grad_w = tl.zeros((ROWS,), dtype=tl.float32)
    for i0 in range(0, I, BI):
        o_i, m, gate, up = _gate_up_slice(gate_up, row_in, m_r, i0, I, BI)
        grad_h = tl.load(grad_out + row_out + o_i[None, :], mask=m, other=0.0).to(tl.float32)
        a, a_gate, a_up = gated_activation_and_grads(gate, up, gate_cap, up_cap, SITU, UP_CAP)
        grad_w += tl.sum(grad_h * a, 1)
        tl.store(grad_gate_up + row_in + o_i[None, :], (grad_h * w * a_gate).to(grad_gate_up.dtype.element_ty),
                 mask=m)
        tl.store(grad_gate_up + row_in + I + o_i[None, :], (grad_h * w * a_up).to(grad_gate_up.dtype.element_ty),
                 mask=m)
    tl.store(grad_weights + rows, grad_w.to(grad_weights.dtype.element_ty), mask=m_r)


def _weighted_glu(gate_up: torch.Tensor, weights: torch.Tensor, situ: bool, gate_cap: float,
                  up_cap: Optional[float]) -> torch.Tensor:
    S, I = gate_up.shape[0], gate_up.shape[1] // 2
    launch = glu_launch(I)
    out = gate_up.new_empty(S, I)
    _weighted_glu_fwd_kernel[(triton.cdiv(S, launch.rows),)](
        gate_up, weights, out, S, gate_cap, 1.0 if up_cap is None else up_cap, I=I, ROWS=launch.rows,
        BI=launch.block_inter, SITU=situ, UP_CAP=up_cap is not None, num_warps=launch.warps)
    return out


weighted_glu_op = torch.library.custom_op("kda_moe::weighted_glu", _weighted_glu, mutates_args=())


@weighted_glu_op.register_fake
def _(gate_up, weights, situ, gate_cap, up_cap):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


@torch.library.custom_op("kda_moe::weighted_glu_bwd", mutates_args=())
def weighted_glu_bwd_op(gate_up: torch.Tensor, weights: torch.Tensor, grad_out: torch.Tensor, situ: bool,
                        gate_cap: float, up_cap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor]:
    S, I = gate_up.shape[0], gate_up.shape[1] // 2
    launch = glu_launch(I)
    grad_gate_up, grad_weights = torch.empty_like(gate_up), torch.empty_like(weights)
    _weighted_glu_bwd_kernel[(triton.cdiv(S, launch.rows),)](
        gate_up, weights, grad_out.contiguous(), grad_gate_up, grad_weights, S, gate_cap,
        1.0 if up_cap is None else up_cap, I=I, ROWS=launch.rows, BI=launch.block_inter, SITU=situ,
        UP_CAP=up_cap is not None, num_warps=launch.warps)
    return grad_gate_up, grad_weights


@weighted_glu_bwd_op.register_fake
def _(gate_up, weights, grad_out, situ, gate_cap, up_cap):
    return gate_up.new_empty(gate_up.shape), weights.new_empty(weights.shape)


def _setup(ctx, inputs, output):
    gate_up, weights, situ, gate_cap, up_cap = inputs
    ctx.save_for_backward(gate_up, weights)
    ctx.activation = (situ, gate_cap, up_cap)


def _backward(ctx, grad_out):
    gate_up, weights = ctx.saved_tensors
    return (*weighted_glu_bwd_op(gate_up, weights, grad_out, *ctx.activation), None, None, None)


torch.library.register_autograd("kda_moe::weighted_glu", _backward, setup_context=_setup)


def weighted_glu(gate_up: torch.Tensor, weights: torch.Tensor, kind: str, gate_cap: float,
                 up_cap: float | None) -> torch.Tensor:
    """``A(gate) U(up) w`` per row: gate_up [S, 2I] (gate channels, then up), weights [S] -> [S, I] in gate_up's
    dtype, fp32 inside; differentiable in both inputs."""
    return op_for_call(weighted_glu_op, _weighted_glu)(
        gate_up.contiguous(), weights.contiguous(), kind == "situ", float(gate_cap),
        None if up_cap is None else float(up_cap))


class _SpreadToPairs(torch.autograd.Function):
    """Token rows [N, d] -> pair rows [S, d]: ``rows[pair_token]``; its backward is ``_SumOverPairs``'s forward."""

    @staticmethod
    def forward(ctx, rows, pair_token, pair_rank, k):
        ctx.save_for_backward(pair_rank)
        ctx.k = k
        return rows.index_select(0, pair_token)

    @staticmethod
    def backward(ctx, grad_pairs):
        (pair_rank,) = ctx.saved_tensors
        return _sum_over_pairs(grad_pairs, pair_rank, ctx.k), None, None, None


class _SumOverPairs(torch.autograd.Function):
    """Pair rows [S, d] -> token rows [N, d]: each token's k pair rows, in its choice order, summed in fp32; its
    backward is ``_SpreadToPairs``'s forward."""

    @staticmethod
    def forward(ctx, pairs, pair_token, pair_rank, k):
        ctx.save_for_backward(pair_token)
        return _sum_over_pairs(pairs, pair_rank, k)

    @staticmethod
    def backward(ctx, grad_rows):
        (pair_token,) = ctx.saved_tensors
        return grad_rows.index_select(0, pair_token), None, None, None


def _sum_over_pairs(pairs: torch.Tensor, pair_rank: torch.Tensor, k: int) -> torch.Tensor:
    """[S, d] rows in expert order -> [N, d]: row n sums the rows of pairs (n, 0) ... (n, k - 1)."""
    return pairs.index_select(0, pair_rank).unflatten(0, (-1, k)).sum(1, dtype=torch.float32).to(pairs.dtype)


def grouped_experts_triton(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                           gate_up_proj: torch.Tensor | Mxfp4Weight, down_proj: torch.Tensor | Mxfp4Weight, *,
                           kind: str, gate_cap: float, up_cap: float | None) -> torch.Tensor:
    """hidden_states [N, l], top_k_index / top_k_weights [N, k], gate_up_proj [E, 2I, l], down_proj [E, l, I] (dense
    or mxfp4) -> [N, l] in hidden_states' dtype; differentiable in the states, the routing weights and dense weights."""
    N, k = top_k_index.shape
    E = gate_up_proj.shape[0]
    order = top_k_index.flatten().argsort(stable=True)  # [S]: the pairs sorted by expert, token order within an expert
    pair_rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    pair_token = order // k
    offsets = expert_loads(top_k_index, E).cumsum(0, dtype=torch.int32)  # [E]: end of each expert's pairs
    x = _SpreadToPairs.apply(hidden_states, pair_token, pair_rank, k)  # [S, l]
    gate_up = expert_matmul(x, gate_up_proj, offsets)  # [S, 2I]
    h = weighted_glu(gate_up, top_k_weights.flatten().index_select(0, order), kind, gate_cap, up_cap)  # [S, I]
    y = expert_matmul(h, down_proj, offsets)  # [S, l]
    return _SumOverPairs.apply(y, pair_token, pair_rank, k).to(hidden_states.dtype)


def expert_matmul(x: torch.Tensor, weight: torch.Tensor | Mxfp4Weight, offsets: torch.Tensor) -> torch.Tensor:
    """``x[r] @ W_e.T`` for the rows r of each expert e: x [S, K] sorted by expert, weight [E, N, K], offsets [E] the
    end of each expert's rows -> [S, N]. Dense weights through transformers' grouped GEMM dispatcher, mxfp4 ones
    (``Mxfp4Weight``) through our kernel, which decodes them in registers (differentiable in x only)."""
    if isinstance(weight, Mxfp4Weight):
        return mxfp4_grouped_mm_triton(x, weight, offsets)
    return grouped_mm(x, weight.transpose(1, 2), offsets)
