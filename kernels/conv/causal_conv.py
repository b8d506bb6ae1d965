"""Short causal depthwise conv (+ SiLU): Triton forward, backward and decoding step.

Same function as ``kernels/conv/reference.py``: ``y_t = act(sum_j w[:, j] x_{t-W+1+j})`` where
the W-1 inputs before a sequence's first token come from its conv state ``[N, C, W-1]``
(zeros when absent) and packed sequences (``cu_seqlens``) never see each other's inputs.
Fp32 math; y in x.dtype; states in x.dtype. Every kernel is a ``torch.library.custom_op``.
"""

from typing import Optional

import torch

from ..backend import op_for_call, tl, triton

# Launch settings of the conv kernels, fixed (the conv is a small share of a KDA layer's time; not tuned):
TOKEN_TILE = 64  # tokens per program of the forward and backward kernels
CHANNEL_TILE = 128  # channels per program of the forward and backward kernels
STEP_CHANNEL_TILE = 256  # channels per program of the decoding step


@triton.jit
def _act(y, SILU: tl.constexpr):
    if SILU:
        y = y * tl.sigmoid(y)
    return y


@triton.jit
def _window_input(x, h0, tok_bos, tok_seq, o_t, o_c, m_c, T, shift, i_b,
                  C: tl.constexpr, W: tl.constexpr, HAS_H0: tl.constexpr):
    """x at rows o_t - shift of each row's own sequence, history from h0 before its start. fp32 [BT, BC]."""
    bos = tl.load(tok_bos + i_b * T + o_t, mask=o_t < T, other=0)
    src = o_t - shift
    in_seq = (src >= bos) & (o_t < T)
    xv = tl.load(x + (i_b * T + src).to(tl.int64)[:, None] * C + o_c[None, :],
                 mask=in_seq[:, None] & m_c[None, :], other=0.0).to(tl.float32)
    if HAS_H0:
        seq = tl.load(tok_seq + i_b * T + o_t, mask=o_t < T, other=0)
        j = (W - 1) + src - bos  # state column, valid when src < bos
        hm = (~in_seq) & (o_t < T) & (j >= 0)
        hv = tl.load(h0 + (seq * C).to(tl.int64)[:, None] * (W - 1) + o_c[None, :] * (W - 1) + j[:, None],
                     mask=hm[:, None] & m_c[None, :], other=0.0).to(tl.float32)
        xv = xv + hv
    return xv


@triton.jit
def _conv_fwd_kernel(x, w, h0, y, tok_bos, tok_seq, T, C: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
                     BC: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr):
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        acc += wj[None, :] * _window_input(x, h0, tok_bos, tok_seq, o_t, o_c, m_c, T, W - 1 - j, i_b, C, W, HAS_H0)
    tl.store(y + (i_b * T + o_t).to(tl.int64)[:, None] * C + o_c[None, :], _act(acc, SILU).to(y.dtype.element_ty),
             mask=(o_t < T)[:, None] & m_c[None, :])


@triton.jit
def _conv_dpre_kernel(x, w, h0, dy, dpre, dw_part, tok_bos, tok_seq, T, C: tl.constexpr, W: tl.constexpr,
                      BT: tl.constexpr, BC: tl.constexpr, HAS_H0: tl.constexpr, SILU: tl.constexpr):
    """dpre = dy * act'(pre) (fp32) and per-block partial dweight."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    m = (o_t < T)[:, None] & m_c[None, :]
    pre = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        wj = tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        pre += wj[None, :] * _window_input(x, h0, tok_bos, tok_seq, o_t, o_c, m_c, T, W - 1 - j, i_b, C, W, HAS_H0)
    p = (i_b * T + o_t).to(tl.int64)[:, None] * C + o_c[None, :]
    d = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
    if SILU:
        s = tl.sigmoid(pre)
        d = d * s * (1.0 + pre * (1.0 - s))
    tl.store(dpre + p, d, mask=m)
    i_blk = (i_b * tl.num_programs(0) + i_t).to(tl.int64)
    for j in tl.static_range(W):
        xs = _window_input(x, h0, tok_bos, tok_seq, o_t, o_c, m_c, T, W - 1 - j, i_b, C, W, HAS_H0)
        tl.store(dw_part + (i_blk * C + o_c) * W + j, tl.sum(d * xs, 0), mask=m_c)


@triton.jit
def _conv_dx_kernel(dpre, w, dx, tok_eos, T, C: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """dx_s = sum_j w_j dpre_{s + W-1-j}, only over outputs of s's own sequence."""
    i_t, i_c, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    eos = tl.load(tok_eos + i_b * T + o_t, mask=o_t < T, other=0)
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        dst = o_t + (W - 1 - j)
        ok = (dst < eos) & (o_t < T)
        wj = tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        d = tl.load(dpre + (i_b * T + dst).to(tl.int64)[:, None] * C + o_c[None, :], mask=ok[:, None] & m_c[None, :],
                    other=0.0)
        acc += wj[None, :] * d
    tl.store(dx + (i_b * T + o_t).to(tl.int64)[:, None] * C + o_c[None, :], acc.to(dx.dtype.element_ty),
             mask=(o_t < T)[:, None] & m_c[None, :])


