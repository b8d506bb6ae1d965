"""Several bias-free linear projections of the same few token rows in one launch: ``x @ W_i^T`` for up to
``MAX_PROJECTIONS`` weights ``W_i [n_i, d]``.

A decoding step multiplies one token per sequence by many weights that read the same input (a KDA layer's q, k, v,
gate and beta projections). One GEMM each is one launch each, and at one row cuBLAS splits a 1024 x 1024 weight into
a few dozen tiles only, so each launch reads its weight with a fraction of the GPU. Here every program owns ``BN``
output channels of one weight: the programs of all weights share one grid (weight i's blocks follow weight i - 1's),
each streams its ``[BN, d]`` rows once, against all token rows (one token's row unpadded, on the CUDA cores; more
tokens padded to 16, tl.dot's least M, on the tensor cores), with fp32 accumulation (fp32 inputs multiply in full
fp32, not tf32), and stores its block rounded to the input dtype. No host reads, fixed grid: torch.compile keeps the
custom op and a CUDA graph replays it. Launched as dependent (``dependent_launch``), a program loads its first weight
slab while the kernel that writes x still runs.

Consecutive weights can share one output, their products side by side (``group_sizes``): a KDA layer's q, k and v
leave the kernel as the one ``[N, 3 * H * K]`` tensor its short conv reads, with no concatenation after it.

The layer's RMSNorm can run inside the kernel, on the rows as each program loads them, and the residual add on the
products as they are stored (``kernels/rows.py``): a KDA layer's input projections normalise the residual stream
themselves, its output projection adds its products to it, and no kernel runs between two layers.
"""

from dataclasses import dataclass

import torch

from ..backend import op_for_call, refuse_autograd, tl, triton
from ..dependent_launch import dependent_launch, wait_for_inputs
from ..rows import add_residual, load_input_slab, load_slab, rms_scales
from .limits import MAX_PROJECTION_TOKENS, MAX_PROJECTIONS, fits_projection_kernel, split_groups


@dataclass(frozen=True)
class ProjectionLaunch:
    """How the projection kernel is launched; ``projection_launch`` picks one per call."""

    rows: int  # token rows of every tile: all N tokens, padded to a power of two (see ``accumulate_products``)
    block_out: int  # output channels per program
    block_k: int  # reduction slice per loop step
    warps: int  # warps per program
    stages: int  # software-pipeline depth of the reduction loop's loads


