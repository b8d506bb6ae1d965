"""KDA on the GPU: our Triton kernels vs flash-linear-attention 0.6.0 ``chunk_kda`` (safe_gate on and off)
vs the PyTorch reference; forward, forward+backward, the decode kernel and a KDA layer's whole decode step, with the
matmul and copy ceilings measured in the same run.

    python benchmarks/kda.py OUTDIR [fast] [decode|nodecode] [shapes=16x4096x16,...] [tune|stages]
                                                                      (kda_moe importable; fla 0.6.0 for its columns)

The softplus gate (Kimi Linear's, fla ``safe_gate=False``) runs with two gate draws: the benchmark's steep one
(logits and dt_bias near 0, so exp(A_log) in [1, 16] decays most channels by e^-1 to e^-13 per token) and a
trained-like one, ``mild_dt_bias`` (dt_bias as Kimi Linear initialises it, decays of e^-0.3 per token on average),
which keeps every tile of our kernels on the tensor cores.

``fast`` drops the slow columns (our softplus path, the torch reference) and the per-stage and per-kernel times
(torch.profiler) of one forward + backward at the first shape; ``decode`` runs only the ceilings and the decode tables;
``tune`` first times the launch settings in ``KNOBS`` one at a time at the first shape, starting from the launches the
kernels pick (``chunk_fwd.forward_launch``, ``chunk_bwd.backward_launch``) and keeping each faster value for the next
ones, and reports the fastest it found (``stages`` tunes only the first two: the pipelining depth of the forward's
chunk kernel and of the gate-gradient kernel); the table always runs the launches the kernels pick, so a faster
setting found here becomes the default by editing those functions; ``shapes=`` keeps only the listed shapes
(B x T x H); ``nodecode`` skips the decode tables.

Decode tables (one token for each of B sequences, fp32 state updated in place, no autograd): the decode kernel alone
beside fla's ``fused_recurrent_kda`` on pre-activated inputs; then a layer's step between its projections and
``o_proj`` (conv step, q / k norms, gate, beta, state update, gated RMSNorm): ours as three launches and as the fused
kernel, each also replayed from a CUDA graph (the fused kernel also under each launch of ``fused_knobs``), fla's
three-launch equivalent (``fla_decode_ops``) eagerly and graphed, and the torch reference.

Writes OUTDIR/kda_bench.md (the table) and OUTDIR/kda_bench.json after every row (a run cut short keeps what it
measured); prints the table last. At every shape with no more tokens x heads than the first (the default list's 16-head
shapes) it also gives fla's gradient errors beside ours. Inputs are bf16, H heads of K = V = 128, gate / l2norm / beta
sigmoid inside the kernels on every side (fla: ``use_gate_in_kernel``, ``use_qk_l2norm_in_kernel``,
``use_beta_sigmoid_in_kernel``). TFLOP/s uses the nominal chunked-algorithm count (per token and head: 4*64*K for
A_kk/A_qk, 2*64*(K+V) for W/U, 2*64*(K+V) for A_qk W / A_qk U, 6*K*V for the state pass; backward = 2x); GB/s uses the
fewest bytes (inputs read once, outputs written once). Peak GiB: the most CUDA memory allocated during one forward +
backward, the inputs included.
"""

import dataclasses
import json
import math
import os
import sys
import time
import traceback

import torch
import triton
from triton.testing import do_bench

from kda_moe.kernels.kda import (
    chunk_bwd,
    chunk_fwd,
    fused_decode,
    kda_layer_decode_step,
    kda_layer_decode_step_unfused,
    kimi_delta_attention,
    recurrent,
    steep_chunks,
)
from kda_moe.kernels.kda.chunk import chunk_kda_triton
from kda_moe.kernels.kda.recurrent import kda_decode_step_triton

dev = "cuda"
SHAPES = [(16, 4096, 16, 128), (4, 16384, 16, 128), (1, 65536, 16, 128), (1, 32768, 96, 128)]
LB = -5.0


def bench(fn, grad_to_none=None, rep=100):
    return do_bench(fn, warmup=25, rep=rep, return_mode="median", grad_to_none=grad_to_none)


