"""Pure-PyTorch reference for Kimi Delta Attention (KDA): gate, single step, recurrence, chunked form.

Inputs of ``kda_step`` / ``recurrent_kda`` / ``chunk_kda`` are already activated: ``q``, ``k``
L2-normalised, ``g`` the log decay (``<= 0``), ``beta`` in ``(0, 1)``. Per head the state
``S [K, V]`` follows ``S <- S * exp(g_t)[:, None]; S <- S + beta_t k_t (v_t - S^T k_t)^T;
o_t = S^T (scale * q_t)``. Math runs in fp32 (fp64 when the inputs are fp64); outputs are cast to
``v.dtype``; states are kept and returned in that compute dtype.
"""

import math

import torch
import torch.nn.functional as F

from .tile_limits import CHUNK_SIZE

L2NORM_EPS = 1e-6  # of the q and k L2 norms, x / sqrt(sum(x^2) + eps), here and in the kernels


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last dim, computed and returned in fp32."""
    x = x.to(_compute_dtype(x))
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None):
    """Channel-wise log decay from raw gate logits.

    g: ``[..., H, K]`` or ``[..., H*K]`` (read as ``[..., H, K]`` whenever its last two dims are ``(H, K)``);
    A_log: ``[H]``; dt_bias: ``[H*K]``.
    ``lower_bound=None``: ``-exp(A_log) * softplus(z)``; else ``lower_bound * sigmoid(exp(A_log) * z)``,
    with ``z = g + dt_bias``. Returns fp32 ``[..., H, K]``."""
    H, K = A_log.numel(), dt_bias.numel() // A_log.numel()
    dtype = _compute_dtype(g)
    z = g.to(dtype)
    if z.shape[-2:] != (H, K):
        z = z.unflatten(-1, (H, K))
    z = z + dt_bias.to(dtype).view(H, K)
    a = A_log.to(dtype).exp().view(H, 1)
    if lower_bound is None:
        return -a * F.softplus(z)
    return lower_bound * torch.sigmoid(a * z)


def _decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, inclusive: bool) -> torch.Tensor:
    """``A[t, i] = sum_d a_td b_id exp(G_td - G_id)`` for ``i <= t`` (``i < t`` unless inclusive), else 0.

    a, b, G: ``[..., C, D]`` with G non-increasing along C. Pairs inside one ``tile``-row block use the
    pairwise decay (tile = gcd(C, 16)); a pair (t, i) across blocks is split at m = the last row of i's block,
    ``exp(G_t - G_m) * exp(G_m - G_i)``, both factors <= 1, so it is a GEMM that cannot overflow
    even for unbounded gates. Returns ``[..., C, C]``."""
    C, D = G.shape[-2:]
    tile = math.gcd(C, 16)
    n = C // tile
    Gb, bb = G.unflatten(-2, (n, tile)), b.unflatten(-2, (n, tile))  # [..., n, tile, D]
    G_m = Gb[..., -1, :]  # [..., n, D], the split point of every column block
    later = torch.arange(C, device=G.device)[:, None] // tile > torch.arange(n, device=G.device)  # [C(t), n(block)]
    row = (G.unsqueeze(-3) - G_m.unsqueeze(-2)).masked_fill(~later.T[:, :, None], float("-inf")).exp()  # [..., n, C, D]
    col = bb * (G_m.unsqueeze(-2) - Gb).exp()  # [..., n, tile, D]
    A_far = (a.unsqueeze(-3) * row) @ col.transpose(-1, -2)  # [..., n(i block), C(t), tile(i)]
    causal = torch.ones(tile, tile, dtype=torch.bool, device=G.device).tril(0 if inclusive else -1)
    # a token against itself decays by the constant 1, not by exp(G_t - G_t): autograd would send that term into G
    # twice (+x, -x) through two sums that round differently, and where a channel decays steeply it is the largest
    # term while the true gate gradient is tiny (fp32: 1e1 times off at e^-20 per token)
    self_pair = (causal & torch.eye(tile, dtype=torch.bool, device=G.device))[:, :, None]
    pair = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill(~causal[:, :, None], float("-inf"))
    pair = pair.masked_fill(self_pair, 0.0).exp()  # [..., n, t, i, D]
    A_near = ((pair * bb.unsqueeze(-3)) @ a.unflatten(-2, (n, tile)).unsqueeze(-1)).squeeze(-1)  # [..., n, t, i]
    A_near = torch.diag_embed(A_near.movedim(-3, -1)).permute(*range(A_near.dim() - 3), -2, -4, -1, -3)  # [..., n, t, n, i]
    return A_far.movedim(-3, -2).flatten(-2) + A_near.reshape(*A_near.shape[:-4], C, C)


def kda_step(q, k, v, g, beta, scale: float, state: torch.Tensor):
    """One decoding step. q, k, g: ``[B, H, K]``; v: ``[B, H, V]``; beta: ``[B, H]``;
    state: ``[B, H, K, V]`` fp32 (not modified). Returns ``(o [B, H, V] in v.dtype, new_state fp32)``."""
    out_dtype = v.dtype
    dtype = torch.promote_types(_compute_dtype(v), state.dtype)
    q, k, v, g, beta, S = (t.to(dtype) for t in (q, k, v, g, beta, state))
    S = S * g.exp().unsqueeze(-1)
    v_new = beta.unsqueeze(-1) * (v - torch.einsum("bhk,bhkv->bhv", k, S))
    S = S + k.unsqueeze(-1) * v_new.unsqueeze(-2)
    o = torch.einsum("bhk,bhkv->bhv", q * scale, S)
    return o.to(out_dtype), S


def recurrent_kda(q, k, v, g, beta, scale: float, initial_state=None, output_final_state: bool = False):
    """Token-by-token KDA. q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``;
    initial_state: ``[B, H, K, V]`` fp32 or None (zeros). Returns ``(o [B, T, H, V] in v.dtype,
    final_state [B, H, K, V] fp32 or None)``."""
    B, T, H, K = q.shape
    S = initial_state
    if S is None:
        S = q.new_zeros(B, H, K, v.shape[-1], dtype=_compute_dtype(v))
    o = []
    for t in range(T):
        o_t, S = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale, S)
        o.append(o_t)
    return torch.stack(o, dim=1), (S if output_final_state else None)


def _chunk_kda_batched(q, k, v, g, beta, scale: float, S: torch.Tensor, chunk_size: int):
    """Chunked KDA core on equal-length sequences (the shared path of batched and varlen calls).

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]`` (compute dtype, T a multiple
    of ``chunk_size``; zero-padded tails are exact no-ops); S: ``[B, H, K, V]``.
    Returns ``(o [B, T, H, V], final_state [B, H, K, V])`` in the compute dtype.

    Within a chunk with inclusive decay cumsum ``G``, the state after token t is
    ``exp(G_t) * S0 + sum_{i<=t} (exp(G_t - G_i) * k_i) u_i^T`` with pseudo-values
    ``u = (I + L)^{-1} beta (v - (exp(G) * k) S0)``, ``L_ti = beta_t k_t^T diag(exp(G_t - G_i)) k_i``
    (i < t). ``(I + L)^{-1}`` and both right-hand sides are independent of S0, so everything but the
    state pass over chunks is computed for all chunks at once (the WY / UT transform).
    """
    B, T, H, K = q.shape
    C = chunk_size
    # [B, T, H, D] -> [B, H, N, C, D]
    q, k, v, g = (t.reshape(B, T // C, C, H, -1).permute(0, 3, 1, 2, 4) for t in (q * scale, k, v, g))
    beta = beta.reshape(B, T // C, C, H).permute(0, 3, 1, 2).unsqueeze(-1)  # [B, H, N, C, 1]
    G = g.cumsum(-2)
    A_kk = _decayed_scores(k, k, G, inclusive=False) * beta
    A_qk = _decayed_scores(q, k, G, inclusive=True)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta * v, beta * k * G.exp()], dim=-1)
    UW = torch.linalg.solve_triangular(A_kk + eye, rhs, upper=False, unitriangular=True)
    U, W = UW.split([v.shape[-1], K], dim=-1)
    q_decayed = q * G.exp()  # reads S0 through exp(G_t)
    # G_end - G_i as the sum of the decays after token i, no function of g_i (likewise: the last real token's is 0,
    # not G_end - G_end, and the zero-padded tail's cannot reach it)
    after = F.pad(g.flip(-2).cumsum(-2).flip(-2)[..., 1:, :], (0, 0, 0, 1))
    k_to_end = k * after.exp()  # carries token i to the chunk end
    G_end = G[..., -1, :].exp().unsqueeze(-1)  # [B, H, N, K, 1]
    o = []
    for n in range(T // C):
        u = U[:, :, n] - W[:, :, n] @ S
        o.append(q_decayed[:, :, n] @ S + A_qk[:, :, n] @ u)
        S = G_end[:, :, n] * S + k_to_end[:, :, n].transpose(-1, -2) @ u
    o = torch.stack(o, dim=2)  # [B, H, N, C, V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, T, H, -1), S


def chunk_kda(
    q,
    k,
    v,
    g,
    beta,
    scale: float,
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_size: int = CHUNK_SIZE,
):
    """Chunked KDA (WY / UT transform), the same function as ``recurrent_kda``; differentiable.

    q, k, g: ``[B, T, H, K]``; v: ``[B, T, H, V]``; beta: ``[B, T, H]``; any T (padded internally).
    cu_seqlens: LongTensor ``[N+1]`` of packed sequence offsets (needs B == 1); the state restarts at
    every sequence start. initial_state / final state: fp32 ``[N, H, K, V]`` with cu_seqlens,
    ``[B, H, K, V]`` without. Returns ``(o [B, T, H, V] in v.dtype, final_state or None)``."""
    B, T, H, K = q.shape
    dtype = _compute_dtype(v)
    x = [t.to(dtype) for t in (q, k, v, g, beta)]
    if cu_seqlens is not None:
        # packed [1, T, ...] -> zero-padded batch [N, T_max, ...] (gather index `flat` maps back)
        lengths = cu_seqlens.diff()
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths.to(q.device))
        pos = torch.arange(T, device=q.device) - cu_seqlens.to(q.device)[seq]
        N, T_max = len(lengths), int(lengths.max())
        flat = seq * T_max + pos
        x = [t[0].new_zeros(N * T_max, *t.shape[2:]).index_copy(0, flat, t[0]).unflatten(0, (N, T_max)) for t in x]
    Bs, Ts = x[0].shape[:2]
    pad = -Ts % chunk_size
    x = [F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in x]
    S = initial_state.to(dtype) if initial_state is not None else q.new_zeros(Bs, H, K, v.shape[-1], dtype=dtype)
    o, S = _chunk_kda_batched(*x, scale, S, chunk_size)
    o = o[:, :Ts]
    if cu_seqlens is not None:
        o = o.flatten(0, 1)[flat].unsqueeze(0)
    return o.to(v.dtype), (S if output_final_state else None)