def projection_launch(tokens: int, hidden: int, dtype: torch.dtype) -> ProjectionLaunch:
    """One token (batch-1 decoding): its row unpadded on the CUDA cores, 4 output channels a program (a KDA layer's
    six weights over about 800 programs) and 512-wide reduction slices, 2 warps; on an H100 the fastest of 48
    settings for a KDA layer's projections (9.3 us against 10.0 for 16-row tiles of 16 channels). More tokens: 16
    output channels a program and 256-byte reduction slices on the tensor cores (not tuned)."""
    element = torch.finfo(dtype).bits // 8
    if tokens == 1:
        return ProjectionLaunch(rows=1, block_out=4, block_k=min(512, max(16, triton.next_power_of_2(hidden))),
                                warps=2, stages=3)
    return ProjectionLaunch(
        rows=max(16, triton.next_power_of_2(tokens)),
        block_out=16,
        block_k=min(256 // element, max(16, triton.next_power_of_2(hidden))),
        warps=4,
        stages=3,
    )


@triton.jit
def accumulate_products(acc, bx, bw):
    """acc ``[M, N]`` fp32 + bx ``[M, K]`` @ bw ``[N, K]^T``, products and sums in fp32 (fp32 inputs in full fp32).
    On the tensor cores where the tile is wide enough for tl.dot (M, N >= 16); a narrower tile (a single token's row,
    or a few output channels a program) multiplies on the CUDA cores and sums along K, so a GEMV neither pads its one
    row to 16 nor needs 16 output channels a program."""
    if bx.shape[0] >= 16 and bw.shape[0] >= 16:
        return tl.dot(bx, tl.trans(bw), acc, input_precision="ieee")
    return acc + tl.sum(bx.to(tl.float32)[:, None, :] * bw.to(tl.float32)[None, :, :], 2)


@triton.jit
def _project_block(x, w, o, block, N, n, norm_weight, eps, residual, K: tl.constexpr, LD: tl.constexpr,
                   ROWS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
                   RESIDUAL: tl.constexpr, DEPENDENT: tl.constexpr):
    """Output channels ``block * BN + [0, BN)`` of ``o [N, n] = x [N, K] @ w [n, K]^T``; o's rows ``LD`` apart. With
    ``NORM`` x's rows go through the RMSNorm of ``norm_weight`` first, with ``RESIDUAL`` o gets ``residual [N, n]``
    added (``kernels/rows.py``). The first weight slab is loaded before the wait for x (``wait_for_inputs``)."""
    o_t = tl.arange(0, ROWS)
    o_n = block * BN + tl.arange(0, BN)
    m_t, m_n = o_t < N, o_n < n
    x_rows, w_rows = x + o_t * K, w + o_n.to(tl.int64) * K
    first = load_slab(w_rows, m_n, 0, K, BK)
    wait_for_inputs(DEPENDENT)
    scales = rms_scales(x_rows, m_t, K, eps, BK, NORM)
    acc = accumulate_products(tl.zeros((ROWS, BN), dtype=tl.float32),
                              load_input_slab(x_rows, m_t, 0, K, BK, scales, norm_weight, NORM), first)
    for k0 in range(BK, K, BK):
        acc = accumulate_products(acc, load_input_slab(x_rows, m_t, k0, K, BK, scales, norm_weight, NORM),
                                  load_slab(w_rows, m_n, k0, K, BK))
    mask = m_t[:, None] & m_n[None, :]
    acc = add_residual(acc, residual + o_t[:, None] * n + o_n[None, :], mask, RESIDUAL)
    tl.store(o + o_t[:, None] * LD + o_n[None, :], acc.to(o.dtype.element_ty), mask=mask)


@triton.jit
def _projections_kernel(x, w0, o0, w1, o1, w2, o2, w3, o3, w4, o4, w5, o5, norm_weight, eps, residual, N,
                        n0: tl.constexpr, n1: tl.constexpr, n2: tl.constexpr, n3: tl.constexpr, n4: tl.constexpr,
                        n5: tl.constexpr, ld0: tl.constexpr, ld1: tl.constexpr, ld2: tl.constexpr,
                        ld3: tl.constexpr, ld4: tl.constexpr, ld5: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                        DEPENDENT: tl.constexpr):
    # the first program of each weight's blocks (weights beyond the call's count have n = 0: no blocks)
    s1: tl.constexpr = (n0 + BN - 1) // BN
    s2: tl.constexpr = s1 + (n1 + BN - 1) // BN
    s3: tl.constexpr = s2 + (n2 + BN - 1) // BN
    s4: tl.constexpr = s3 + (n3 + BN - 1) // BN
    s5: tl.constexpr = s4 + (n4 + BN - 1) // BN
    pid = tl.program_id(0)
    if pid < s1:
        _project_block(x, w0, o0, pid, N, n0, norm_weight, eps, residual, K, ld0, ROWS, BN, BK, NORM,
                       RESIDUAL, DEPENDENT)
    elif pid < s2:
        _project_block(x, w1, o1, pid - s1, N, n1, norm_weight, eps, residual, K, ld1, ROWS, BN, BK, NORM,
                       RESIDUAL, DEPENDENT)
    elif pid < s3:
        _project_block(x, w2, o2, pid - s2, N, n2, norm_weight, eps, residual, K, ld2, ROWS, BN, BK, NORM,
                       RESIDUAL, DEPENDENT)
    elif pid < s4:
        _project_block(x, w3, o3, pid - s3, N, n3, norm_weight, eps, residual, K, ld3, ROWS, BN, BK, NORM,
                       RESIDUAL, DEPENDENT)
    elif pid < s5:
        _project_block(x, w4, o4, pid - s4, N, n4, norm_weight, eps, residual, K, ld4, ROWS, BN, BK, NORM,
                       RESIDUAL, DEPENDENT)
    else:
        _project_block(x, w5, o5, pid - s5, N, n5, norm_weight, eps, residual, K, ld5, ROWS, BN, BK, NORM,
                       RESIDUAL, DEPENDENT)


def launch_projections(hidden_states: torch.Tensor, weights: list[torch.Tensor], launch: ProjectionLaunch,
                       group_sizes: list[int] | None = None, norm_weight: torch.Tensor | None = None,
                       eps: float = 0.0, residual: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The kernel on contiguous hidden states ``[N, d]`` and weights ``[n_i, d]``; returns one ``[N, sum n_i]`` per
    group of ``group_sizes`` consecutive weights (default: one weight a group). ``norm_weight`` ``[d]``: the rows go
    through that RMSNorm (of epsilon ``eps``) first; ``residual`` ``[N, n_0]`` (one weight only): added to the
    products."""
    N, K = hidden_states.shape
    outputs, slices = [], []  # the groups' outputs; each weight's columns in its group's output
    for group in split_groups(weights, group_sizes):
        outputs.append(hidden_states.new_empty(N, sum(w.shape[0] for w in group)))
        slices += outputs[-1].split([w.shape[0] for w in group], dim=1)
    unused = MAX_PROJECTIONS - len(weights)  # pointers never read: the first weight and output, with n = 0
    pointers = [t for pair in zip(weights, slices) for t in pair] + [weights[0], slices[0]] * unused
    widths = [w.shape[0] for w in weights] + [0] * unused
    row_strides = [out.stride(0) for out in slices] + [0] * unused
    grid = (sum(triton.cdiv(n, launch.block_out) for n in widths),)
    _projections_kernel[grid](hidden_states, *pointers, hidden_states if norm_weight is None else norm_weight,
                              float(eps), hidden_states if residual is None else residual, N, *widths, *row_strides,
                              K=K, ROWS=launch.rows, BN=launch.block_out, BK=launch.block_k,
                              NORM=norm_weight is not None, RESIDUAL=residual is not None, num_warps=launch.warps,
                              num_stages=launch.stages, **dependent_launch(hidden_states.device))
    return outputs


def _projections(hidden_states: torch.Tensor, weights: list[torch.Tensor], group_sizes: list[int],
                 norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None) -> list[torch.Tensor]:
    launch = projection_launch(*hidden_states.shape, hidden_states.dtype)
    return launch_projections(hidden_states, weights, launch, group_sizes, norm_weight, eps, residual)


decode_projections_op = torch.library.custom_op("kda_moe::decode_projections", _projections, mutates_args=())


@decode_projections_op.register_fake
def _(hidden_states, weights, group_sizes, norm_weight, eps, residual):
    return [hidden_states.new_empty(hidden_states.shape[0], sum(w.shape[0] for w in group))
            for group in split_groups(weights, group_sizes)]


def decode_projections_triton(hidden_states: torch.Tensor, weights: list[torch.Tensor],
                              group_sizes: list[int] | None = None,
                              input_norm: tuple[torch.Tensor, float] | None = None,
                              residual: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``[hidden_states @ w.T for w in weights]`` in one launch, the products of each group of ``group_sizes``
    consecutive weights concatenated: hidden_states ``[N, d]`` (N <= ``MAX_PROJECTION_TOKENS``), one to
    ``MAX_PROJECTIONS`` contiguous weights ``[n_i, d]`` of its dtype; ``input_norm`` (weight ``[d]``, eps) and
    ``residual`` ``[N, n_0]`` as ``decode_projections`` checks them. Decoding only: no backward."""
    if not fits_projection_kernel(hidden_states, weights):
        raise ValueError(
            f"the Triton projection kernel takes hidden states [N, d] of at most {MAX_PROJECTION_TOKENS} rows in bf16, "
            f"fp16 or fp32 and 1 to {MAX_PROJECTIONS} contiguous weights [n, d] of that dtype; got hidden states "
            f"{tuple(hidden_states.shape)} in {hidden_states.dtype} and weights "
            f"{[(tuple(w.shape), w.dtype, w.is_contiguous()) for w in weights]}. Call the linear layers one by one "
            "for more rows, and pass weights that match."
        )
    norm_weight, eps = input_norm or (None, 0.0)
    norm_weight = None if norm_weight is None else norm_weight.contiguous()
    inputs = [hidden_states, *weights, *(t for t in (norm_weight, residual) if t is not None)]
    refuse_autograd("the Triton projection kernel", inputs, "the linear layers one by one")
    group_sizes = list(group_sizes or [1] * len(weights))
    residual = None if residual is None else residual.contiguous()
    return op_for_call(decode_projections_op, _projections)(hidden_states.contiguous(), list(weights), group_sizes,
                                                           norm_weight, float(eps), residual)