def peak_gib(fn):
    """Peak allocated CUDA memory (GiB) during one call of fn, what was allocated before it included."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2 ** 30


def ceilings():
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    mm = 2 * 8192 ** 3 / bench(lambda: a @ b, rep=300) / 1e9
    x = torch.empty(2 * 1024 ** 3, device=dev, dtype=torch.uint8)
    y = torch.empty_like(x)
    cp = 2 * x.numel() / bench(lambda: y.copy_(x), rep=200) / 1e6
    return mm, cp


def make(B, T, H, K):
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
    dt_bias = torch.randn(H * K, device=dev) * 0.1
    return q, k, v, g, beta, A_log, dt_bias


def mild_dt_bias(H, K):
    """dt_bias as Kimi Linear (after Mamba) initialises it: softplus^-1(dt), dt log-uniform in [1e-3, 1e-1]."""
    dt = torch.exp(torch.empty(H * K, device=dev).uniform_(math.log(1e-3), math.log(1e-1)))
    return dt + torch.log(-torch.expm1(-dt))


def flops(B, T, H, K, V=128):
    per = 4 * 64 * K + 4 * 64 * (K + V) + 6 * K * V
    return B * T * H * per


def min_bytes(B, T, H, K, V=128, bwd=False):
    x = B * T * H * (3 * K + V + 1) * 2 + B * T * H * V * 2
    return x * (2 if bwd else 1) + (B * T * H * (3 * K + V + 1) * 2 if bwd else 0)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fla_kda(chunk_kda, safe):
    """fla's ``chunk_kda`` with the gate, q/k L2 norms and beta's sigmoid in its kernels, as
    ``fn(q, k, v, g, beta, A_log, dt_bias) -> o``; ``safe``: ``safe_gate=True`` with our lower bound."""
    def fn(q, k, v, g, beta, A_log, dt_bias):
        return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_qk_l2norm_in_kernel=True,
                         use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=safe,
                         lower_bound=LB if safe else None)[0]
    return fn


def grad_errors(ins, A_log, dt_bias, do, others):
    """Relative errors of bf16 gradients (q, k, v, g, beta, A_log, dt_bias; bounded gate) against the fp32 torch
    reference on the same inputs and output cotangent: ours, and each of ``others`` ({name: fn(q, k, v, g, beta,
    A_log, dt_bias) -> o}, e.g. fla's as a yardstick). A gradient an implementation does not produce is left out."""
    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in ins]
        params = [A_log.detach().clone().requires_grad_(), dt_bias.detach().clone().requires_grad_()]
        o = fn(*leaves, *params)
        return torch.autograd.grad(o, leaves + params, do.to(o.dtype), allow_unused=True)

    def kda(backend):
        return lambda *a: kimi_delta_attention(*a, gate_lower_bound=LB, backend=backend)[0]

    ref = grads(kda("torch"), torch.float32)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias")
    def errors_of(fn):
        return {n: rel(a, b) for n, a, b in zip(names, grads(fn, ins[0].dtype), ref) if a is not None}

    errors = {"ours": errors_of(kda("triton"))}
    for name, fn in others.items():
        try:
            errors[name] = errors_of(fn)
        except Exception as e:  # noqa: BLE001  (a yardstick that fails leaves ours standing)
            print(f"{name} gradients failed: {e!r}"[:300], flush=True)
    return errors


def kernel_stats():
    """Registers / spills / shared memory of our compiled kernels (the compiler's resource report)."""
    stats = {}
    for mod, name in [(steep_chunks, "_steep_chunks_kernel"), (chunk_fwd, "_chunk_kernel"), (chunk_fwd, "_scan_kernel"),
                      (chunk_bwd, "_scan_bwd_kernel"),
                      (chunk_bwd, "_state_grads_kernel"), (chunk_bwd, "_wy_grads_kernel"),
                      (chunk_bwd, "_gate_grads_kernel"),
                      (recurrent, "_decode_kernel"), (fused_decode, "_fused_decode_kernel")]:
        fn = getattr(mod, name)
        try:
            for dev_caches in fn.device_caches.values():
                for i, kern in enumerate(dev_caches[0].values()):
                    stats[f"{name}#{i}"] = dict(regs=kern.n_regs, spills=kern.n_spills,
                                                shared=kern.metadata.shared, warps=kern.metadata.num_warps)
        except Exception as e:  # noqa: BLE001
            stats[name] = repr(e)[:200]
    return stats


def kernel_times(step, iterations=10):
    """Mean time (ms) per call of ``step`` of each kernel it launches, by the kernel's own time under torch.profiler,
    longest first (on CPU: each op's own CPU time)."""
    on_gpu = dev == "cuda"
    step()
    if on_gpu:
        torch.cuda.synchronize()
    activity = torch.profiler.ProfilerActivity.CUDA if on_gpu else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(iterations):
            step()
        if on_gpu:
            torch.cuda.synchronize()
    own = {e.key: (e.self_device_time_total if on_gpu else e.self_cpu_time_total) / 1e3 / iterations
           for e in prof.key_averages()}
    return dict(sorted(((name, ms) for name, ms in own.items() if ms > 0), key=lambda item: -item[1]))


