"""Gated RMSNorm ``x * rsqrt(mean(x^2) + eps) * weight * sigmoid(gate)``: Triton forward/backward.

Rows of length D (a power-of-two block covers it); fp32 math, output in x.dtype. The backward
recomputes the row statistics and writes per-program partial sums for the weight gradient.
Both directions are ``torch.library.custom_op``s with fake implementations.
"""

import torch

from ..backend import op_for_call, tl, triton

# Launch settings of the norm kernels, fixed (not tuned: the norm is a small share of a KDA layer's time):
ROWS = 16  # rows per block, in both kernels
BACKWARD_BLOCKS = 8  # row blocks per backward program: one partial weight gradient per 128 rows


@triton.jit
def _grn_fwd_kernel(x, gate, w, y, M, eps, D: tl.constexpr, BD: tl.constexpr, ROWS: tl.constexpr):
    o_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    o_d = tl.arange(0, BD)
    m = (o_m < M)[:, None] & (o_d < D)[None, :]
    p = o_m.to(tl.int64)[:, None] * D + o_d[None, :]
    bx = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    bg = tl.load(gate + p, mask=m, other=0.0).to(tl.float32)
    bw = tl.load(w + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(bx * bx, 1) / D + eps)
    tl.store(y + p, (bx * r[:, None] * bw[None, :] * tl.sigmoid(bg)).to(y.dtype.element_ty), mask=m)


@triton.jit
def _grn_bwd_kernel(x, gate, w, dy, dx, dgate, dw_part, M, eps, D: tl.constexpr, BD: tl.constexpr,
                    ROWS: tl.constexpr, ITERS: tl.constexpr):
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    bw = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    dw = tl.zeros((BD,), dtype=tl.float32)
    for it in range(ITERS):
        o_m = (tl.program_id(0) * ITERS + it) * ROWS + tl.arange(0, ROWS)
        m = (o_m < M)[:, None] & m_d[None, :]
        p = o_m.to(tl.int64)[:, None] * D + o_d[None, :]
        bx = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
        bg = tl.load(gate + p, mask=m, other=0.0).to(tl.float32)
        bdy = tl.load(dy + p, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(bx * bx, 1) / D + eps)
        n = bx * r[:, None]
        s = tl.sigmoid(bg)
        tl.store(dgate + p, (bdy * n * bw[None, :] * s * (1.0 - s)).to(dgate.dtype.element_ty), mask=m)
        dn = bdy * bw[None, :] * s
        dw += tl.sum(bdy * n * s, 0)
        ddx = r[:, None] * (dn - n * (tl.sum(n * dn, 1) / D)[:, None])
        tl.store(dx + p, ddx.to(dx.dtype.element_ty), mask=m)
    tl.store(dw_part + tl.program_id(0) * D + o_d, dw, mask=m_d)


def _norm_fwd(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    D = x.shape[-1]
    M = x.numel() // D
    y = torch.empty_like(x)
    _grn_fwd_kernel[(triton.cdiv(M, ROWS),)](x, gate, weight, y, M, eps, D=D, BD=triton.next_power_of_2(D), ROWS=ROWS)
    return y


gated_rms_norm_fwd_op = torch.library.custom_op("kda_moe::gated_rms_norm_fwd", _norm_fwd, mutates_args=())


@gated_rms_norm_fwd_op.register_fake
def _(x, gate, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op("kda_moe::gated_rms_norm_bwd", mutates_args=())
def gated_rms_norm_bwd_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    D = x.shape[-1]
    M = x.numel() // D
    grid = triton.cdiv(M, ROWS * BACKWARD_BLOCKS)
    dx = torch.empty_like(x)
    dgate = torch.empty_like(gate)
    dw_part = torch.empty(grid, D, device=x.device, dtype=torch.float32)
    _grn_bwd_kernel[(grid,)](x, gate, weight, dy.contiguous(), dx, dgate, dw_part, M, eps, D=D,
                             BD=triton.next_power_of_2(D), ROWS=ROWS, ITERS=BACKWARD_BLOCKS)
    return dx, dgate, dw_part.sum(0).to(weight.dtype)


@gated_rms_norm_bwd_op.register_fake
def _(x, gate, weight, eps, dy):
    return x.new_empty(x.shape), gate.new_empty(gate.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, gate, weight, eps = inputs
    ctx.save_for_backward(x, gate, weight)
    ctx.eps = eps


def _backward(ctx, dy):
    x, gate, weight = ctx.saved_tensors
    dx, dgate, dw = gated_rms_norm_bwd_op(x, gate, weight, ctx.eps, dy)
    return dx, dgate, dw, None


torch.library.register_autograd("kda_moe::gated_rms_norm_fwd", _backward, setup_context=_setup)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """Triton ``gated_rms_norm``: x, gate ``[..., D]``; weight ``[D]``; returns x.dtype."""
    return op_for_call(gated_rms_norm_fwd_op, _norm_fwd)(x.contiguous(), gate.contiguous(), weight.contiguous(),
                                                        float(eps))