def _token_maps(B, T, cu_seqlens, device):
    """Per-token (sequence start, sequence end, sequence id) as int32 [B*T] (device ops, no sync)."""
    t = torch.arange(T, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        bos = torch.zeros(B, T, device=device, dtype=torch.int64)
        eos = torch.full((B, T), T, device=device, dtype=torch.int64)
        seq = torch.arange(B, device=device).unsqueeze(1).expand(B, T)
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.int64)
        seq = (torch.searchsorted(cu, t, right=True) - 1).unsqueeze(0)
        bos, eos = cu[seq], cu[seq + 1]
    return tuple(z.to(torch.int32).contiguous() for z in (bos, eos, seq))


def _final_state(x, h0, cu_seqlens, W):
    """Last W-1 inputs of each sequence (history included): [N, C, W-1] in x.dtype."""
    B, T, C = x.shape
    if cu_seqlens is None:
        hist = h0 if h0 is not None else x.new_zeros(B, C, W - 1)
        xp = torch.cat([hist.to(x.dtype), x.transpose(1, 2)], dim=2)
        return xp[:, :, xp.shape[2] - (W - 1):].contiguous()
    cu = cu_seqlens.to(x.device, torch.int64)
    N = cu.numel() - 1
    bos, eos = cu[:-1], cu[1:]
    p = eos[:, None] - (W - 1) + torch.arange(W - 1, device=x.device)  # [N, W-1]
    from_x = x[0][p.clamp(min=0, max=max(T - 1, 0))].transpose(1, 2)  # [N, C, W-1]
    j = (W - 1) + p - bos[:, None]
    if h0 is not None:
        from_h = torch.gather(h0.to(x.dtype), 2, j.clamp(min=0, max=W - 2)[:, None, :].expand(N, C, W - 1))
    else:
        from_h = torch.zeros_like(from_x)
    return torch.where((p >= bos[:, None])[:, None, :], from_x, from_h).contiguous()


