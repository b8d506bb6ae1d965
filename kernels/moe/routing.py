"""A sigmoid router in two kernels: ``router_logits_triton`` gives a few tokens' fp32 logits ``[N, E]`` from their
hidden states ``[N, d]`` (any float dtype, widened in registers) and the router weight ``[E, d]``;
``sigmoid_top_k_triton`` takes logits and the selection bias ``[E]`` and returns each token's k chosen experts, best
first, with their mixing weights (``reference.sigmoid_top_k`` without expert groups).

The logits kernel runs a program per expert, which reads the expert's router row once and multiplies it with all the
tokens' states (the rows of its tiles; they come from L2 after the first program), fp32 products summed in fp32: at a
decoding step it replaces the widening copy and cuBLAS's two-kernel fp32 GEMV. Given the RMSNorm before the MoE
layer (``input_norm``), every program normalises the states as it reads them (``kernels/rows.py``), so the router
reads the residual stream itself and no norm kernel runs before it.

The top-k kernel: one program per token holds its E scores in registers and picks the k best by k rounds of
max-and-remove (the lowest id among equal scores), then gathers, renormalises and scales the unbiased scores of the
chosen. Torch needs a sigmoid, a two-pass top-k with its sort, a gather and a sum for the same; at a decoding step
each of those is a launch of a few microseconds per MoE layer. No host reads, fixed grids: torch.compile keeps the
custom ops and a CUDA graph replays them. Launched as dependent (``dependent_launch``), the logits kernel's programs
load their router row, and the top-k kernel's the bias, while the kernel before them still runs.
"""

import torch

from ..backend import op_for_call, refuse_autograd, tl, triton
from ..dependent_launch import dependent_launch, wait_for_inputs
from ..rows import load_input_slab, rms_scales
from .limits import MAX_DECODE_TOKENS, MAX_ROUTED_EXPERTS

# One warp a token for the top-k: its 3k reductions over the E scores form a serial chain, which within a warp are
# shuffles, across warps shared-memory round trips (MAX_ROUTED_EXPERTS scores are 32 registers a thread).
TOP_K_WARPS = 1


@triton.jit
def _weight_slice(w, d0, D: tl.constexpr, BD: tl.constexpr):
    """Columns ``d0 + [0, BD)`` of the router row ``[D]`` at w."""
    o_d = d0 + tl.arange(0, BD)
    return tl.load(w + o_d, mask=o_d < D, other=0.0)


@triton.jit
def _row_products(x_rows, m_t, bw, d0, D: tl.constexpr, BD: tl.constexpr, scales, norm_weight, NORM: tl.constexpr):
    """[ROWS] fp32: columns ``d0 + [0, BD)`` of the token rows of length D at pointers x_rows (masked by m_t; with
    ``NORM`` through the RMSNorm, ``load_input_slab``) times bw ``[BD]``, summed."""
    bx = load_input_slab(x_rows, m_t, d0, D, BD, scales, norm_weight, NORM)
    return tl.sum(bx.to(tl.float32) * bw.to(tl.float32)[None, :], 1)


@triton.jit
def _router_logits_kernel(x, w, logits, norm_weight, eps, N, E, D: tl.constexpr, ROWS: tl.constexpr,
                          BD: tl.constexpr, NORM: tl.constexpr, DEPENDENT: tl.constexpr):
    expert = tl.program_id(0).to(tl.int64)
    o_t = tl.arange(0, ROWS)
    m_t = o_t < N
    x_rows = x + o_t * D
    w += expert * D
    first = _weight_slice(w, 0, D, BD)  # a weight: read before the wait for x
    wait_for_inputs(DEPENDENT)
    scales = rms_scales(x_rows, m_t, D, eps, BD, NORM)
    acc = _row_products(x_rows, m_t, first, 0, D, BD, scales, norm_weight, NORM)
    for d0 in range(BD, D, BD):
        acc += _row_products(x_rows, m_t, _weight_slice(w, d0, D, BD), d0, D, BD, scales, norm_weight, NORM)
    tl.store(logits + o_t * E + expert, acc, mask=m_t)


