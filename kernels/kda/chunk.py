"""Triton KDA: public entry point, autograd and ``torch.library`` custom ops.

``chunk_kda_triton`` computes the same function as ``kimi_delta_attention(..., backend="torch")``
(see ``kernels/kda/__init__.py``) with every pre-processing step fused into the kernels:

Args:
    q, k: ``[B, T, H, K]`` after the short conv + SiLU (NOT L2-normalised); K a power of two >= 16.
    v: ``[B, T, H, V]``.
    g: ``[B, T, H, K]`` or ``[B, T, H*K]`` raw gate logits (dt_bias not added).
    beta: ``[B, T, H]`` logits.
    A_log: ``[H]``; dt_bias: ``[H*K]`` (fp32).
    gate_lower_bound: None (``-exp(A_log) softplus(z)``) or a negative float
        (``lb * sigmoid(exp(A_log) z)``; with ``|lb| <= 5.9`` every intra-chunk tile is a GEMM).
    scale: query scale, default ``K ** -0.5``.
    initial_state: ``[N, H, K, V]`` fp32 (N = B, or the number of sequences with cu_seqlens).
    output_final_state: also return the fp32 final state.
    cu_seqlens: ``[N+1]`` offsets of packed sequences (B == 1); the state restarts per sequence.

Returns ``(o [B, T, H, V] in v.dtype, final_state [N, H, K, V] fp32 or None)``. The state is
always fp32; inputs may be bf16, fp16 or fp32.
"""

from typing import Optional

import torch

from ..backend import op_for_call
from .chunk_bwd import chunk_kda_bwd
from .chunk_fwd import chunk_kda_fwd, storage_dtype
from .chunk_tiles import BT
from .tile_limits import require_triton_tiles

_EMPTY = (0,)


def _num_states(q, cu_seqlens):
    return q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _chunk_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], gate_lower_bound: Optional[float], scale: float, output_final_state: bool,
    keep_scores: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final state, A_qk, T, norms); the last three are what the backward reuses (``keep_scores``): the chunk
    matrices and the rows' inverse q / k norms."""
    o, ht, scores = chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale, initial_state,
                                  output_final_state, cu_seqlens, keep_scores=keep_scores)
    Aqk, Tm, norms = scores if keep_scores else (_empty(q), _empty(q), _empty(q, torch.float32))
    return o, (ht if ht is not None else _empty(q, torch.float32)), Aqk, Tm, norms


kda_chunk_fwd_op = torch.library.custom_op("kda_moe::kda_chunk_fwd", _chunk_fwd, mutates_args=())


def _empty(like, dtype=None):
    return like.new_empty(_EMPTY, dtype=dtype)


@kda_chunk_fwd_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, gate_lower_bound, scale, output_final_state,
      keep_scores):
    B, T, H, K = q.shape
    o = v.new_empty(v.shape)
    if output_final_state:
        ht = q.new_empty((_num_states(q, cu_seqlens), H, K, v.shape[-1]), dtype=torch.float32)
    else:
        ht = _empty(q, torch.float32)
    if keep_scores:
        sd = storage_dtype(v.dtype)
        return (o, ht, q.new_empty((B, T, H, BT.value), dtype=sd), q.new_empty((B, T, H, BT.value), dtype=sd),
                q.new_empty((B, T, H, 2), dtype=torch.float32))
    return o, ht, _empty(q), _empty(q), _empty(q, torch.float32)


@torch.library.custom_op("kda_moe::kda_chunk_bwd", mutates_args=())
def kda_chunk_bwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor], gate_lower_bound: Optional[float], scale: float,
    do: torch.Tensor, dht: Optional[torch.Tensor], Aqk: Optional[torch.Tensor], Tm: Optional[torch.Tensor],
    norms: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``kda_chunk_fwd``; ``Aqk``/``Tm``/``norms``: what it kept, or None to recompute them."""
    scores = (Aqk, Tm, norms) if Aqk is not None else None
    dq, dk, dv, dg, db, dA, ddt, dh0 = chunk_kda_bwd(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound, scale,
                                                    initial_state, cu_seqlens, do, dht, scores)
    return dq, dk, dv, dg, db, dA, ddt, (dh0 if dh0 is not None else _empty(q, torch.float32))


@kda_chunk_bwd_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, gate_lower_bound, scale, do, dht, Aqk, Tm,
      norms):
    dh0 = initial_state.new_empty(initial_state.shape) if initial_state is not None else _empty(q, torch.float32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), A_log.new_empty(A_log.shape), dt_bias.new_empty(dt_bias.shape), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, gate_lower_bound, scale, output_final_state, \
        keep_scores = inputs
    Aqk, Tm, norms = output[2:] if keep_scores else (None, None, None)
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Tm, norms)
    ctx.gate_lower_bound = gate_lower_bound
    ctx.scale = scale
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht, _dAqk, _dTm, _dnorms):
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, Aqk, Tm, norms = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    if not ctx.output_final_state:
        dht = None
    dq, dk, dv, dg, db, dA, ddt, dh0 = kda_chunk_bwd_op(
        q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, ctx.gate_lower_bound, ctx.scale,
        do.contiguous(), dht.contiguous() if dht is not None else None, Aqk, Tm, norms)
    return dq, dk, dv, dg, db, dA, ddt, (dh0 if initial_state is not None else None), None, None, None, None, None


torch.library.register_autograd("kda_moe::kda_chunk_fwd", _backward, setup_context=_setup_context)


def chunk_kda_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    A_log: torch.Tensor, dt_bias: torch.Tensor, *, gate_lower_bound: float | None = None,
    scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
):
    """Triton KDA (chunked, chunk 64); same arguments and result as the public ``kimi_delta_attention``."""
    B, T, H, K = q.shape
    require_triton_tiles(K, v.shape[-1])
    scale = K ** -0.5 if scale is None else float(scale)
    lb = None if gate_lower_bound is None else float(gate_lower_bound)
    g4 = g.reshape(B, T, H, K)
    h0 = initial_state.float().contiguous() if initial_state is not None else None
    inputs = (q.contiguous(), k.contiguous(), v.contiguous(), g4.contiguous(), beta.contiguous(),
              A_log.contiguous(), dt_bias.contiguous(), h0)
    # the backward reuses the forward's chunk matrices (256 bytes per token and head) and the rows' inverse norms (8
    # bytes) instead of recomputing them: 7% of forward + backward at 16 x 4096 x 16 (bf16, H200) for 3% more memory
    keep_scores = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    o, ht, *_ = op_for_call(kda_chunk_fwd_op, _chunk_fwd)(*inputs, cu_seqlens, lb, scale, bool(output_final_state),
                                                       keep_scores)
    return o, (ht if output_final_state else None)

