"""Routed experts: the router's top-k choice, the entry points the model calls for a few tokens (decoding) and for
many (training, prefill), the gated activation the experts share with the dense MLP, and the grouped product of
experts' weights stored mxfp4."""

import torch
import torch.nn.functional as F

from ..backend import TRITON_AVAILABLE, resolve_backend
from ..norm import check_input_norm
from ..norm.reference import rms_norm
from .limits import KERNEL_DTYPES, MAX_DECODE_TOKENS, MAX_ROUTED_EXPERTS, fits_decode_kernel
from .reference import (ACTIVATIONS, Mxfp4Weight, dequantize_mxfp4, expert_loads, gated_activation,
                        MXFP4_GROUP, mxfp4_grouped_mm_reference, mxfp4_row_bytes, routed_experts, sigmoid_top_k)

if TRITON_AVAILABLE:
    from .decode import moe_decode_triton
    from .grouped import grouped_experts_triton
    from .mxfp4 import mxfp4_grouped_mm_triton
    from .routing import router_logits_triton, sigmoid_top_k_triton


def _check_inputs(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}.")
    if hidden_states.dim() != 2 or len(gate_up_proj.shape) != 3 or len(down_proj.shape) != 3:
        raise ValueError(
            f"hidden_states must be [N, l], gate_up_proj [E, 2I, l] and down_proj [E, l, I], got "
            f"{tuple(hidden_states.shape)}, {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}."
        )
    N, L = hidden_states.shape
    E, _, I = down_proj.shape
    if down_proj.shape[1] != L or gate_up_proj.shape != (E, 2 * I, L):
        raise ValueError(
            f"gate_up_proj must be [E, 2I, l] = {(E, 2 * I, L)} and down_proj [E, l, I] with l = {L} (the hidden "
            f"states' width), got {tuple(gate_up_proj.shape)} and {tuple(down_proj.shape)}."
        )
    if top_k_index.dim() != 2 or top_k_index.shape[0] != N or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must both be [N, k] with N = {N}, got {tuple(top_k_index.shape)} and "
            f"{tuple(top_k_weights.shape)}."
        )
    if top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_k_index must hold expert ids as int32 or int64, got {top_k_index.dtype}.")


def _check_shared_expert(hidden_states, shared):
    if shared is None:
        return
    L = hidden_states.shape[1]
    gate, up, down = shared
    if gate.dim() != 2 or gate.shape[1] != L or up.shape != gate.shape or down.shape != (L, gate.shape[0]):
        raise ValueError(
            f"shared must be a shared expert's (gate [Is, l], up [Is, l], down [l, Is]) weights with l = {L} (the "
            f"hidden states' width), got {tuple(gate.shape)}, {tuple(up.shape)} and {tuple(down.shape)}."
        )


def _check_residual(hidden_states, residual):
    if residual is not None and (residual.shape != hidden_states.shape or residual.dtype != hidden_states.dtype):
        raise ValueError(
            f"the residual must be the hidden states' shape and dtype, {tuple(hidden_states.shape)} in "
            f"{hidden_states.dtype}, got {tuple(residual.shape)} in {residual.dtype}: pass the residual stream the "
            "layer's output is added to (its RMSNorm gave the hidden states)."
        )


def moe_decode(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    activation: str,
    gate_cap: float,
    up_cap: float | None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    input_norm: tuple[torch.Tensor, float] | None = None,
    residual: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The routed experts of a few tokens: ``sum_j w_j down_j(act(gate_up_j(x)))`` per token, plus with ``shared``
    (a shared expert's gate ``[Is, l]``, up ``[Is, l]`` and down ``[l, Is]`` weights) ``down_s(act(gate_s(x),
    up_s(x)))``, summed with the routed experts' in fp32 (one launch sequence for both).

    hidden_states ``[N, l]``; top_k_index (ids in ``[0, E)``) / top_k_weights ``[N, k]``; gate_up_proj ``[E, 2I, l]``
    (gate rows, then up rows) and down_proj ``[E, l, I]`` as the experts module stores them; ``activation`` "silu" or
    "situ" with ``gate_cap`` / ``up_cap`` as in ``gated_activation``. A pre-norm MoE layer's norm and residual add:
    with ``input_norm`` (weight ``[l]``, eps) x is ``norm.reference.rms_norm`` of the hidden states, with
    ``residual`` (``[N, l]`` in their dtype) the result is ``residual + ...``. Returns ``[N, l]`` in hidden_states'
    dtype.
    The Triton kernel reads each chosen expert's weights once, in place (no gathered copy), with fp32 products and
    sums, the norm in its up kernel and the residual add in its sum; it takes up to ``MAX_DECODE_TOKENS`` tokens
    with contiguous weights of their dtype, and no autograd. ``"auto"`` runs anything else on the reference (the
    norm, the experts, which gather the chosen experts' weights per token, and the add)."""
    _check_inputs(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    _check_shared_expert(hidden_states, shared)
    check_input_norm(hidden_states, input_norm)
    _check_residual(hidden_states, residual)
    extra = [t for t in (*(shared or ()), input_norm and input_norm[0], residual) if t is not None]
    differentiable = (hidden_states, top_k_weights, gate_up_proj, down_proj, *extra)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in differentiable)
    supported = fits_decode_kernel(hidden_states, gate_up_proj, down_proj, *(shared or ())) and not needs_grad
    options = dict(gate_cap=gate_cap, up_cap=up_cap, shared=shared)
    if resolve_backend(backend, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *extra,
                       supported=supported) == "triton":
        return moe_decode_triton(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, kind=activation,
                                 input_norm=input_norm, residual=residual, **options)
    if input_norm is not None:
        hidden_states = rms_norm(hidden_states, *input_norm)
    out = routed_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, **options)
    return out if residual is None else residual + out