def _conv_fwd(x: torch.Tensor, weight: torch.Tensor, initial_state: Optional[torch.Tensor],
              cu_seqlens: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
    B, T, C = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    bos, _, seq = _token_maps(B, T, cu_seqlens, x.device)
    _conv_fwd_kernel[(triton.cdiv(T, TOKEN_TILE), triton.cdiv(C, CHANNEL_TILE), B)](
        x, weight, initial_state, y, bos, seq, T, C=C, W=W, BT=TOKEN_TILE, BC=CHANNEL_TILE,
        HAS_H0=initial_state is not None, SILU=silu)
    return y


short_conv_fwd_op = torch.library.custom_op("kda_moe::short_conv_fwd", _conv_fwd, mutates_args=())


@short_conv_fwd_op.register_fake
def _(x, weight, initial_state, cu_seqlens, silu):
    return x.new_empty(x.shape)


@torch.library.custom_op("kda_moe::short_conv_bwd", mutates_args=())
def short_conv_bwd_op(x: torch.Tensor, weight: torch.Tensor, initial_state: Optional[torch.Tensor],
                      cu_seqlens: Optional[torch.Tensor], silu: bool, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, C = x.shape
    W = weight.shape[1]
    bos, eos, seq = _token_maps(B, T, cu_seqlens, x.device)
    NTB = triton.cdiv(T, TOKEN_TILE)
    dpre = torch.empty(B, T, C, device=x.device, dtype=torch.float32)
    dw_part = torch.empty(B * NTB, C, W, device=x.device, dtype=torch.float32)
    grid = (NTB, triton.cdiv(C, CHANNEL_TILE), B)
    _conv_dpre_kernel[grid](x, weight, initial_state, dy.contiguous(), dpre, dw_part, bos, seq, T, C=C, W=W,
                            BT=TOKEN_TILE, BC=CHANNEL_TILE, HAS_H0=initial_state is not None, SILU=silu)
    dx = torch.empty(B, T, C, device=x.device, dtype=torch.float32)
    _conv_dx_kernel[grid](dpre, weight, dx, eos, T, C=C, W=W, BT=TOKEN_TILE, BC=CHANNEL_TILE)
    dw = dw_part.sum(0)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    # gradient of the state: history slot i of sequence n feeds outputs bos + (i - j) for tap j >= i
    if cu_seqlens is None:
        starts = torch.arange(B, device=x.device) * T
        ends = starts + T
    else:
        cu = cu_seqlens.to(x.device, torch.int64)
        starts, ends = cu[:-1], cu[1:]
    i = torch.arange(W - 1, device=x.device)
    dh0 = torch.zeros(N, C, W - 1, device=x.device, dtype=torch.float32)
    flat = dpre.reshape(B * T, C)
    for j in range(W - 1):  # history slot i feeds output row bos + i - j through tap j <= i
        r = starts[:, None] + i[None, :] - j  # [N, W-1]
        ok = (i[None, :] >= j) & (r < ends[:, None])
        vals = flat[r.clamp(0, max(B * T - 1, 0))] * weight[:, j].float()[None, None, :]  # [N, W-1, C]
        dh0 += torch.where(ok[:, :, None], vals, 0.0).transpose(1, 2)
    return dx.to(x.dtype), dw.to(weight.dtype), dh0


@short_conv_bwd_op.register_fake
def _(x, weight, initial_state, cu_seqlens, silu, dy):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return x.new_empty(x.shape), weight.new_empty(weight.shape), x.new_empty((N, x.shape[2], weight.shape[1] - 1),
                                                                              dtype=torch.float32)


@torch.library.custom_op("kda_moe::short_conv_final_state", mutates_args=())
def short_conv_final_state_op(x: torch.Tensor, initial_state: Optional[torch.Tensor],
                              cu_seqlens: Optional[torch.Tensor], W: int) -> torch.Tensor:
    return _final_state(x, initial_state, cu_seqlens, W)


@short_conv_final_state_op.register_fake
def _(x, initial_state, cu_seqlens, W):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return x.new_empty((N, x.shape[2], W - 1))


def _conv_setup(ctx, inputs, output):
    x, weight, initial_state, cu_seqlens, silu = inputs
    ctx.save_for_backward(x, weight, initial_state, cu_seqlens)
    ctx.silu = silu


def _conv_backward(ctx, dy):
    x, weight, initial_state, cu_seqlens = ctx.saved_tensors
    dx, dw, dh0 = short_conv_bwd_op(x, weight, initial_state, cu_seqlens, ctx.silu, dy)
    return dx, dw, (dh0.to(initial_state.dtype) if initial_state is not None else None), None, None


torch.library.register_autograd("kda_moe::short_conv_fwd", _conv_backward, setup_context=_conv_setup)


def short_conv_triton(x, weight, *, initial_state=None, output_final_state=False, cu_seqlens=None, activation="silu"):
    """Triton ``short_conv``: same arguments / result as ``kernels.conv.short_conv`` (minus backend).

    The final state (when asked for) is a gather of the inputs, so gradients reach x through it."""
    x = x.contiguous()
    weight = weight.contiguous()
    h0 = initial_state.contiguous() if initial_state is not None else None
    y = op_for_call(short_conv_fwd_op, _conv_fwd)(x, weight, h0, cu_seqlens, activation == "silu")
    final = None
    if output_final_state:
        if torch.is_grad_enabled() and (x.requires_grad or (h0 is not None and h0.requires_grad)):
            final = _final_state(x, h0, cu_seqlens, weight.shape[1])  # differentiable torch gather
        else:
            final = short_conv_final_state_op(x, h0, cu_seqlens, weight.shape[1])
    return y, final


@triton.jit
def _conv_step_kernel(x, w, state, y, C: tl.constexpr, W: tl.constexpr, BC: tl.constexpr, SILU: tl.constexpr):
    i_c, i_b = tl.program_id(0), tl.program_id(1)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    base = (i_b * C + o_c).to(tl.int64) * (W - 1)
    xv = tl.load(x + i_b * C + o_c, mask=m_c, other=0.0).to(tl.float32)
    acc = xv * tl.load(w + o_c * W + (W - 1), mask=m_c, other=0.0).to(tl.float32)
    prev = tl.load(state + base, mask=m_c, other=0.0)
    acc += prev.to(tl.float32) * tl.load(w + o_c * W, mask=m_c, other=0.0).to(tl.float32)
    for j in tl.static_range(1, W - 1):
        cur = tl.load(state + base + j, mask=m_c, other=0.0)
        acc += cur.to(tl.float32) * tl.load(w + o_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        tl.store(state + base + (j - 1), cur, mask=m_c)
    tl.store(state + base + (W - 2), xv.to(state.dtype.element_ty), mask=m_c)
    tl.store(y + i_b * C + o_c, _act(acc, SILU).to(y.dtype.element_ty), mask=m_c)


def _conv_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, silu: bool) -> torch.Tensor:
    B, C = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    _conv_step_kernel[(triton.cdiv(C, STEP_CHANNEL_TILE), B)](x, weight, state, y, C=C, W=W, BC=STEP_CHANNEL_TILE,
                                                             SILU=silu)
    return y


short_conv_step_op = torch.library.custom_op("kda_moe::short_conv_step", _conv_step, mutates_args=("state",))


@short_conv_step_op.register_fake
def _(x, weight, state, silu):
    return x.new_empty(x.shape)


def short_conv_step_triton(x, weight, state, activation="silu"):
    """Triton ``short_conv_step``: state ``[B, C, W-1]`` (contiguous) is updated in place."""
    if weight.shape[1] < 2:
        raise ValueError("short_conv_step needs a kernel of width >= 2")
    return op_for_call(short_conv_step_op, _conv_step)(x.contiguous(), weight.contiguous(), state, activation == "silu")