# launch settings tried by tune(), one knob at a time: (pipeline, alternatives, each the fields it replaces)
KNOBS = [
    ("fwd", [dict(chunk_stages=n) for n in (2, 3, 4)]), ("bwd", [dict(gate_stages=n) for n in (1, 2)]),
    ("bwd", [dict(state_stages=n) for n in (1, 2)]), ("fwd", [dict(chunk_warps=n) for n in (4, 8)]),
    ("fwd", [dict(chunk_bk=n) for n in (16, 32)]), ("fwd", [dict(scan_warps=n) for n in (4, 8)]),
    ("fwd", [dict(scan_bv=32, scan_stages=2), dict(scan_bv=64)]), ("fwd", [dict(scan_stages=n) for n in (1, 2)]),
    ("bwd", [dict(scan_bv=32, scan_stages=3), dict(scan_bv=64)]), ("bwd", [dict(state_warps=n) for n in (4, 8)]),
    ("bwd", [dict(state_bv=n) for n in (32, 64, 128)]), ("bwd", [dict(gate_bk=n) for n in (16, 32)]),
    ("fwd", [dict(chunk_maxnreg=n) for n in (None, 168, 128)]), ("bwd", [dict(gate_warps=n) for n in (4, 8)]),
    ("bwd", [dict(state_maxnreg=n) for n in (None, 128)]), ("bwd", [dict(wy_warps=n) for n in (4, 8)]),
    ("bwd", [dict(gate_maxnreg=n) for n in (None, 168)]),
]
# decode launches, tried at batch 256
DECODE_KNOBS = [recurrent.DecodeLaunch(bv=32, warps=4), recurrent.DecodeLaunch(bv=16, warps=2),
                recurrent.DecodeLaunch(bv=64, warps=4), recurrent.DecodeLaunch(bv=64, warps=8),
                recurrent.DecodeLaunch(bv=128, warps=8)]


def stage_times(call, forward, backward, do, scores):
    """Each stage of our forward and backward timed alone on ``call`` (its inputs made by the stages before it):
    the chunk kernel and the output scan; the backward's recompute, reverse scan, state- and WY-gradient kernels and
    gate-gradient kernel. Also the chunk kernel with tf32 products in its 16x16 inverse: what the fp32 inverse
    costs."""
    t = {"fwd_chunk": bench(lambda: chunk_fwd.launch_chunk_kernel(call, forward, store_scores=True))}
    bufs = chunk_fwd.launch_chunk_kernel(call, forward, store_scores=True)
    t["fwd_scan"] = bench(lambda: chunk_fwd.launch_output_scan(call, bufs, forward, None, False))
    t["fwd_chunk_tf32_inverse"] = bench(lambda: chunk_fwd.launch_chunk_kernel(
        call, dataclasses.replace(forward, inv_prec="tf32"), store_scores=True))
    t["bwd_recompute"] = bench(lambda: chunk_fwd.recompute_for_backward(call, backward.recompute, None, scores))
    bufs, h, delta = chunk_fwd.recompute_for_backward(call, backward.recompute, None, scores)
    t["bwd_scan"] = bench(lambda: chunk_bwd.launch_scan_bwd(call, bufs, backward, do, None, False))
    dh, ddelta, _ = chunk_bwd.launch_scan_bwd(call, bufs, backward, do, None, False)
    t["bwd_state_grads"] = bench(lambda: chunk_bwd.launch_state_grads(call, bufs, h, dh, delta, ddelta, do, backward))
    dW, kg, dqn, dkn, dG = chunk_bwd.launch_state_grads(call, bufs, h, dh, delta, ddelta, do, backward)
    t["bwd_wy_grads"] = bench(lambda: chunk_bwd.launch_wy_grads(call, bufs, delta, ddelta, dW, kg, do, backward))
    dv, dL, dAq, dbeta_col = chunk_bwd.launch_wy_grads(call, bufs, delta, ddelta, dW, kg, do, backward)
    # the gate kernel overwrites the dq / dk scratch it reads with its totals; its time does not depend on the values
    t["bwd_gate_grads"] = bench(lambda: chunk_bwd.launch_gate_grads(call, bufs.norms, dL, dAq, dbeta_col, dqn, dkn, dG,
                                                                    backward))
    return t


