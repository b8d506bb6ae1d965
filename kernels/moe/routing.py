"""A sigmoid router's top-k choice in one kernel: ``sigmoid_top_k_triton`` takes the router logits ``[N, E]`` (fp32)
and the selection bias ``[E]`` and returns each token's k chosen experts, best first, with their mixing weights
(``reference.sigmoid_top_k`` without expert groups).

One program per token holds its E scores in registers and picks the k best by k rounds of max-and-remove (the lowest
id among equal scores), then gathers, renormalises and scales the unbiased scores of the chosen. Torch needs a
sigmoid, a two-pass top-k with its sort, a gather and a sum for the same; at a decoding step each of those is a launch
of a few microseconds per MoE layer. No host reads, fixed grid: torch.compile keeps the custom op and a CUDA graph
replays it.
"""

import torch

from ..backend import op_for_call, refuse_autograd, tl, triton
from .limits import MAX_ROUTED_EXPERTS


@triton.jit
def _sigmoid_top_k_kernel(logits, bias, weights, indices, E, scale, K: tl.constexpr, KP: tl.constexpr,
                          EP: tl.constexpr, RENORMALIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, EP)
    m_e = o_e < E
    scores = tl.sigmoid(tl.load(logits + token * E + o_e, mask=m_e, other=0.0))
    choice = tl.where(m_e, scores + tl.load(bias + o_e, mask=m_e, other=0.0), float("-inf"))
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
                                    RENORMALIZE=renormalize, num_warps=4)
    return weights, indices


sigmoid_top_k_op = torch.library.custom_op("kda_moe::sigmoid_top_k", _sigmoid_top_k, mutates_args=())


@sigmoid_top_k_op.register_fake
def _(router_logits, bias, top_k, renormalize, scale):
    N = router_logits.shape[0]
    return router_logits.new_empty(N, top_k), router_logits.new_empty(N, top_k, dtype=torch.int64)


def sigmoid_top_k_triton(router_logits, bias, top_k, *, renormalize, scale):
    """(weights [N, k] fp32, expert ids [N, k] int64, best first) from fp32 router logits [N, E] and bias [E], E up to
    ``MAX_ROUTED_EXPERTS``. Inference only: no backward."""
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
    router_logits, bias = router_logits.contiguous(), bias.float().contiguous()
    return op_for_call(sigmoid_top_k_op, _sigmoid_top_k)(router_logits, bias, top_k, renormalize, float(scale))
