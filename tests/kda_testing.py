"""KDA test inputs and a forward + backward harness, shared by the interpreter (CPU) and the GPU test modules."""

import dataclasses
import math

import torch

from kda_moe.kernels.kda import kimi_delta_attention
from kda_moe.kernels.kda.chunk import chunk_kda_triton
from kda_moe.kernels.kda.chunk_bwd import backward_launch, chunk_kda_bwd
from kda_moe.kernels.kda.chunk_fwd import chunk_kda_fwd, forward_launch

# the output forward's two paths: W and U formed in the chunk kernel, or delta formed in the scan (ForwardLaunch.form_wu)
FORWARD_FORMS = {"wu-in-chunk": True, "delta-in-scan": False}


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


def launches(x, cu_seqlens=None, *, form=None, gate_prec="bf16", state_fp32=True, **backward_fields):
    """(forward, backward) launches the kernels pick for ``x``, with the output forward's ``form`` (a FORWARD_FORMS
    key), the gate kernel's products ``gate_prec``, the recompute's ``state_fp32`` and other backward fields set."""
    B, T, H, K = x["q"].shape
    V, dtype = x["v"].shape[-1], x["v"].dtype
    pairs = (B if cu_seqlens is None else len(cu_seqlens) - 1) * H
    forward = forward_launch(K, V, pairs, dtype)
    if form is not None:
        forward = dataclasses.replace(forward, form_wu=FORWARD_FORMS[form])
    backward = backward_launch(K, V, pairs, dtype, gate_prec=gate_prec)
    recompute = dataclasses.replace(backward.recompute, state_fp32=state_fp32)
    return forward, dataclasses.replace(backward, recompute=recompute, **backward_fields)


def _triton_forward_backward(leaves, lb, cu_seqlens, launch, cotangents):
    """chunk_kda_fwd (keeping the scores) then chunk_kda_bwd with the given (forward, backward) launches: what the
    autograd op runs, with explicit launch settings."""
    args = [leaves[n].detach() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    scale, h0 = args[0].shape[-1] ** -0.5, leaves["h0"].detach()
    o, ht, scores = chunk_kda_fwd(*args, lb, scale, h0, True, cu_seqlens, keep_scores=True, launch=launch[0])
    do, dht = cotangents(o, ht)
    grads = chunk_kda_bwd(*args, lb, scale, h0, cu_seqlens, do.to(o.dtype).contiguous(), dht.float().contiguous(),
                          scores, launch=launch[1])
    return o, ht, dict(zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"), grads))


def kda_forward_backward(x, lb, cu_seqlens, use_triton, ref_dtype=torch.float64, launch=None):
    """(o, final state, gradients of every input) of our Triton KDA on ``x`` as given, or of the torch reference
    on ``x`` cast to ``ref_dtype``; the same random output and final-state cotangents either way. ``launch``: the
    (forward, backward) launches to run the kernels with (``launches``), through the pipeline functions; without it
    the Triton side runs through autograd with the launches the kernels pick."""
    leaves = {n: (t.detach().clone() if use_triton else t.detach().to(ref_dtype)).requires_grad_() for n, t in x.items()}

    def cotangents(o, ht):
        gen = torch.Generator(device=o.device).manual_seed(1)
        return torch.randn(o.shape, generator=gen, device=o.device), torch.randn(ht.shape, generator=gen, device=o.device)

    if use_triton and launch is not None:
        return _triton_forward_backward(leaves, lb, cu_seqlens, launch, cotangents)
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    kw = dict(gate_lower_bound=lb, initial_state=leaves["h0"], output_final_state=True, cu_seqlens=cu_seqlens)
    o, ht = chunk_kda_triton(*args, **kw) if use_triton else kimi_delta_attention(*args, **kw, backend="torch")
    do, dht = cotangents(o, ht)
    ((o.double() * do.double()).sum() + (ht.double() * dht.double()).sum()).backward()
    return o, ht, {n: t.grad for n, t in leaves.items() if t.grad is not None}
