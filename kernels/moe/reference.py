"""Pure-PyTorch reference for the routed experts: the gated activation they share with the dense MLP, the weighted sum
of each token's k experts that the expert kernels compute, the tokens each expert got, and experts' weights stored
mxfp4 (``Mxfp4Weight``): their decoding and the grouped product the mxfp4 kernel computes."""

from typing import NamedTuple

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
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum_j w_j down_j(act(gate_up_j(x)))`` per token (plus a shared expert's ``down_s(act(gate_s(x), up_s(x)))``
    with ``shared``, its (gate, up, down) weights), with the decode kernel's rounding: fp32 products and sums, the
    activation's output rounded to the input dtype (the down product's operand), the result rounded once.

    hidden_states [N, l], top_k_index / top_k_weights [N, k], gate_up_proj [E, 2I, l], down_proj [E, l, I]; shared
    [Is, l], [Is, l], [l, Is] -> [N, l] in hidden_states' dtype. Gathers each token's k experts' weights (a copy of
    them): a reference, not a fast path."""
    x = hidden_states.float()
    gate_up = torch.einsum("nl,nkil->nki", x, gate_up_proj[top_k_index].float())  # [N, k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = gated_activation(gate, up, kind, gate_cap, up_cap).to(hidden_states.dtype)  # [N, k, I]
    out = torch.einsum("nki,nkli->nkl", act.float(), down_proj[top_k_index].float())  # [N, k, l]
    total = (out * top_k_weights.float()[..., None]).sum(1)
    if shared is not None:
        shared_gate, shared_up, shared_down = (w.float() for w in shared)
        shared_act = gated_activation(x @ shared_gate.T, x @ shared_up.T, kind, gate_cap, up_cap)
        total = total + shared_act.to(hidden_states.dtype).float() @ shared_down.T
    return total.to(hidden_states.dtype)


def sigmoid_top_k(
    router_logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sigmoid router's choice: ``scores = sigmoid(router_logits)`` [N, E]; the top ``top_k`` of ``scores + bias``
    (the bias steers the choice only), restricted to the best ``topk_group`` of ``n_group`` expert groups (a group's
    score: the sum of its two best); their unbiased scores, renormalised to sum 1 if ``renormalize``, times
    ``scale``. Returns (weights [N, k] in the logits' dtype, expert ids [N, k] int64, best first)."""
    scores = router_logits.sigmoid()
    choice = scores.detach() + bias
    if n_group > 1:
        grouped = choice.view(-1, n_group, choice.shape[-1] // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [N, n_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        keep = keep[..., None].expand_as(grouped).reshape_as(choice)
        choice = choice.masked_fill(~keep, float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, indices


def expert_loads(topk_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: [N, k] -> [E] (int64). A scatter into E counters, not `bincount`, whose output
    length depends on the data: it keeps the shape fixed, so a compiled step neither breaks its graph nor syncs."""
    indices = topk_indices.flatten().long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=indices.device)
    return counts.scatter_add_(0, indices, torch.ones_like(indices))


MXFP4_GROUP = 32  # weights per E8M0 scale along a row, as the mxfp4 format fixes it


class Mxfp4Weight(NamedTuple):
    """Expert weights ``[E, N, K]`` (out, in) as compressed-tensors' ``mxfp4-pack-quantized`` format stores them: two
    E2M1 values a byte along K, and one E8M0 scale (a power of two) per ``MXFP4_GROUP`` consecutive weights along K."""

    packed: torch.Tensor  # [E, N, K // 2] uint8: element 2j is the low nibble of byte j, element 2j + 1 the high one
    scale: torch.Tensor  # [E, N, K // 32] uint8: the group's weights are e2m1 * 2 ** (scale - 127)

    @property
    def shape(self) -> torch.Size:
        """(E, N, K), the dense weight's shape."""
        E, N, half_K = self.packed.shape
        return torch.Size((E, N, 2 * half_K))

    @classmethod
    def from_rows(cls, rows: torch.Tensor) -> "Mxfp4Weight":
        """Views of weights stored a row's packed bytes then its scales, ``[..., N, mxfp4_row_bytes(K)]`` uint8 (how
        the model keeps experts mxfp4: one tensor per projection)."""
        group_bytes = mxfp4_row_bytes(MXFP4_GROUP)  # 17: 16 packed, 1 scale
        if rows.dtype != torch.uint8 or rows.shape[-1] % group_bytes:
            raise ValueError(
                f"mxfp4 rows must be uint8 [..., N, K / 2 + K / 32] (K a multiple of 32: a multiple of {group_bytes} "
                f"bytes), got {rows.dtype} {tuple(rows.shape)}."
            )
        K = rows.shape[-1] // group_bytes * MXFP4_GROUP
        return cls(rows[..., : K // 2], rows[..., K // 2 :])


def mxfp4_row_bytes(K: int) -> int:
    """Bytes of a K-weight row stored mxfp4: K / 2 packed, K / 32 scales (4.25 bits a weight)."""
    return K // 2 + K // MXFP4_GROUP


# The E2M1 value of each nibble: bit 3 is the sign, bits 0-2 index the magnitudes (nibble 8 is -0.0, as
# compressed-tensors decodes it).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """mxfp4 bytes -> dense weights: packed ``[..., N, K / 2]`` and scale ``[..., N, K / 32]`` (uint8, laid out as
    ``Mxfp4Weight``'s) -> ``[..., N, K]`` in ``dtype``. ``e2m1 * 2 ** (scale - 127)`` in fp32, cast once: bit for bit
    compressed-tensors' decompression (every such product is exact in bf16 too; scale 255, NaN in the OCP MX spec,
    decodes to inf there and here)."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # [..., N, K]: the low nibble first
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)[nibbles.int()]
    # 2 ** (scale - 127) written as fp32 bits: the exponent field, or the subnormal 2 ** -127 for scale 0
    powers = torch.where(scale > 0, scale.int() << 23, 1 << 22).view(torch.float32)  # [..., N, K / 32]
    return (values.unflatten(-1, (-1, MXFP4_GROUP)) * powers[..., None]).flatten(-2).to(dtype)


def mxfp4_grouped_mm_reference(x: torch.Tensor, weight: Mxfp4Weight, offsets: torch.Tensor) -> torch.Tensor:
    """``x[r] @ W_e.T`` for every row r of expert e: x ``[S, K]`` sorted by expert, weight mxfp4 ``[E, N, K]``,
    offsets ``[E]`` the end of each expert's rows (``offsets[-1] == S``) -> ``[S, N]`` in x's dtype. Decodes every
    expert, multiplies in fp32 and rounds once; reads offsets on the host (a sync): a reference, not a fast path."""
    dense = dequantize_mxfp4(weight.packed, weight.scale, torch.float32)  # [E, N, K]
    ends = offsets.tolist()
    rows = [x[start:end].float() @ dense[e].T for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends))]
    return torch.cat(rows).to(x.dtype)
