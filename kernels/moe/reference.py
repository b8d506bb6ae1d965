"""Pure-PyTorch reference for the routed experts: the gated activation they share with the dense MLP, and the
weighted sum of each token's k experts that the decode kernel computes."""

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "situ")


def gated_activation(gate: torch.Tensor, up: torch.Tensor, kind: str, gate_cap: float, up_cap: float | None):
    """``act(gate) * up``: SwiGLU (``kind="silu"``: ``silu(gate) * up``) or SiTU-GLU (``"situ"``:
    ``gate_cap * tanh(gate / gate_cap) * sigmoid(gate) * up_cap * tanh(up / up_cap)``, the up cap left out when
    ``up_cap`` is None; fp32 inside). Returns gate's dtype."""
    if kind == "silu":
        return F.silu(gate) * up
    dtype = gate.dtype
    gate, up = gate.float(), up.float()
    gate = gate_cap * torch.tanh(gate / gate_cap) * torch.sigmoid(gate)
    if up_cap is not None:
        up = up_cap * torch.tanh(up / up_cap)
    return (gate * up).to(dtype)


def routed_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    kind: str,
    gate_cap: float,
    up_cap: float | None,
) -> torch.Tensor:
    """``sum_j w_j down_j(act(gate_up_j(x)))`` per token, with the decode kernel's rounding: fp32 products and sums,
    the activation's output rounded to the input dtype (the down product's operand), the result rounded once.

    hidden_states [N, l], top_k_index / top_k_weights [N, k], gate_up_proj [E, 2I, l], down_proj [E, l, I] ->
    [N, l] in hidden_states' dtype. Gathers each token's k experts' weights (a copy of them): a reference, not a
    fast path."""
    gate_up = torch.einsum("nl,nkil->nki", hidden_states.float(), gate_up_proj[top_k_index].float())  # [N, k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = gated_activation(gate, up, kind, gate_cap, up_cap).to(hidden_states.dtype)  # [N, k, I]
    out = torch.einsum("nki,nkli->nkl", act.float(), down_proj[top_k_index].float())  # [N, k, l]
    return (out * top_k_weights.float()[..., None]).sum(1).to(hidden_states.dtype)