def time_pipeline(res, knobs):
    """Per-stage times of our pipeline at the first shape (bounded gate) and, for each entry of ``knobs``, the
    forward (or backward) timed with each alternative, keeping the fastest for the entries after it."""
    B, T, H, K = SHAPES[0]
    q, k, v, g, beta, A_log, dt_bias = make(B, T, H, K)
    do = torch.randn_like(v)
    call = chunk_fwd.kda_call(q, k, v, g, beta, A_log, dt_bias, LB, K ** -0.5, None)
    launch = {"fwd": chunk_fwd.forward_launch(K, K, call.pairs, v.dtype),
              "bwd": chunk_bwd.backward_launch(K, K, call.pairs, v.dtype)}

    def forward(fwd):
        return chunk_fwd.chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, LB, K ** -0.5, None, False, None,
                                       keep_scores=True, launch=fwd)

    scores = forward(launch["fwd"])[2]
    run = {"fwd": forward,
           "bwd": lambda bwd: chunk_bwd.chunk_kda_bwd(q, k, v, g, beta, A_log, dt_bias, LB, K ** -0.5, None, None, do,
                                                      None, scores, launch=bwd)}
    t = {}
    for which, alternatives in knobs:
        timed = []
        for fields in alternatives:
            candidate = dataclasses.replace(launch[which], **fields)
            name = f"{which}_" + ",".join(f"{n}={x}" for n, x in fields.items())
            t[name] = bench(lambda: run[which](candidate))
            timed.append((t[name], candidate))
        launch[which] = min(timed, key=lambda item: item[0])[1]
    t.update(stage_times(call, launch["fwd"], launch["bwd"], do, scores))
    res["stage_ms"] = t
    res["fastest_launch"] = {w: dataclasses.asdict(c) for w, c in launch.items()}
    print("stage times (ms):", {n: round(x, 3) for n, x in t.items()}, flush=True)
    print("fastest launch found:", res["fastest_launch"], flush=True)
    res["kernel_stats"] = kernel_stats()
    print("kernel stats:", res["kernel_stats"], flush=True)
    ins = [t.requires_grad_() for t in (q, k, v, g, beta)]
    step = lambda: chunk_kda_triton(*ins, A_log, dt_bias, gate_lower_bound=LB)[0].backward(do)
    res["kernel_ms"] = kernel_times(step)
    print("kernel times, one fwd+bwd (ms):", {n[:40]: round(x, 3) for n, x in res["kernel_ms"].items()}, flush=True)


# the decode tables: one token for each of DECODE_BATCHES sequences, DECODE_HEADS heads of K = V = DECODE_DIM
DECODE_BATCHES, DECODE_HEADS, DECODE_DIM, DECODE_DTYPE, CONV_WIDTH = [256, 1, 64], 16, 128, torch.bfloat16, 4


