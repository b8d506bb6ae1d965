"""A KDA layer's decoding step in one launch: everything between the layer's projections and ``o_proj``.

``kda_layer_decode_step_triton`` takes one token per sequence: the projected q | k | v channels before the conv
(``[B, 2*H*K + H*V]``), the conv weight ``[C, W]`` and conv state ``[B, C, W-1]``, the gate and beta logits, A_log and
dt_bias, the fp32 recurrent state ``[B, H, K, V]``, the output gate logits ``[B, H*V]`` and the output norm's weight
``[V]``. It runs the conv step (SiLU), the q / k L2 norms, the gate, beta's sigmoid, the delta-rule step and the gated
RMSNorm, and returns ``[B, H*V]`` for ``o_proj``; both states are overwritten in place (fixed addresses, only the
output allocated, so a CUDA graph can capture it). Either gate's logits may come as a low-rank input ``[B, R]`` with
its up-projection's weight (Kimi Linear's ``f_b`` / ``g_b``): each program then multiplies its head's rows of the
weight with the input, as ``F.linear`` would in a launch of its own.

Each head's V channels are split over ``splits`` programs (``[K, BV]`` slabs of the head's state), so that a small
batch still spreads over the GPU: at batch 1 one program a head would leave all but H multiprocessors idle, each
pulling its head's whole state, and gate weights, through one multiprocessor. Every program of a head computes the
conv-ed, normed q and k rows and the decay itself (a few hundred channels), updates its slabs and the conv state rows
of its own v channels, and stores its part of the gated output before the norm, with its sum of squares. The
program that finishes last (``last_to_arrive``: a counter per head, taken after the program's reads and stores) then
shifts the q / k conv state rows, which every program of the head has read by then, and scales the whole row by the
norm's reciprocal RMS. One program a head (``splits = 1``, larger batches) takes the same path without the counter.

Numerics are those of the three separate ops (``kda_layer_decode_step_unfused``): the conv output is rounded to the
input dtype before the norms, the attention output to the input dtype before the gated RMSNorm; fp32 math otherwise.
Launched as dependent (``dependent_launch``), its programs start while the projections before it still run: they
read the conv taps, the layer's conv inputs and their first state slab (written a step ago), then wait for the
projections' results. After the wait, every load of the first slab's step (the new q / k / v rows, the gate and
output-gate inputs with their up-projection weights, beta) is issued before the first reduction over the head, so
the loads cost one round trip, not one for each stage of the step.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from ..arrival_counters import arrival_counters, last_to_arrive
from ..backend import multiprocessor_count, op_for_call, refuse_autograd, tl, triton
from ..dependent_launch import dependent_launch, wait_for_inputs
from .recurrent import delta_step, head_step_inputs
from .tile_limits import require_triton_tiles

LOW_RANK_SLICE = tl.constexpr(32)  # low-rank channels per step of a gate's up-projection: [K, 32] fp32 tiles


@dataclass(frozen=True)
class FusedDecodeLaunch:
    """How the fused decode kernel is launched; ``fused_decode_launch`` picks one per call."""

    bv: int  # width of the [K, BV] state slabs each program walks through
    warps: int  # warps per program
    splits: int = 1  # programs per head, each owning V / splits channels (a power of two)


MIN_SPLIT_WIDTH = 32  # the fewest V channels a program owns when a head is split


def fused_decode_launch(heads: int, K: int, V: int, multiprocessors: int) -> FusedDecodeLaunch:
    """``heads`` = batch x heads. Each head is split in two until the programs fill the multiprocessors (or a
    program would own fewer than ``MIN_SPLIT_WIDTH`` channels). Slabs of at most 64 x 128 state values at 64 values a
    thread (4 warps), as the decode kernel's: on an H100, whole 128 x 128 rows at 8 warps took 30% longer once the
    batch fills the GPU (64 or 256 sequences of 16 heads) and gained 6% at batch 1, where the split programs run
    instead. Smaller slabs get fewer warps (at least 8 values a thread: no thread repeats another's)."""
    splits = 1
    while heads * splits * 2 <= multiprocessors and V // (2 * splits) >= MIN_SPLIT_WIDTH:
        splits *= 2
    bv = min(V // splits, max(16, 64 * 128 // K))
    return FusedDecodeLaunch(bv=bv, warps=max(1, min(8, K * bv // 2048)), splits=splits)


@triton.jit
def _conv_inputs(conv_state, w, i_b, o_c, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """What the conv step of channels o_c [N] of sequence i_b reads besides the new input: the cached inputs [N, WP]
    (the last column 0), in the state's dtype, and the taps [N, WP] in fp32. Both are there before the step's
    projections are (the layer's own state, written a step ago, and a weight)."""
    o_w = tl.arange(0, WP)
    cached = tl.load(conv_state + (i_b * C + o_c).to(tl.int64)[:, None] * (W - 1) + o_w[None, :],
                     mask=(o_w < W - 1)[None, :], other=0.0)
    taps = tl.load(w + o_c[:, None] * W + o_w[None, :], mask=(o_w < W)[None, :], other=0.0).to(tl.float32)
    return cached, taps


@triton.jit
def _conv_window(x, cached, taps, i_b, o_c, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Channels o_c [N] of sequence i_b through the conv step, with their ``_conv_inputs``: (SiLU(conv) [N] fp32,
    rounded to x's dtype as the separate conv step stores it; the window [N, WP], cached inputs then x, in the state's
    dtype, for ``_shift_in``)."""
    o_w = tl.arange(0, WP)
    new = tl.load(x + i_b * C + o_c)
    last = (o_w == W - 1)[None, :]
    y = tl.sum(tl.where(last, new.to(tl.float32)[:, None], cached.to(tl.float32)) * taps, 1)
    y = (y * tl.sigmoid(y)).to(new.dtype).to(tl.float32)
    return y, tl.where(last, new.to(cached.dtype)[:, None], cached)


@triton.jit
def _shift_in(conv_state, window, i_b, o_c, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Overwrite the conv state rows of channels o_c with the window's last W-1 columns."""
    o_w = tl.arange(0, WP)
    tl.store(conv_state + (i_b * C + o_c).to(tl.int64)[:, None] * (W - 1) + (o_w - 1)[None, :], window,
             mask=((o_w >= 1) & (o_w < W))[None, :])


@triton.jit
def _logits(x, w, i_b, rows, width, R: tl.constexpr):
    """Logits ``rows`` ([N] indices below ``width``) of sequence i_b in fp32: x's own where R == 0 (x [B, width]), else
    the up-projection of its low-rank input (x [B, R], w [width, R]) rounded to x's dtype, as F.linear stores it."""
    if R == 0:
        return tl.load(x + i_b * width + rows).to(tl.float32)
    acc = tl.zeros(rows.shape, dtype=tl.float32)
    for r0 in tl.static_range(0, R, LOW_RANK_SLICE):
        o_r = r0 + tl.arange(0, LOW_RANK_SLICE)
        m_r = o_r < R
        a = tl.load(x + i_b * R + o_r, mask=m_r, other=0.0).to(tl.float32)
        wt = tl.load(w + rows.to(tl.int64)[:, None] * R + o_r[None, :], mask=m_r[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt * a[None, :], 1)
    return acc.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _slab_inputs(state, conv_state, conv_w, i_b, ps, v_c, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """What the delta step on a [K, BV] slab reads besides the step's projections: the slab of the head's state at
    offsets ps [K, BV], and the ``_conv_inputs`` of its v channels v_c."""
    cached, taps = _conv_inputs(conv_state, conv_w, i_b, v_c, C, W, WP)
    return tl.load(state + ps), cached, taps


@triton.jit
def _slab_rows(qkv, gate, gate_w, cached, taps, i_b, i_h, o_v, v_c, H: tl.constexpr, V: tl.constexpr,
               C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, GATE_RANK: tl.constexpr):
    """The slab's v rows through the conv step (SiLU(conv) [BV] fp32, the window for ``_shift_in``) and its output
    gate logits [BV]."""
    bv, window = _conv_window(qkv, cached, taps, i_b, v_c, C, W, WP)
    return bv, window, _logits(gate, gate_w, i_b, i_h * V + o_v, H * V, GATE_RANK)


@triton.jit
def _fused_decode_kernel(qkv, conv_w, conv_state, g, g_w, beta, A_log, dt_bias, state, gate, gate_w, norm_w, o,
                         gated, partial_sq, counters, scale, lb, eps, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, C: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BV: tl.constexpr,
                         SPLITS: tl.constexpr, BOUNDED: tl.constexpr, G_RANK: tl.constexpr, GATE_RANK: tl.constexpr,
                         DEPENDENT: tl.constexpr):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    VS: tl.constexpr = V // SPLITS  # this program's V channels: [i_s * VS, (i_s + 1) * VS)
    o_k = tl.arange(0, K)
    q_c, k_c = i_h * K + o_k, H * K + i_h * K + o_k  # conv channels of the head's q and k
    o_v = i_s * VS + tl.arange(0, BV)  # the first slab's v channels, their conv channels and state offsets
    v_c, ps = 2 * H * K + i_h * V + o_v, (i_bh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
    # Before the wait: the conv taps, and this layer's conv inputs and first state slab (written a step ago:
    # complete once this kernel starts)
    q_cached, q_taps = _conv_inputs(conv_state, conv_w, i_b, q_c, C, W, WP)
    k_cached, k_taps = _conv_inputs(conv_state, conv_w, i_b, k_c, C, W, WP)
    S, v_cached, v_taps = _slab_inputs(state, conv_state, conv_w, i_b, ps, v_c, C, W, WP)
    wait_for_inputs(DEPENDENT)
    # every load the first slab needs is issued before the first reduction over the head: one round trip
    bq, q_window = _conv_window(qkv, q_cached, q_taps, i_b, q_c, C, W, WP)
    bk, k_window = _conv_window(qkv, k_cached, k_taps, i_b, k_c, C, W, WP)
    bg = _logits(g, g_w, i_b, q_c, H * K, G_RANK)
    beta_logit = tl.load(beta + i_bh)
    bv, v_window, bgate = _slab_rows(qkv, gate, gate_w, v_cached, v_taps, i_b, i_h, o_v, v_c, H, V, C, W, WP,
                                     GATE_RANK)
    bq, bk, decay, bb = head_step_inputs(bq, bk, bg, beta_logit, A_log, dt_bias, i_h, scale, lb, K, BOUNDED)
    sum_sq = tl.zeros((BV,), dtype=tl.float32)
    for v0 in tl.static_range(0, VS, BV):
        if v0 > 0:  # a later slab (one program a head, larger batches)
            o_v = i_s * VS + v0 + tl.arange(0, BV)
            v_c, ps = 2 * H * K + i_h * V + o_v, (i_bh * K + o_k).to(tl.int64)[:, None] * V + o_v[None, :]
            S, v_cached, v_taps = _slab_inputs(state, conv_state, conv_w, i_b, ps, v_c, C, W, WP)
            bv, v_window, bgate = _slab_rows(qkv, gate, gate_w, v_cached, v_taps, i_b, i_h, o_v, v_c, H, V, C, W, WP,
                                             GATE_RANK)
        S, bo = delta_step(S, bq, bk, bv, decay, bb)
        bo = bo.to(o.dtype.element_ty).to(tl.float32)  # the attention output as the separate decode step returns it
        tl.debug_barrier()  # every thread has read this slab and these conv state rows before any is overwritten
        tl.store(state + ps, S)
        _shift_in(conv_state, v_window, i_b, v_c, C, W, WP)
        sum_sq += bo * bo
        tl.store(gated + i_bh * V + o_v, bo * tl.load(norm_w + o_v).to(tl.float32) * tl.sigmoid(bgate))
    total = tl.sum(sum_sq, 0)
    if SPLITS > 1:
        tl.store(partial_sq + i_bh * SPLITS + i_s, total)
        tl.debug_barrier()  # this program's reads of the q / k conv rows and its stores precede its count
        last = last_to_arrive(counters, i_bh, SPLITS)
    else:
        last = True
    if last:  # every program of the head has read the q / k conv rows and stored its part of the row
        _shift_in(conv_state, q_window, i_b, q_c, C, W, WP)
        _shift_in(conv_state, k_window, i_b, k_c, C, W, WP)
        if SPLITS > 1:
            total = tl.sum(tl.load(partial_sq + i_bh * SPLITS + tl.arange(0, SPLITS), cache_modifier=".cg"), 0)
        tl.debug_barrier()  # the gated row is stored and visible to every thread
        r = tl.rsqrt(total / V + eps)
        for v0 in tl.static_range(0, V, BV):
            o_v = v0 + tl.arange(0, BV)
            y = tl.load(gated + i_bh * V + o_v, cache_modifier=".cg")
            tl.store(o + i_bh * V + o_v, (y * r).to(o.dtype.element_ty))


def launch_fused_decode(qkv, conv_weight, conv_state, g, g_weight, beta, A_log, dt_bias, state, gate, gate_weight,
                        norm_weight, eps, gate_lower_bound, scale, launch: FusedDecodeLaunch):
    """The fused kernel on contiguous inputs (shapes as in ``kda_layer_decode_step_triton``); both states updated in
    place. Returns ``[B, H*V]`` in qkv's dtype."""
    B, H, K, V = state.shape
    W = conv_weight.shape[1]
    o = torch.empty(B, H * V, device=qkv.device, dtype=qkv.dtype)
    gated = torch.empty(B, H * V, device=qkv.device, dtype=torch.float32)  # the gated output row before the norm
    partial_sq = torch.empty(B * H, launch.splits, device=qkv.device, dtype=torch.float32)  # each split's sum
    counters = arrival_counters(qkv.device, B * H) if launch.splits > 1 else partial_sq  # one split: never read
    _fused_decode_kernel[(B * H, launch.splits)](
        qkv, conv_weight, conv_state, g, g if g_weight is None else g_weight, beta, A_log, dt_bias, state, gate,
        gate if gate_weight is None else gate_weight, norm_weight, o, gated, partial_sq, counters, scale,
        float(gate_lower_bound) if gate_lower_bound is not None else 0.0, eps,
        H=H, K=K, V=V, C=qkv.shape[1], W=W, WP=triton.next_power_of_2(W), BV=launch.bv, SPLITS=launch.splits,
        BOUNDED=gate_lower_bound is not None, G_RANK=0 if g_weight is None else g_weight.shape[1],
        GATE_RANK=0 if gate_weight is None else gate_weight.shape[1], num_warps=launch.warps,
        **dependent_launch(qkv.device))
    return o


def _layer_step(qkv: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, g: torch.Tensor,
                g_weight: Optional[torch.Tensor], beta: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                state: torch.Tensor, gate: torch.Tensor, gate_weight: Optional[torch.Tensor], norm_weight: torch.Tensor,
                eps: float, gate_lower_bound: Optional[float], scale: float) -> torch.Tensor:
    return launch_fused_decode(qkv, conv_weight, conv_state, g, g_weight, beta, A_log, dt_bias, state, gate,
                               gate_weight, norm_weight, eps, gate_lower_bound, scale,
                               fused_decode_launch(state.shape[0] * state.shape[1], state.shape[2], state.shape[3],
                                                   multiprocessor_count(state.device)))


kda_layer_decode_step_op = torch.library.custom_op("kda_moe::kda_layer_decode_step", _layer_step,
                                                   mutates_args=("conv_state", "state"))


@kda_layer_decode_step_op.register_fake
def _(qkv, conv_weight, conv_state, g, g_weight, beta, A_log, dt_bias, state, gate, gate_weight, norm_weight, eps,
      gate_lower_bound, scale):
    B, H, K, V = state.shape
    return qkv.new_empty((B, H * V))


def kda_layer_decode_step_triton(qkv, conv_weight, conv_state, g, beta, A_log, dt_bias, state, gate, norm_weight, eps,
                                 *, g_weight=None, gate_weight=None, gate_lower_bound=None, scale=None):
    """One decoding step of a KDA layer in one launch. qkv: ``[B, 2*H*K + H*V]`` (q | k | v before the conv);
    conv_weight: ``[C, W]``; conv_state: ``[B, C, W-1]``; g: ``[B, H*K]`` gate logits; beta: ``[B, H]`` logits;
    A_log ``[H]``, dt_bias ``[H*K]``; state: fp32 ``[B, H, K, V]``; gate: ``[B, H*V]`` output gate logits;
    norm_weight: ``[V]``; with ``g_weight`` ``[H*K, R]`` (``gate_weight`` ``[H*V, R]``) g (gate) is the low-rank input
    ``[B, R]`` of the logits' up-projection instead. Both states (contiguous) are updated in place. Returns
    ``[B, H*V]`` in qkv's dtype. Decoding only: no backward."""
    B, H, K, V = state.shape
    require_triton_tiles(K, V)
    if state.dtype != torch.float32 or not state.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("the fused Triton KDA decode step updates a contiguous fp32 state [B, H, K, V] and a "
                         "contiguous conv state [B, C, W-1] in place; pass contiguous states (e.g. .contiguous() once "
                         "when the cache is built).")
    if conv_weight.shape[1] < 2:
        raise ValueError(f"the fused KDA decode step needs a conv kernel of width >= 2, got {conv_weight.shape[1]}.")
    inputs = (qkv, conv_weight, g, beta, A_log, dt_bias, gate, norm_weight)
    refuse_autograd("the fused KDA decode step", [*inputs, *(w for w in (g_weight, gate_weight) if w is not None)],
                    "the layer's sequence path")
    qkv, conv_weight, g, beta, A_log, dt_bias, gate, norm_weight = (t.contiguous() for t in inputs)
    g_weight, gate_weight = (None if w is None else w.contiguous() for w in (g_weight, gate_weight))
    scale = K ** -0.5 if scale is None else float(scale)
    lb = None if gate_lower_bound is None else float(gate_lower_bound)
    return op_for_call(kda_layer_decode_step_op, _layer_step)(qkv, conv_weight, conv_state, g, g_weight, beta, A_log,
                                                              dt_bias, state, gate, gate_weight, norm_weight,
                                                              float(eps), lb, scale)