def grouped_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor | Mxfp4Weight,
    down_proj: torch.Tensor | Mxfp4Weight,
    *,
    activation: str,
    gate_cap: float,
    up_cap: float | None,
    backend: str = "auto",
) -> torch.Tensor:
    """The routed experts of many tokens, with autograd: ``sum_j w_j down_j(act(gate_up_j(x)))`` per token.

    Arguments as ``moe_decode``'s; either weight may also be mxfp4 (``Mxfp4Weight``, frozen). The Triton path
    (``grouped.py``) sorts the (token, choice) pairs by expert, runs one grouped GEMM per projection (decoding mxfp4
    weights in registers) and the gated activation with the routing weights in one kernel, and sums each token's
    pairs back in a fixed order; differentiable in the states, the routing weights and dense weights. The reference
    decodes mxfp4 weights to the states' dtype and gathers the chosen experts' weights per token."""
    _check_inputs(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation)
    options = dict(gate_cap=gate_cap, up_cap=up_cap)
    weights = (gate_up_proj, down_proj)
    tensors = [t for weight in weights for t in (weight if isinstance(weight, Mxfp4Weight) else (weight,))]
    if resolve_backend(backend, hidden_states, top_k_index, top_k_weights, *tensors) == "triton":
        return grouped_experts_triton(hidden_states, top_k_index, top_k_weights, *weights, kind=activation, **options)
    gate_up_proj, down_proj = (
        dequantize_mxfp4(*w, hidden_states.dtype) if isinstance(w, Mxfp4Weight) else w for w in weights
    )
    return routed_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, activation, **options)


def router_logits(hidden_states: torch.Tensor, weight: torch.Tensor, *,
                  input_norm: tuple[torch.Tensor, float] | None = None, backend: str = "auto") -> torch.Tensor:
    """A router's fp32 logits ``[N, E]``: hidden_states ``[N, d]`` times weight ``[E, d]``, both taken in fp32; with
    ``input_norm`` (weight ``[d]``, eps) the states go through that RMSNorm first (``norm.reference.rms_norm``, in
    their dtype). One Triton kernel, the norm inside, for at most ``MAX_DECODE_TOKENS`` tokens (a decoding step)
    without autograd; ``"auto"`` gives more tokens, or a call that needs gradients, the norm and ``F.linear`` on the
    widened tensors."""
    check_input_norm(hidden_states, input_norm)
    norm_weight = input_norm and input_norm[0]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (hidden_states, weight, norm_weight))
    supported = (hidden_states.dim() == 2 and hidden_states.shape[0] <= MAX_DECODE_TOKENS
                 and hidden_states.dtype in KERNEL_DTYPES and not needs_grad)
    if resolve_backend(backend, hidden_states, weight, norm_weight, supported=supported) == "triton":
        return router_logits_triton(hidden_states, weight, input_norm=input_norm)
    if input_norm is not None:
        hidden_states = rms_norm(hidden_states, *input_norm)
    return F.linear(hidden_states.float(), weight.float())


