"""Kimi Delta Attention: the fused public entry point used by the model."""

import torch
import torch.nn.functional as F

from ..backend import TRITON_AVAILABLE, resolve_backend
from ..conv import short_conv_step
from ..norm import gated_rms_norm
from .reference import chunk_kda, kda_gate, kda_step, l2norm, recurrent_kda
from .tile_limits import fits_triton_tiles

if TRITON_AVAILABLE:
    from .chunk import chunk_kda_triton
    from .fused_decode import kda_layer_decode_step_triton
    from .recurrent import kda_decode_step_triton


def _check_gate_lower_bound(gate_lower_bound):
    if gate_lower_bound is not None and not gate_lower_bound < 0:
        raise ValueError(f"gate_lower_bound must be negative (e.g. -5.0) or None, got {gate_lower_bound}.")


def _check_inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, gate_lower_bound):
    _check_gate_lower_bound(gate_lower_bound)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}.")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}.")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}.")
    if g.shape != q.shape and g.shape != (B, T, H * K):
        raise ValueError(f"g must be [B, T, H, K] = {tuple(q.shape)} (or [B, T, H*K]), got {tuple(g.shape)}.")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}.")
    if A_log.numel() != H or dt_bias.numel() != H * K:
        raise ValueError(
            f"A_log must have H = {H} elements and dt_bias H*K = {H * K}, got {A_log.numel()} and {dt_bias.numel()}."
        )
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(
                f"cu_seqlens needs packed inputs with batch size 1, got B = {B}; "
                "flatten the batch into one sequence of shape [1, total_tokens, ...]."
            )
        if cu_seqlens.dim() != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != T or (cu_seqlens.diff() < 0).any():
            raise ValueError(
                f"cu_seqlens must be non-decreasing offsets [N+1] from 0 to T = {T}, got {cu_seqlens.tolist()}."
            )
        N = len(cu_seqlens) - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        which = "N = number of sequences in cu_seqlens" if cu_seqlens is not None else "B = batch size"
        raise ValueError(
            f"initial_state must be [{'N' if cu_seqlens is not None else 'B'}, H, K, V] = {(N, H, K, v.shape[-1])} "
            f"({which}), got {tuple(initial_state.shape)}."
        )