def fused_knobs(V):
    """Launches of the fused layer step tried at every batch (the rows run ``fused_decode_launch``'s)."""
    return [fused_decode.FusedDecodeLaunch(bv=V // 2, warps=4), fused_decode.FusedDecodeLaunch(bv=V // 2, warps=8),
            fused_decode.FusedDecodeLaunch(bv=V, warps=8), fused_decode.FusedDecodeLaunch(bv=V, warps=16),
            fused_decode.FusedDecodeLaunch(bv=V // 4, warps=2, splits=4),
            fused_decode.FusedDecodeLaunch(bv=V // 8, warps=1, splits=8)]


def graphed(fn):
    """``fn`` captured in a CUDA graph (after one call, which compiles its kernels); returns the graph's replay."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def layer_step_inputs(B, H, K):
    """One KDA layer's decode-step inputs (``kda_layer_decode_step``'s arguments) for B sequences."""
    C = 3 * H * K
    r = lambda *shape: torch.randn(*shape, device=dev)  # noqa: E731
    x = dict(qkv=r(B, C), conv_weight=0.5 * r(C, CONV_WIDTH), conv_state=r(B, C, CONV_WIDTH - 1), g=r(B, H * K),
             beta=r(B, H), gate=r(B, H * K), norm_weight=1 + 0.1 * r(K))
    x = {name: t.to(DECODE_DTYPE) for name, t in x.items()}
    x.update(A_log=torch.log(torch.empty(H, device=dev).uniform_(1, 16)), dt_bias=0.1 * r(H * K), state=r(B, H, K, K))
    return x


def layer_step_bytes(x):
    """The fewest bytes a layer step moves: both states read and written, the other inputs read, the output written."""
    read = sum(x[n].nbytes for n in ("qkv", "conv_weight", "g", "beta", "A_log", "dt_bias", "gate", "norm_weight"))
    return 2 * (x["state"].nbytes + x["conv_state"].nbytes) + read + x["gate"].nbytes  # the output: the gate's size


def fla_decode_ops():
    """fla's decode step of the same layer as ``fn(x, conv_cache) -> [B, H*V]``, or None without fla: what its
    ``KimiDeltaAttention`` runs at one token, with one conv over q | k | v where its layer runs three (one launch
    fewer than fla's own layer): ``causal_conv1d_update`` on its ``[B, C, W]`` cache, ``fused_recurrent_kda`` with the
    gate, beta's sigmoid and the q / k L2 norms in its kernel (writing a new final state: its public API has no
    in-place update), then its fused gated RMSNorm."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda import fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        print("fla's decode ops not importable:", e)
        return None

    def step(x, conv_cache):
        B, H, K, V = x["state"].shape
        y, _ = causal_conv1d_update(x=x["qkv"], cache=conv_cache, weight=x["conv_weight"], activation="silu")
        q, k, v = (t.reshape(B, 1, H, -1) for t in y.split([H * K, H * K, H * V], dim=-1))
        o, _ = fused_recurrent_kda(q, k, v, x["g"].view(B, 1, H, K), x["beta"].view(B, 1, H), A_log=x["A_log"],
                                   dt_bias=x["dt_bias"], initial_state=x["state"], output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=LB)
        return rms_norm_gated(o, x["gate"].view(B, 1, H, V), x["norm_weight"], None, activation="sigmoid",
                              eps=1e-5).reshape(B, H * V)

    return step


def layer_step_row(B, d, fla_step, copy_GBps):
    """Into ``d``: one KDA layer's decode step between its projections and ``o_proj`` (conv step, KDA step, gated
    RMSNorm; bounded gate) at batch B. Times of ours as three launches (``kda_layer_decode_step_unfused``) and as one
    fused kernel, each also replayed from a CUDA graph, of the fused kernel under each of ``fused_knobs``, of fla's
    (three launches, also graphed) and of the torch reference; relative errors of one step of ours and fla's against
    the fp32 reference on the same inputs."""
    no_grad = torch.no_grad()
    x = layer_step_inputs(B, DECODE_HEADS, DECODE_DIM)
    start = {name: t.clone() for name, t in x.items()}
    steps = {"unfused": lambda: kda_layer_decode_step_unfused(**x, eps=1e-5, gate_lower_bound=LB, backend="triton"),
             "fused": lambda: kda_layer_decode_step(**x, eps=1e-5, gate_lower_bound=LB, backend="triton")}
    for name, fn in steps.items():
        d[f"step_{name}_ms"] = bench(no_grad(fn))
        d[f"step_{name}_graph_ms"] = bench(graphed(no_grad(fn)))
    args = [x.get(n) for n in ("qkv", "conv_weight", "conv_state", "g", "g_weight", "beta", "A_log", "dt_bias", "state",
                               "gate", "gate_weight", "norm_weight")]
    d["step_knob_ms"] = {str(launch): bench(lambda launch=launch: fused_decode.launch_fused_decode(
        *args, 1e-5, LB, DECODE_DIM ** -0.5, launch)) for launch in fused_knobs(DECODE_DIM)}
    d["step_torch_ms"] = bench(no_grad(lambda: kda_layer_decode_step(**x, eps=1e-5, gate_lower_bound=LB,
                                                                     backend="torch")))
    fla_cache = torch.cat([x["conv_state"][..., :1], x["conv_state"]], dim=-1)  # fla keeps the last W inputs
    if fla_step is not None:
        try:
            d["step_fla_ms"] = bench(no_grad(lambda: fla_step(x, fla_cache)))
            d["step_fla_graph_ms"] = bench(graphed(no_grad(lambda: fla_step(x, fla_cache))))
        except Exception:  # noqa: BLE001  (a yardstick that fails leaves ours standing)
            d["step_fla_error"] = traceback.format_exc(limit=3)[-600:]
            print("fla decode step", d["step_fla_error"], flush=True)
    d["step_GBps"] = layer_step_bytes(x) / min(d["step_fused_ms"], d["step_fused_graph_ms"]) / 1e6
    d["step_frac_copy"] = d["step_GBps"] / copy_GBps
    # errors of one step from the same start against the fp32 reference
    fresh = lambda: {name: t.clone() for name, t in start.items()}  # noqa: E731
    ref = {name: t.float() for name, t in fresh().items()}
    with torch.no_grad():
        expected = kda_layer_decode_step(**ref, eps=1e-5, gate_lower_bound=LB, backend="torch")
        ours = fresh()
        d["step_rel_err_fused"] = rel(kda_layer_decode_step(**ours, eps=1e-5, gate_lower_bound=LB, backend="triton"),
                                      expected)
        d["step_rel_err_fused_state"] = rel(ours["state"], ref["state"])
        if "step_fla_ms" in d:
            theirs = fresh()
            d["step_rel_err_fla"] = rel(fla_step(theirs, torch.cat([theirs["conv_state"][..., :1],
                                                                     theirs["conv_state"]], dim=-1)), expected)


def main(out):
    os.makedirs(out, exist_ok=True)
    res = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name()}
    res["matmul_tflops"], res["copy_GBps"] = ceilings()
    print(f"ceilings: bf16 matmul {res['matmul_tflops']:.0f} TFLOP/s, copy {res['copy_GBps']:.0f} GB/s", flush=True)
    decode_only = "decode" in sys.argv[2:]
    picked = [a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("shapes=")]
    shapes = [s for s in SHAPES if not picked or "x".join(map(str, s[:3])) in picked[0].split(",")]
    knobs = KNOBS if "tune" in sys.argv[2:] else KNOBS[:2] if "stages" in sys.argv[2:] else []
    if not decode_only and (knobs or "fast" not in sys.argv[2:]):
        time_pipeline(res, knobs)
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception as e:  # noqa: BLE001
        print("fla not importable:", e)
        chunk_kda = fused_recurrent_kda = None

    rows, dec = [], []
    res["rows"], res["decode"] = rows, dec
    for (B, T, H, K) in ([] if decode_only else shapes):
        q, k, v, g, beta, A_log, dt_bias = make(B, T, H, K)
        ins = [q, k, v, g, beta]
        row = dict(B=B, T=T, H=H, K=K)
        start = time.time()
        for t in ins:
            t.requires_grad_(True)
        do = torch.randn_like(v)
        variants = {
            "ours_bounded": lambda: chunk_kda_triton(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=LB)[0],
            "ours_softplus": lambda: chunk_kda_triton(q, k, v, g, beta, A_log, dt_bias)[0],
        }
        if chunk_kda is not None:
            fla_safe, fla_nosafe = fla_kda(chunk_kda, True), fla_kda(chunk_kda, False)
            variants["fla_safe"] = lambda: fla_safe(q, k, v, g, beta, A_log, dt_bias)
            variants["fla_nosafe"] = lambda: fla_nosafe(q, k, v, g, beta, A_log, dt_bias)
        dt_mild = mild_dt_bias(H, K)  # the softplus gate drawn like a trained model's (see the module docstring)
        variants["ours_softplus_mild"] = lambda: chunk_kda_triton(q, k, v, g, beta, A_log, dt_mild)[0]
        if chunk_kda is not None:
            variants["fla_nosafe_mild"] = lambda: fla_nosafe(q, k, v, g, beta, A_log, dt_mild)
        if "fast" in sys.argv[2:]:  # skip the slow columns (ours softplus, torch reference)
            variants.pop("ours_softplus")
            variants.pop("ours_softplus_mild")
        elif B * T * H <= 16 * 4096 * 16:
            variants["torch_ref"] = lambda: kimi_delta_attention(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=LB,
                                                                 backend="torch")[0]
        for name, fn in variants.items():
            try:
                with torch.no_grad():
                    row[f"{name}_fwd_ms"] = bench(fn, rep=60 if name == "torch_ref" else 120)
                if name != "torch_ref" or (B, T, H) == SHAPES[0][:3]:
                    def fb(fn=fn, do=do):
                        fn().backward(do)
                    row[f"{name}_fwdbwd_ms"] = bench(fb, grad_to_none=ins, rep=60 if name == "torch_ref" else 150)
                    for t in ins:
                        t.grad = None
                    row[f"{name}_fwdbwd_peak_GiB"] = peak_gib(fb)
            except Exception:  # noqa: BLE001
                row[f"{name}_error"] = traceback.format_exc(limit=3)[-600:]
                print(name, row[f"{name}_error"], flush=True)
            print(f"  {B}x{T}x{H} {name}: {time.time() - start:.0f} s since the row began", flush=True)
            torch.cuda.empty_cache()
        # correctness of ours (bf16) vs the fp32 torch reference, bounded gate
        try:
            with torch.no_grad():
                o = chunk_kda_triton(q, k, v, g, beta, A_log, dt_bias, gate_lower_bound=LB)[0]
                if B * T * H <= 4 * 16384 * 16:
                    ro = kimi_delta_attention(*(t.float() for t in ins), A_log, dt_bias, gate_lower_bound=LB,
                                              backend="torch")[0]
                    row["rel_err_o_bounded"] = rel(o, ro)
                    o = chunk_kda_triton(q, k, v, g, beta, A_log, dt_bias)[0]
                    ro = kimi_delta_attention(*(t.float() for t in ins), A_log, dt_bias, backend="torch")[0]
                    row["rel_err_o_softplus"] = rel(o, ro)
                    del ro
                row["finite"] = bool(torch.isfinite(o).all())
            if B * T * H <= SHAPES[0][0] * SHAPES[0][1] * SHAPES[0][2]:
                others = {} if chunk_kda is None else {"fla_safe": fla_safe}
                errors = grad_errors(ins, A_log, dt_bias, do, others)
                row["rel_err_grads_bounded"] = errors.pop("ours")
                row.update({f"rel_err_grads_{name}": e for name, e in errors.items()})
        except Exception:  # noqa: BLE001
            row["check_error"] = traceback.format_exc(limit=3)[-600:]
        rows.append(row)
        print(row, flush=True)
        write_tables(res, out)  # after every row: a call cut short still leaves its table
        del q, k, v, g, beta, ins, do
        torch.cuda.empty_cache()

    # decode: one token for each of B sequences, fp32 state [B, H, K, K] updated in place; every side timed without
    # autograd, as generate() runs it (our wrappers then skip the custom-op dispatch)
    no_grad = torch.no_grad()
    H, K = DECODE_HEADS, DECODE_DIM
    fla_step = fla_decode_ops()
    for B in ([] if "nodecode" in sys.argv[2:] else DECODE_BATCHES):
        q, k, v, g = (torch.randn(B, H, K, device=dev, dtype=DECODE_DTYPE) for _ in range(4))
        beta = torch.randn(B, H, device=dev, dtype=DECODE_DTYPE)
        A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
        dt_bias = torch.randn(H * K, device=dev) * 0.1
        state = torch.randn(B, H, K, K, device=dev)
        d = dict(B=B)
        sb = 2 * state.numel() * 4
        f = no_grad(lambda: kda_decode_step_triton(q, k, v, g, beta, A_log, dt_bias, state, gate_lower_bound=LB))
        if B == 256:  # the decode kernel alone under each launch in DECODE_KNOBS (the rows run decode_launch's)
            d["knob_ms"] = {str(launch): bench(lambda: recurrent.launch_decode(q, k, v, g, beta, A_log, dt_bias, state,
                                                                               LB, K ** -0.5, launch))
                            for launch in DECODE_KNOBS}
        d["ours_ms"] = bench(f)
        d["ours_graph_ms"] = bench(graphed(f))
        if fused_recurrent_kda is not None:
            qn = torch.nn.functional.normalize(q.float(), dim=-1).to(q.dtype).unsqueeze(1)
            kn = torch.nn.functional.normalize(k.float(), dim=-1).to(q.dtype).unsqueeze(1)
            gg = -torch.rand(B, 1, H, K, device=dev)
            bb = torch.rand(B, 1, H, device=dev, dtype=DECODE_DTYPE)
            h0 = state.clone()
            d["fla_ms"] = bench(no_grad(lambda: fused_recurrent_kda(qn, kn, v.unsqueeze(1), gg, bb, initial_state=h0,
                                                                     output_final_state=True)))
        d["torch_ms"] = bench(no_grad(lambda: kimi_delta_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1),
                                                                    g.unsqueeze(1), beta.unsqueeze(1), A_log, dt_bias,
                                                                    gate_lower_bound=LB, initial_state=state,
                                                                    output_final_state=True, backend="torch")))
        d["ours_GBps"] = sb / d["ours_ms"] / 1e6
        d["ours_graph_GBps"] = sb / d["ours_graph_ms"] / 1e6
        d["frac_copy"] = max(d["ours_GBps"], d["ours_graph_GBps"]) / res["copy_GBps"]
        del q, k, v, g, beta, state
        layer_step_row(B, d, fla_step, res["copy_GBps"])
        dec.append(d)
        print(d, flush=True)
        write_tables(res, out)
    print(write_tables(res, out))