def top_k_routing(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scale: float = 1.0,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sigmoid router's choice (``reference.sigmoid_top_k``): router_logits ``[N, E]`` -> (mixing weights ``[N, k]``,
    expert ids ``[N, k]`` int64, best first). One Triton kernel for fp32 logits of up to ``MAX_ROUTED_EXPERTS``
    experts without expert groups (``n_group=1``) and without autograd; ``"auto"`` runs anything else on the
    reference, whose weights carry the gradient to the router."""
    needs_grad = torch.is_grad_enabled() and router_logits.requires_grad
    E = router_logits.shape[-1]
    supported = (router_logits.dim() == 2 and router_logits.dtype == torch.float32 and n_group == 1
                 and E <= MAX_ROUTED_EXPERTS and not needs_grad)
    if resolve_backend(backend, router_logits, bias, supported=supported) == "triton":
        if n_group != 1:
            raise ValueError(f"the Triton top-k router does not restrict the choice to expert groups (n_group="
                             f"{n_group}); route on the PyTorch reference (backend=\"torch\" or \"auto\").")
        return sigmoid_top_k_triton(router_logits, bias, top_k, renormalize=renormalize, scale=scale)
    return sigmoid_top_k(router_logits, bias, top_k, n_group, topk_group, renormalize, scale)


def _check_mxfp4_inputs(x, weight, offsets):
    packed, scale = weight
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(
            f"weight.packed and weight.scale must be uint8 (compressed-tensors' weight_packed / weight_scale bytes), "
            f"got {packed.dtype} and {scale.dtype}; bytes cast to a float dtype (as a loader does) are exact: cast "
            "them back with .to(torch.uint8)."
        )
    if x.dim() != 2 or packed.dim() != 3:
        raise ValueError(f"x must be [S, K] and weight.packed [E, N, K / 2], got {tuple(x.shape)} and "
                         f"{tuple(packed.shape)}.")
    if x.dtype not in KERNEL_DTYPES:
        raise ValueError(f"x must be one of {KERNEL_DTYPES}, got {x.dtype}.")
    K = x.shape[1]
    if K % MXFP4_GROUP:
        raise ValueError(
            f"x's width K = {K} must be a multiple of {MXFP4_GROUP}: mxfp4 stores one scale per {MXFP4_GROUP} weights "
            f"along K. Pad x with zero columns and the weights with zeros to K = {MXFP4_GROUP * -(-K // MXFP4_GROUP)}."
        )
    E, N = packed.shape[:2]
    if packed.shape != (E, N, K // 2) or scale.shape != (E, N, K // MXFP4_GROUP):
        raise ValueError(
            f"weight.packed must be [E, N, K / 2] = {(E, N, K // 2)} and weight.scale [E, N, K / 32] = "
            f"{(E, N, K // MXFP4_GROUP)} for x of width K = {K}, got {tuple(packed.shape)} and {tuple(scale.shape)}."
        )
    if offsets.shape != (E,) or offsets.dtype != torch.int32:
        raise ValueError(
            f"offsets must be [E] = [{E}] int32, the end of each expert's rows (the cumulative sum of the rows per "
            f"expert, grouped_mm's offs), got {tuple(offsets.shape)} {offsets.dtype}."
        )


def mxfp4_grouped_mm(x: torch.Tensor, weight: Mxfp4Weight, offsets: torch.Tensor, *,
                     backend: str = "auto") -> torch.Tensor:
    """``x[r] @ W_e.T`` for every row r of expert e, the experts' weights stored mxfp4: x ``[S, K]`` (bf16, fp16 or
    fp32) sorted by expert, weight ``[E, N, K]`` (``Mxfp4Weight``), offsets ``[E]`` int32 the end of each expert's
    rows (``offsets[-1] == S``, as grouped_mm's ``offs``) -> ``[S, N]`` in x's dtype; differentiable in x.

    The Triton kernel (``mxfp4.py``) decodes each weight tile in registers and multiplies bf16 operands (fp32 for fp32
    inputs) with fp32 sums; the reference decodes whole experts (``dequantize_mxfp4``) and multiplies in fp32."""
    _check_mxfp4_inputs(x, weight, offsets)
    if resolve_backend(backend, x, weight.packed, weight.scale, offsets) == "triton":
        return mxfp4_grouped_mm_triton(x, weight, offsets)
    return mxfp4_grouped_mm_reference(x, weight, offsets)


__all__ = [
    "MAX_DECODE_TOKENS",
    "MXFP4_GROUP",
    "Mxfp4Weight",
    "dequantize_mxfp4",
    "expert_loads",
    "fits_decode_kernel",
    "gated_activation",
    "grouped_experts",
    "moe_decode",
    "mxfp4_grouped_mm",
    "mxfp4_grouped_mm_reference",
    "mxfp4_row_bytes",
    "routed_experts",
    "router_logits",
    "sigmoid_top_k",
    "top_k_routing",
]