def kimi_delta_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    gate_lower_bound: float | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    backend: str = "auto",
):
    """KDA from projected inputs: L2-norms q and k, scales q (default ``K^-0.5``), applies sigmoid to
    beta and ``kda_gate`` to g, then runs the recurrence (T == 1) or the chunked form.

    q, k: ``[B, T, H, K]`` (after the short conv + SiLU, NOT yet L2-normalised); v: ``[B, T, H, V]``;
    g: ``[B, T, H, K]`` raw gate logits f_b(f_a(x)) (dt_bias NOT added); beta: ``[B, T, H]`` logits
    (pre-sigmoid); A_log ``[H]`` fp32, dt_bias ``[H*K]`` fp32. cu_seqlens ``[N+1]`` packs N sequences
    into B == 1. Returns ``(o [B, T, H, V] in v.dtype, final_state [B or N, H, K, V] fp32 or None)``."""
    _check_inputs(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, gate_lower_bound)
    supported = fits_triton_tiles(q.shape[-1], v.shape[-1])
    if resolve_backend(backend, q, k, v, g, beta, supported=supported) == "triton":
        return chunk_kda_triton(
            q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=gate_lower_bound, scale=scale,
            initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k = l2norm(q), l2norm(k)
    g = kda_gate(g, A_log, dt_bias, gate_lower_bound)
    beta = torch.sigmoid(beta.to(q.dtype))
    if q.shape[1] == 1 and cu_seqlens is None:
        return recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state)
    return chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    *,
    gate_lower_bound: float | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One decoding step for a batch of sequences: ``kimi_delta_attention`` at T = 1 with the state updated IN
    PLACE (fixed address, no allocation but the output, so a CUDA graph can capture it).

    q, k, g: ``[B, 1, H, K]`` or ``[B, H, K]``; v: ``[B, 1, H, V]`` or ``[B, H, V]``; beta: ``[B, 1, H]`` or
    ``[B, H]`` (raw, as for ``kimi_delta_attention``); state: ``[B, H, K, V]``. Returns o shaped like v. The Triton
    kernel takes a contiguous fp32 state; ``"auto"`` runs any other on the reference."""
    if state.dim() != 4:
        raise ValueError(f"state must be [B, H, K, V], got shape {tuple(state.shape)}.")
    B, H, K, V = state.shape
    if q.numel() != B * H * K or v.numel() != B * H * V:
        raise ValueError(
            f"kda_decode_step takes one token per sequence of the state {tuple(state.shape)}: q [B, H, K] = "
            f"{(B, H, K)} and v [B, H, V] = {(B, H, V)} (or with a length-1 time axis), got q {tuple(q.shape)} and "
            f"v {tuple(v.shape)}; use kimi_delta_attention for longer inputs."
        )
    out_shape = v.shape
    q, k, g, v = (t.reshape(B, 1, H, -1) for t in (q, k, g, v))
    _check_inputs(q, k, v, g, beta.reshape(B, 1, H), A_log, dt_bias, state, None, gate_lower_bound)
    supported = fits_triton_tiles(K, V) and state.dtype == torch.float32 and state.is_contiguous()
    if resolve_backend(backend, q, k, v, g, beta, state, supported=supported) == "triton":
        o = kda_decode_step_triton(q, k, v, g, beta.reshape(B, H), A_log, dt_bias, state,
                                   gate_lower_bound=gate_lower_bound, scale=scale)
    else:
        o, new_state = kimi_delta_attention(q, k, v, g, beta.reshape(B, 1, H), A_log, dt_bias,
                                            gate_lower_bound=gate_lower_bound, scale=scale, initial_state=state,
                                            output_final_state=True, backend="torch")
        state.copy_(new_state)
    return o.reshape(out_shape)


def _check_layer_step_inputs(qkv, conv_weight, conv_state, g, beta, A_log, dt_bias, state, gate, norm_weight,
                             g_weight, gate_weight):
    if state.dim() != 4:
        raise ValueError(f"state must be [B, H, K, V], got shape {tuple(state.shape)}.")
    B, H, K, V = state.shape
    C = 2 * H * K + H * V
    expected = {"qkv": (qkv, (B, C)), "beta": (beta, (B, H)), "A_log": (A_log, (H,)), "dt_bias": (dt_bias, (H * K,)),
                "norm_weight": (norm_weight, (V,))}
    for name, logits, weight, width in (("g", g, g_weight, H * K), ("gate", gate, gate_weight, H * V)):
        if weight is None:
            expected[name] = (logits, (B, width))
        elif weight.dim() != 2 or logits.shape != (B, weight.shape[1]) or weight.shape[0] != width:
            raise ValueError(
                f"{name}_weight must be [{width}, R] and {name} its low-rank input [B, R] = [{B}, R] (the logits are "
                f"{name} @ {name}_weight^T), got {tuple(weight.shape)} and {tuple(logits.shape)}."
            )
    for name, (tensor, shape) in expected.items():
        if tensor.shape != shape:
            raise ValueError(
                f"{name} must be {shape} for the state [B, H, K, V] = {(B, H, K, V)} (one token per sequence; qkv "
                f"holds q | k | v before the conv: 2*H*K + H*V channels), got {tuple(tensor.shape)}."
            )
    if conv_weight.dim() != 2 or conv_weight.shape[0] != C or conv_state.shape != (B, C, conv_weight.shape[1] - 1):
        raise ValueError(
            f"conv_weight must be [C, W] and conv_state [B, C, W-1] with C = 2*H*K + H*V = {C} and B = {B}, got "
            f"{tuple(conv_weight.shape)} and {tuple(conv_state.shape)}."
        )


def kda_layer_decode_step_unfused(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    g_weight: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    gate_lower_bound: float | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``kda_layer_decode_step`` as separate ops (the gates' up-projections by ``F.linear``, ``short_conv_step``,
    ``kda_decode_step``, ``gated_rms_norm``), each on ``backend``: on ``"torch"`` the reference the fused kernel
    computes, on ``"triton"`` three launches."""
    B, H, K, V = state.shape
    g = g if g_weight is None else F.linear(g, g_weight)
    gate = gate if gate_weight is None else F.linear(gate, gate_weight)
    qkv = short_conv_step(qkv, conv_weight, conv_state, backend=backend)
    q, k, v = (x.reshape(B, H, -1) for x in qkv.split([H * K, H * K, H * V], dim=-1))
    o = kda_decode_step(q, k, v, g.reshape(B, H, K), beta, A_log, dt_bias, state, gate_lower_bound=gate_lower_bound,
                        scale=scale, backend=backend)  # [B, H, V]
    return gated_rms_norm(o, gate.reshape(B, H, V), norm_weight, eps, backend=backend).reshape(B, H * V)