def write_tables(res, out):
    """Write OUTDIR/kda_bench.md and kda_bench.json from what ``res`` holds so far; returns the markdown."""
    rows, dec = res["rows"], sorted(res["decode"], key=lambda d: d["B"])
    md = [f"GPU: {res['gpu']}; torch {res['torch']}, triton {res['triton']}. Ceilings in this run: bf16 matmul "
          f"{res['matmul_tflops']:.0f} TFLOP/s, copy {res['copy_GBps']:.0f} GB/s.", "",
          "| B x T x H | pass | ours bounded | ours softplus | fla safe_gate | fla no safe | torch ref | "
          "ours/fla-safe | ours softplus, mild gates | fla no safe, mild gates | fla/ours softplus: steep, mild | "
          "ours TFLOP/s | ours GB/s | rel err: o (bnd / sp), worst grad (bnd): ours; fla | peak GiB: ours / fla safe |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: f"{x:.2f} ms" if isinstance(x, float) else "-"  # noqa: E731
    for r in rows:
        for p in ("fwd", "fwdbwd"):
            ours, fs = r.get(f"ours_bounded_{p}_ms"), r.get(f"fla_safe_{p}_ms")
            ratio = f"{fs / ours:.2f}x" if ours and fs else "-"
            mult = 3 if p == "fwdbwd" else 1
            tf = f"{mult * flops(r['B'], r['T'], r['H'], r['K']) / ours / 1e9:.0f}" if ours else "-"
            gb = f"{min_bytes(r['B'], r['T'], r['H'], r['K'], bwd=p == 'fwdbwd') / ours / 1e6:.0f}" if ours else "-"
            ge, gf = r.get("rel_err_grads_bounded"), r.get("rel_err_grads_fla_safe")
            worst = lambda e: f"{max(e.values()):.1e} ({max(e, key=e.get)})" if e else "-"  # noqa: E731
            if p == "fwd":  # rows too large for the fp32 reference only check that the output is finite
                err = (f"{r['rel_err_o_bounded']:.1e} / {r['rel_err_o_softplus']:.1e}" if "rel_err_o_bounded" in r
                       else f"not compared; finite: {r.get('finite', '-')}")
            else:
                err = f"{worst(ge)}; fla {worst(gf)}" if ge else ""
            pk = [r.get(f"{n}_{p}_peak_GiB") for n in ("ours_bounded", "fla_safe")]
            peak = " / ".join(f"{x:.2f}" if x is not None else "-" for x in pk) if any(pk) else "-"
            softplus = [(r.get(f"fla_nosafe{m}_{p}_ms"), r.get(f"ours_softplus{m}_{p}_ms")) for m in ("", "_mild")]
            sp_ratio = ", ".join(f"{f / o:.2f}x" if f and o else "-" for f, o in softplus)
            md.append(f"| {r['B']}x{r['T']}x{r['H']} | {p} | {fmt(ours)} | {fmt(r.get(f'ours_softplus_{p}_ms'))} | "
                      f"{fmt(fs)} | {fmt(r.get(f'fla_nosafe_{p}_ms'))} | {fmt(r.get(f'torch_ref_{p}_ms'))} | {ratio} | "
                      f"{fmt(r.get(f'ours_softplus_mild_{p}_ms'))} | {fmt(r.get(f'fla_nosafe_mild_{p}_ms'))} | "
                      f"{sp_ratio} | {tf} | {gb} | {err} | {peak} |")
    if dec:
        md += ["", f"| decode B (H={DECODE_HEADS}, K=V={DECODE_DIM}, fp32 state) | ours | ours (CUDA graph) | "
               "fla fused_recurrent | torch ref | ours state GB/s | of copy |", "|---|---|---|---|---|---|---|"]
    for d in dec:
        md.append(f"| {d['B']} | {d['ours_ms'] * 1e3:.1f} us | {d['ours_graph_ms'] * 1e3:.1f} us | "
                  f"{d.get('fla_ms', float('nan')) * 1e3:.1f} us | {d['torch_ms'] * 1e3:.1f} us | "
                  f"{max(d['ours_GBps'], d['ours_graph_GBps']):.0f} | {100 * d['frac_copy']:.0f}% |")
    if dec:
        md += ["", "Layer decode step (conv step + KDA step + gated RMSNorm, projections excluded; us): ours unfused = "
               "three launches, fused = one kernel; fla = causal_conv1d_update + fused_recurrent_kda (gate, beta, "
               "l2norm in kernel) + fused gated RMSNorm. Errors: one step in "
               f"{str(DECODE_DTYPE).removeprefix('torch.')} against the fp32 reference.", "",
               "| B | ours unfused | unfused, graph | ours fused | fused, graph | fla | fla, graph | torch ref | "
               "fused GB/s | of copy | rel err fused / fla |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    us = lambda d, key: f"{d[key] * 1e3:.1f}" if key in d else "-"  # noqa: E731
    for d in dec:
        errors = " / ".join(f"{d[key]:.1e}" if key in d else "-" for key in ("step_rel_err_fused", "step_rel_err_fla"))
        md.append(f"| {d['B']} | " + " | ".join(us(d, f"step_{name}_ms") for name in (
            "unfused", "unfused_graph", "fused", "fused_graph", "fla", "fla_graph", "torch")) +
            f" | {d['step_GBps']:.0f} | {100 * d['step_frac_copy']:.0f}% | {errors} |")
    text = "\n".join(md)
    open(os.path.join(out, "kda_bench.md"), "w").write(text + "\n")
    json.dump(res, open(os.path.join(out, "kda_bench.json"), "w"), indent=1)
    return text


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
