"""KDA test inputs and a forward + backward harness, shared by the interpreter (CPU) and the GPU test modules."""

import math

import torch

from kda_moe.kernels.kda import kimi_delta_attention
from kda_moe.kernels.kda.chunk import chunk_kda_triton


FORWARD_FORMS = ["wu-in-chunk", "delta-in-scan"]  # chunk_fwd.forms_wu's two forward paths


def use_forward_form(monkeypatch, form):
    """Make the output forward take ``form`` whatever the number of (sequence, head) pairs (chunk_fwd.forms_wu)."""
    from kda_moe.kernels.kda import chunk_fwd

    monkeypatch.setitem(chunk_fwd.CONFIG, "factored_min_pairs", 1 << 30 if form == "wu-in-chunk" else 0)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def kda_inputs(B, T, H, K, V, dtype, N=None, seed=0, device="cpu"):
    """Raw KDA inputs (q, k, v, gate logits, beta logits in ``dtype``; A_log, dt_bias and an initial state for
    N sequences in fp32), seeded on ``device``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=r(B, T, H, K), beta=r(B, T, H))
    x = {n: t.to(dtype) for n, t in x.items()}
    x["A_log"] = torch.log(torch.rand(H, generator=gen, device=device) * 15 + 1)
    x["dt_bias"] = r(H * K) * 0.1
    x["h0"] = r(N or B, H, K, V)
    return x


def with_steep_gates(x, decay):
    """``x`` with exp(A_log) = 2 and gate logits softplus^-1(decay / 2) plus 0.1 times x's own: every channel of the
    softplus gate decays by about e^-decay per token (+-10%)."""
    x["A_log"] = torch.full_like(x["A_log"], math.log(2.0))
    x["g"] = (x["g"].float() * 0.1 + math.log(math.expm1(decay / 2))).to(x["g"].dtype)
    return x


def kda_forward_backward(x, lb, cu_seqlens, use_triton, ref_dtype=torch.float64):
    """(o, final state, gradients of every input) of our Triton KDA on ``x`` as given, or of the torch reference
    on ``x`` cast to ``ref_dtype``; the same random output and final-state cotangents either way."""
    leaves = {n: (t.detach().clone() if use_triton else t.detach().to(ref_dtype)).requires_grad_() for n, t in x.items()}
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    kw = dict(gate_lower_bound=lb, initial_state=leaves["h0"], output_final_state=True, cu_seqlens=cu_seqlens)
    o, ht = chunk_kda_triton(*args, **kw) if use_triton else kimi_delta_attention(*args, **kw, backend="torch")
    gen = torch.Generator(device=o.device).manual_seed(1)
    do = torch.randn(o.shape, generator=gen, device=o.device)
    dht = torch.randn(ht.shape, generator=gen, device=o.device)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    return o, ht, {n: t.grad for n, t in leaves.items() if t.grad is not None}