def kda_layer_decode_step(
    qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    g_weight: torch.Tensor | None = None,
    gate_weight: torch.Tensor | None = None,
    gate_lower_bound: float | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """A KDA layer's decoding step between its projections and ``o_proj``, one token per sequence: the short conv
    (SiLU) with its state, ``kimi_delta_attention`` at T = 1 with its state, then the gated RMSNorm. Both states are
    updated IN PLACE (fixed addresses, only the output allocated, so a CUDA graph can capture it); the Triton backend
    runs it as one kernel.

    qkv: ``[B, 2*H*K + H*V]`` (q | k | v projections before the conv); conv_weight: ``[C, W]``; conv_state:
    ``[B, C, W-1]``; g: ``[B, H*K]`` gate logits (dt_bias NOT added); beta: ``[B, H]`` logits; A_log ``[H]``,
    dt_bias ``[H*K]`` fp32; state: ``[B, H, K, V]``; gate: ``[B, H*V]`` output gate logits; norm_weight: ``[V]``.
    With ``g_weight`` ``[H*K, R]`` (``gate_weight`` ``[H*V, R]``), g (gate) is instead the low-rank input ``[B, R]``
    of an up-projection to the logits, ``g @ g_weight^T`` rounded to g's dtype, which the kernel multiplies per head
    (a launch fewer each). Returns ``[B, H*V]`` in qkv's dtype. The Triton kernel takes a contiguous fp32 state and
    a contiguous conv state; ``"auto"`` runs any other on the reference (``kda_layer_decode_step_unfused`` on the
    torch backend)."""
    _check_layer_step_inputs(qkv, conv_weight, conv_state, g, beta, A_log, dt_bias, state, gate, norm_weight, g_weight,
                             gate_weight)
    _check_gate_lower_bound(gate_lower_bound)
    supported = (fits_triton_tiles(*state.shape[2:]) and state.dtype == torch.float32 and state.is_contiguous()
                 and conv_state.is_contiguous())
    options = dict(g_weight=g_weight, gate_weight=gate_weight, gate_lower_bound=gate_lower_bound, scale=scale)
    if resolve_backend(backend, qkv, conv_weight, conv_state, g, beta, state, gate, g_weight, gate_weight,
                       supported=supported) == "triton":
        return kda_layer_decode_step_triton(qkv, conv_weight, conv_state, g, beta, A_log, dt_bias, state, gate,
                                            norm_weight, eps, **options)
    return kda_layer_decode_step_unfused(qkv, conv_weight, conv_state, g, beta, A_log, dt_bias, state, gate,
                                         norm_weight, eps, backend="torch", **options)


__all__ = [
    "kimi_delta_attention",
    "kda_decode_step",
    "kda_layer_decode_step",
    "kda_layer_decode_step_unfused",
    "chunk_kda",
    "recurrent_kda",
    "kda_step",
    "kda_gate",
    "l2norm",
]
