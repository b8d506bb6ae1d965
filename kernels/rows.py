"""Loads and stores of a decoding step's token rows, with the RMSNorm before a layer and the residual add after it
folded in.

A pre-norm layer reads ``RMSNorm(h)`` of the residual stream h and adds its output back to h. At one token per
sequence, a separate kernel for the norm (and for the add) costs as long as one of the layer's projections: a
launch, a round trip to memory and a link in the step's chain of dependent kernels. The decoding kernels that read a
layer's input therefore normalise the rows themselves: every program computes the rows' scales (``rms_scales``, a
pass over the ``[N, d]`` rows it reads anyway, from L2) and loads its slabs normalised (``load_input_slab``); the
kernels that write a layer's output add the residual as they store it (``add_residual``). No program waits for
another, so this costs no serial tail, and the rounding is ``KdaMoeRMSNorm``'s and the eager residual add's: the same
numbers as the separate kernels up to the order of the sum of squares.
"""

from .backend import tl, triton


@triton.jit
def load_slab(row_pointers, m_rows, k0, width: tl.constexpr, BK: tl.constexpr):
    """Columns ``k0 + [0, BK)`` of the rows of length ``width`` at ``row_pointers`` ([R], masked by m_rows; 0
    elsewhere): ``[R, BK]``."""
    o_k = k0 + tl.arange(0, BK)
    return tl.load(row_pointers[:, None] + o_k[None, :], mask=m_rows[:, None] & (o_k < width)[None, :], other=0.0)


@triton.jit
def rms_scales(row_pointers, m_rows, width: tl.constexpr, eps, BK: tl.constexpr, NORM: tl.constexpr):
    """[R] fp32: ``rsqrt(mean(x^2) + eps)`` of each row of length ``width`` at ``row_pointers`` (masked by m_rows),
    the RMSNorm's scale; ones without ``NORM``."""
    squares = tl.zeros(row_pointers.shape, dtype=tl.float32)
    if NORM:
        for k0 in range(0, width, BK):
            slab = load_slab(row_pointers, m_rows, k0, width, BK).to(tl.float32)
            squares += tl.sum(slab * slab, 1)
        return tl.rsqrt(squares / width + eps)
    return squares + 1.0


@triton.jit
def load_input_slab(row_pointers, m_rows, k0, width: tl.constexpr, BK: tl.constexpr, scales, norm_weight,
                    NORM: tl.constexpr):
    """``load_slab`` of a layer's input rows: with ``NORM`` through the RMSNorm of weight ``norm_weight`` ([width])
    and the rows' ``scales`` (``rms_scales``), rounded as ``KdaMoeRMSNorm`` rounds (``x * scale`` to the rows'
    dtype, then its product with the weight)."""
    slab = load_slab(row_pointers, m_rows, k0, width, BK)
    if NORM:
        o_k = k0 + tl.arange(0, BK)
        weight = tl.load(norm_weight + o_k, mask=o_k < width, other=0.0).to(tl.float32)
        normed = (slab.to(tl.float32) * scales[:, None]).to(slab.dtype)
        slab = (normed.to(tl.float32) * weight[None, :]).to(slab.dtype)
    return slab


@triton.jit
def add_residual(values, residual_pointers, mask, RESIDUAL: tl.constexpr):
    """``values`` (fp32) rounded to the residual stream's dtype, plus the residual rows at ``residual_pointers``
    (same shape, masked by ``mask``) with ``RESIDUAL``, rounded again: the eager ``h + layer(x)``; without
    ``RESIDUAL``, ``values`` as they are."""
    if RESIDUAL:
        residual = tl.load(residual_pointers, mask=mask, other=0.0)
        values = values.to(residual.dtype).to(tl.float32) + residual.to(tl.float32)
    return values
