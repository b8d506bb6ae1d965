"""KDA decoding: one token for a batch of sequences, state updated in place.

``kda_decode_step_triton`` takes the same raw inputs as ``kimi_delta_attention`` for one token
(q, k, g: ``[B, H, K]`` or ``[B, 1, H, K]``; v: ``[B, H, V]``; beta: ``[B, H]``; unnormalised q/k,
raw gate logits and beta logits) and the fp32 state ``[B, H, K, V]``, which it overwrites in place:
no allocation besides the output, fixed addresses, one launch, so a CUDA graph can capture it.
Per head: ``S <- S * exp(g); S <- S + beta k (v - S^T k)^T; o = S^T (scale q)``.

The kernel is bound by the state traffic (read + write ``B*H*K*V*4`` bytes); each program owns a
``[K, BV]`` slab of one head's state.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ..backend import op_for_call, tl, triton
from .chunk_tiles import NORM_EPS
from .chunk_tiles import gate as _gate
from .tile_limits import require_triton_tiles


@dataclass(frozen=True)
class DecodeLaunch:
    """How the decode kernel is launched; ``decode_launch`` picks one per call."""

    bv: int  # width of the [K, BV] state slab each program owns
    warps: int  # warps per program


def decode_launch(V: int) -> DecodeLaunch:
    """64-wide slabs at 4 warps: the fastest at batch 256, 16 heads of K = V = 128 on an H200 (92% of the copy
    bandwidth; 32-wide slabs are 4% slower)."""
    return DecodeLaunch(bv=min(V, 64), warps=4)


@triton.jit
def head_step_inputs(bq, bk, bg, beta_logit, A_log, dt_bias, i_h, scale, lb, K: tl.constexpr, BOUNDED: tl.constexpr):
    """One head's step inputs from its raw fp32 rows q, k, gate logits [K] and its beta logit: (scale * q / ||q||,
    k / ||k||, the decay exp(g) [K], beta)."""
    bq = bq * (tl.rsqrt(tl.sum(bq * bq, 0) + NORM_EPS) * scale)
    bk = bk * tl.rsqrt(tl.sum(bk * bk, 0) + NORM_EPS)
    a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    bias = tl.load(dt_bias + i_h * K + tl.arange(0, K)).to(tl.float32)
    return bq, bk, tl.exp(_gate(bg, bias, a, lb, BOUNDED)), tl.sigmoid(beta_logit.to(tl.float32))


@triton.jit
def delta_step(S, bq, bk, bv, decay, bb):
    """One token on a [K, BV] slab of a head's fp32 state: ``S <- S * decay[:, None]; S <- S + k (bb (v - S^T k))^T``.
    Returns (S, o = S^T q [BV])."""
    S = S * decay[:, None]
    delta = bb * (bv - tl.sum(S * bk[:, None], 0))
    S = S + bk[:, None] * delta[None, :]
    return S, tl.sum(S * bq[:, None], 0)


@triton.jit
def _decode_kernel(q, k, v, g, beta, A_log, dt_bias, state, o, scale, lb,
                   H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, BOUNDED: tl.constexpr):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    ps = (i_bh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
    bq = tl.load(q + i_bh * K + o_k).to(tl.float32)
    bk = tl.load(k + i_bh * K + o_k).to(tl.float32)
    bg = tl.load(g + i_bh * K + o_k).to(tl.float32)
    bq, bk, decay, bb = head_step_inputs(bq, bk, bg, tl.load(beta + i_bh), A_log, dt_bias, i_bh % H, scale, lb, K,
                                         BOUNDED)
    S, bo = delta_step(tl.load(state + ps), bq, bk, tl.load(v + i_bh * V + o_v).to(tl.float32), decay, bb)
    tl.store(state + ps, S)
    tl.store(o + i_bh * V + o_v, bo.to(o.dtype.element_ty))


def launch_decode(q, k, v, g, beta, A_log, dt_bias, state, gate_lower_bound, scale, launch: DecodeLaunch):
    """The decode kernel on contiguous q, k, g [B, H, K], v [B, H, V], beta [B, H] and the state [B, H, K, V] (updated
    in place); returns o [B, H, V] in v.dtype."""
    B, H, K, V = state.shape
    o = torch.empty(B, H, V, device=v.device, dtype=v.dtype)
    _decode_kernel[(triton.cdiv(V, launch.bv), B * H)](
        q, k, v, g, beta, A_log, dt_bias, state, o, scale,
        float(gate_lower_bound) if gate_lower_bound is not None else 0.0,
        H=H, K=K, V=V, BV=launch.bv, BOUNDED=gate_lower_bound is not None, num_warps=launch.warps)
    return o


def _decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                 gate_lower_bound: Optional[float], scale: float) -> torch.Tensor:
    return launch_decode(q, k, v, g, beta, A_log, dt_bias, state, gate_lower_bound, scale,
                         decode_launch(state.shape[-1]))


kda_decode_step_op = torch.library.custom_op("kda_moe::kda_decode_step", _decode_step, mutates_args=("state",))


@kda_decode_step_op.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, state, gate_lower_bound, scale):
    B, H, K, V = state.shape
    return v.new_empty((B, H, V))


def kda_decode_step_triton(q, k, v, g, beta, A_log, dt_bias, state, *, gate_lower_bound=None, scale=None):
    """One KDA decoding step on raw inputs; ``state`` (fp32 ``[B, H, K, V]``, contiguous) is updated
    in place. Returns o ``[B, H, V]`` (``[B, 1, H, V]`` if q was ``[B, 1, H, K]``) in v.dtype."""
    squeeze = q.dim() == 4
    B, H, K, V = state.shape
    require_triton_tiles(K, V)
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the Triton KDA decode step needs a contiguous fp32 state [B, H, K, V] (updated in place).")
    q, k, g = (t.reshape(B, H, K).contiguous() for t in (q, k, g))
    v = v.reshape(B, H, V).contiguous()
    beta = beta.reshape(B, H).contiguous()
    scale = K ** -0.5 if scale is None else float(scale)
    lb = None if gate_lower_bound is None else float(gate_lower_bound)
    o = op_for_call(kda_decode_step_op, _decode_step)(q, k, v, g, beta, A_log, dt_bias, state, lb, scale)
    return o.unsqueeze(1) if squeeze else o