def _router_logits(hidden_states: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor:
    """``norm_weight`` ``[d]``: the states go through that RMSNorm (of epsilon ``eps``) first."""
    (N, D), E = hidden_states.shape, weight.shape[0]
    logits = torch.empty(N, E, device=hidden_states.device, dtype=torch.float32)
    if N:
        rows = triton.next_power_of_2(N)
        block_d = min(1024, triton.next_power_of_2(D), max(64, 4096 // rows))  # [rows, BD] fp32: 32 a thread
        _router_logits_kernel[(E,)](hidden_states, weight, logits,
                                    hidden_states if norm_weight is None else norm_weight, float(eps), N, E, D=D,
                                    ROWS=rows, BD=block_d, NORM=norm_weight is not None, num_warps=4,
                                    **dependent_launch(hidden_states.device))
    return logits


router_logits_op = torch.library.custom_op("kda_moe::router_logits", _router_logits, mutates_args=())


@router_logits_op.register_fake
def _(hidden_states, weight, norm_weight=None, eps=0.0):
    return hidden_states.new_empty(hidden_states.shape[0], weight.shape[0], dtype=torch.float32)


def router_logits_triton(hidden_states: torch.Tensor, weight: torch.Tensor, *,
                         input_norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """fp32 logits [N, E] of at most ``MAX_DECODE_TOKENS`` tokens' hidden states [N, d] (bf16, fp16 or fp32) under a
    router weight [E, d] (any float dtype; both read in place when contiguous), in full fp32; with ``input_norm``
    (weight [d], eps) of the states' RMSNorm (``norm.reference.rms_norm``) first. Inference only."""
    norm_weight, eps = input_norm or (None, 0.0)
    if hidden_states.dim() != 2 or weight.dim() != 2 or hidden_states.shape[1] != weight.shape[1] or (
        hidden_states.shape[0] > MAX_DECODE_TOKENS
    ) or (norm_weight is not None and norm_weight.shape != hidden_states.shape[1:]):
        raise ValueError(
            f"the Triton router-logits kernel takes hidden states [N, d] with N <= {MAX_DECODE_TOKENS}, a weight "
            f"[E, d] and an input norm's weight [d]; got hidden states {tuple(hidden_states.shape)}, weight "
            f"{tuple(weight.shape)} and norm weight {None if norm_weight is None else tuple(norm_weight.shape)}. "
            "Compute more tokens' logits with F.linear(hidden_states.float(), weight.float()) (backend=\"torch\"), "
            "and pass weights of the states' width."
        )
    inputs = [t for t in (hidden_states, weight, norm_weight) if t is not None]
    refuse_autograd("the Triton router-logits kernel", inputs, "the PyTorch reference")
    hidden_states, weight = hidden_states.contiguous(), weight.contiguous()
    norm_weight = None if norm_weight is None else norm_weight.contiguous()
    return op_for_call(router_logits_op, _router_logits)(hidden_states, weight, norm_weight, float(eps))


@triton.jit
def _sigmoid_top_k_kernel(logits, bias, weights, indices, E, scale, K: tl.constexpr, KP: tl.constexpr,
                          EP: tl.constexpr, RENORMALIZE: tl.constexpr, DEPENDENT: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, EP)
    m_e = o_e < E
    bias_e = tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32)  # constant while decoding: read before the wait
    wait_for_inputs(DEPENDENT)
    scores = tl.sigmoid(tl.load(logits + token * E + o_e, mask=m_e, other=0.0))
    choice = tl.where(m_e, scores + bias_e, float("-inf"))
    o_k = tl.arange(0, KP)
    chosen = tl.zeros((KP,), dtype=tl.int64)
    chosen_scores = tl.zeros((KP,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(choice, 0)
        expert = tl.min(tl.where(choice == best, o_e, EP), 0)
        chosen = tl.where(o_k == j, expert, chosen)
        chosen_scores = tl.where(o_k == j, tl.sum(tl.where(o_e == expert, scores, 0.0), 0), chosen_scores)
        choice = tl.where(o_e == expert, float("-inf"), choice)
    if RENORMALIZE:  # lanes past K hold 0
        chosen_scores = chosen_scores / (tl.sum(chosen_scores, 0) + 1e-20)
    tl.store(weights + token * K + o_k, chosen_scores * scale, mask=o_k < K)
    tl.store(indices + token * K + o_k, chosen, mask=o_k < K)


def _sigmoid_top_k(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    N, E = router_logits.shape
    weights = router_logits.new_empty(N, top_k)
    indices = torch.empty(N, top_k, dtype=torch.int64, device=router_logits.device)
    if N:
        _sigmoid_top_k_kernel[(N,)](router_logits, bias, weights, indices, E, scale, K=top_k,
                                    KP=triton.next_power_of_2(top_k), EP=triton.next_power_of_2(E),
                                    RENORMALIZE=renormalize, num_warps=TOP_K_WARPS,
                                    **dependent_launch(router_logits.device))
    return weights, indices


sigmoid_top_k_op = torch.library.custom_op("kda_moe::sigmoid_top_k", _sigmoid_top_k, mutates_args=())


@sigmoid_top_k_op.register_fake
def _(router_logits, bias, top_k, renormalize, scale):
    N = router_logits.shape[0]
    return router_logits.new_empty(N, top_k), router_logits.new_empty(N, top_k, dtype=torch.int64)


def sigmoid_top_k_triton(router_logits, bias, top_k, *, renormalize, scale):
    """(weights [N, k] fp32, expert ids [N, k] int64, best first) from fp32 router logits [N, E] and bias [E] (any
    float dtype, widened as it is read), E up to ``MAX_ROUTED_EXPERTS``. Inference only: no backward."""
    E = router_logits.shape[-1]
    if router_logits.dim() != 2 or router_logits.dtype != torch.float32 or bias.shape != (E,) or not (
        0 < top_k <= E <= MAX_ROUTED_EXPERTS
    ):
        raise ValueError(
            f"the Triton top-k router takes fp32 logits [N, E] with E <= {MAX_ROUTED_EXPERTS}, a bias [E] and 0 < "
            f"top_k <= E; got logits {tuple(router_logits.shape)} in {router_logits.dtype}, bias "
            f"{tuple(bias.shape)} and top_k={top_k}. Route on the PyTorch reference (backend=\"torch\") otherwise."
        )
    refuse_autograd("the Triton top-k router", [router_logits], "the PyTorch reference")
    router_logits, bias = router_logits.contiguous(), bias.contiguous()  # a bf16 bias (.to(bf16)) widens in-kernel
    return op_for_call(sigmoid_top_k_op, _sigmoid_top_k)(router_logits, bias, top_k, renormalize, float(scale))
