"""A linear head's next-token cross-entropy without its [tokens, vocab] logits.

The logits of a causal LM's head are the largest activation of a training step: [tokens, vocab] in the compute dtype,
then again in fp32 for the loss, then their gradient. Here the head's product, the loss and both gradients go a chunk
of tokens at a time during the forward, so only one chunk's fp32 logits exist at once, and the backward only scales
the kept gradients by the loss's incoming gradient: the head costs three products, as without chunking.
"""

import torch
import torch.nn.functional as F

# most fp32 logits of one chunk (256 MiB): a chunk holds LOGITS_CHUNK_ELEMENTS // vocab tokens
LOGITS_CHUNK_ELEMENTS = 2**26


class _LinearCrossEntropy(torch.autograd.Function):
    """`scale * sum_i [logsumexp(h_i W^T) - (h_i W^T)[t_i]]` over the tokens i with t_i != ignore_index.

    hidden [N, d], weight [V, d], targets [N], scale [] (the inverse of the loss's divisor) -> []. The products run in
    `compute_dtype` (the autocast dtype under autocast, else the input's), the softmax in fp32, as
    `F.cross_entropy(F.linear(hidden, weight).float(), targets)` computes them. d loss / d logits = scale *
    (softmax - one_hot) is formed chunk by chunk and turned into d/d hidden [N, d] and d/d weight [V, d] (accumulated
    in fp32, or the weight's wider dtype) at once."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, ignore_index, compute_dtype, chunk_rows):
        needs_hidden_grad, needs_weight_grad = ctx.needs_input_grad[:2]
        operands = hidden.to(compute_dtype), weight.to(compute_dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(operands[0]) if needs_hidden_grad else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros_like(weight, dtype=accumulate) if needs_weight_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                chunk_hidden, chunk_targets = operands[0][rows], targets[rows]
                logits = F.linear(chunk_hidden, operands[1]).float()  # [C, V]
                kept = chunk_targets != ignore_index  # [C]
                picked = torch.where(kept, chunk_targets, 0)[:, None]  # [C, 1]: a valid index on ignored rows too
                log_norm = logits.logsumexp(-1, keepdim=True)  # [C, 1]
                loss += torch.where(kept, (log_norm - logits.gather(1, picked)).squeeze(1), 0.0).sum()
                if not (needs_hidden_grad or needs_weight_grad):
                    continue
                grad_logits = logits.sub_(log_norm).exp_()  # the softmax, in the logits' memory
                grad_logits.scatter_add_(1, picked, torch.full_like(log_norm, -1.0))
                grad_logits.mul_(torch.where(kept, scale, 0.0)[:, None])
                grad_logits = grad_logits.to(compute_dtype)
                if needs_hidden_grad:
                    grad_hidden[rows] = grad_logits @ operands[1]
                if needs_weight_grad:
                    grad_weight += grad_logits.T @ chunk_hidden
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = hidden.dtype, weight.dtype
        return loss * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_loss).to(hidden_dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_cross_entropy(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    chunk_elements: int = LOGITS_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """The causal LM loss of transformers' `ForCausalLMLoss` on `F.linear(hidden_states, weight)`, computed without
    those logits.

    hidden_states [..., T, d], weight [V, d]; labels [..., T] (position t's target is labels[t + 1]; the last
    position has none) or shift_labels [..., T] (position t's target, already shifted, as under context parallelism).
    Targets equal to `ignore_index` add nothing. The sum over targets is divided by `num_items_in_batch` when given
    (gradient accumulation), else by the number of targets. Chunks hold `chunk_elements // V` tokens."""
    if (labels is None) == (shift_labels is None):
        raise ValueError("linear_cross_entropy takes `labels` or `shift_labels` (already shifted), exactly one.")
    if weight.ndim != 2 or hidden_states.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden_states [..., d] and weight [vocab, d] must share d, got {tuple(hidden_states.shape)} and "
            f"{tuple(weight.shape)}."
        )
    targets = shift_labels if labels is None else F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if targets.shape != hidden_states.shape[:-1]:
        name = "shift_labels" if labels is None else "labels"
        raise ValueError(
            f"`{name}` must have one entry per position of hidden_states {tuple(hidden_states.shape[:-1])}, got "
            f"{tuple(targets.shape)}."
        )
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])  # [N, d]
    targets = targets.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        num_items_in_batch = (targets != ignore_index).sum()
    scale = 1.0 / torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden.device)
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    chunk_rows = max(1, chunk_elements // weight.shape[0])
    return _LinearCrossEntropy.apply(hidden, weight, targets, scale, ignore_index, compute_dtype, chunk_rows)
