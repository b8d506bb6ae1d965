"""Pure-PyTorch reference for the short causal depthwise convolution (+ its decoding step).

``y_t = act(sum_j weight[:, j] * x_{t-W+1+j})``; the W-1 inputs before the first token come from the
conv state ``[B, C, W-1]`` (zeros when absent). Math in fp32 (fp64 for fp64 inputs); outputs in
``x.dtype``; states in ``x.dtype``.
"""

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")


def _conv_windows(xp: torch.Tensor, weight: torch.Tensor, activation: str | None) -> torch.Tensor:
    """Every full window of the history-prefixed input. xp: ``[B, L, C]`` (compute dtype),
    weight: ``[C, W]``. Returns ``[B, L-W+1, C]``."""
    y = F.conv1d(xp.transpose(1, 2), weight.to(xp.dtype).unsqueeze(1), groups=weight.shape[0]).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def short_conv(x, weight, *, initial_state=None, output_final_state: bool = False, cu_seqlens=None, activation="silu"):
    """x: ``[B, T, C]``; weight: ``[C, W]``; initial_state: ``[B, C, W-1]`` (``[N, C, W-1]`` with
    cu_seqlens ``[N+1]``, which needs B == 1; sequences never see each other's inputs).
    Returns ``(y [B, T, C] in x.dtype, final_state (last W-1 inputs, history included) or None)``."""
    B, T, C = x.shape
    W = weight.shape[1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if initial_state is None:
        history = x.new_zeros(N, W - 1, C, dtype=dtype)
    else:
        history = initial_state.to(dtype).transpose(1, 2)  # [N, W-1, C]
    if cu_seqlens is None:
        xp = torch.cat([history, x.to(dtype)], dim=1)  # [B, W-1+T, C]
        y = _conv_windows(xp, weight, activation)
        final = xp[:, xp.shape[1] - (W - 1) :]
    else:
        # one row [h_0, x_0, h_1, x_1, ...]: each sequence sits right behind its own history
        lengths = cu_seqlens.diff().to(x.device)
        pieces = x[0].to(dtype).split(lengths.tolist())
        xp = torch.cat([p for h, s in zip(history, pieces) for p in (h, s)]).unsqueeze(0)
        y_all = _conv_windows(xp, weight, activation)[0]  # the window ending at row p sits at p-(W-1)
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths)
        y = y_all[torch.arange(T, device=x.device) + seq * (W - 1)].unsqueeze(0)
        # one row past each sequence's last input
        ends = cu_seqlens[1:].to(x.device) + torch.arange(1, N + 1, device=x.device) * (W - 1)
        final = xp[0][ends[:, None] + torch.arange(1 - W, 0, device=x.device)]  # [N, W-1, C]
    final = final.transpose(1, 2).to(x.dtype) if output_final_state else None
    return y.to(x.dtype), final


def short_conv_step(x, weight, state, activation="silu"):
    """One decoding step. x: ``[B, C]``; weight: ``[C, W]``; state: ``[B, C, W-1]``, updated IN
    PLACE (shift left, append x). Returns y ``[B, C]`` in x.dtype; equals ``short_conv`` on a
    length-1 input with ``initial_state=state``."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    window = torch.cat([state.to(dtype), x.to(dtype).unsqueeze(-1)], dim=-1)  # [B, C, W]
    y = (window * weight.to(dtype)).sum(-1)
    state.copy_(window[..., 1:])
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
