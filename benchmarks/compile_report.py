"""Compile every KDA kernel, the MLA decode attention and the MoE decode kernels for an H100 / H200 (sm_90) on a machine
without a GPU and print what the compiler reports: registers, spill stack and shared memory per kernel (the chunked
forward and backward, the decode step, the fused layer decode step, the MLA decode's split and combine kernels, the
MoE decode's up, down and sum kernels with SiTU-GLU at 1 and 64 tokens of the anchor config's experts: 64 experts,
top-8, width 1024, intermediate 512, the projection kernel on a KDA layer's six input projections and its output
projection at 1 and 16 tokens, the router's logits and top-k for 384 experts, the Block AttnRes mix's forward and
backward at the anchor config's width 1024 with 4 blocks and K3's 7168 with 8, and the mxfp4 grouped GEMM of the
anchor config's experts, forward and transposed). Device time is scarce; spills, shared-memory overflows and compile
errors (the interpreter accepts code the compiler rejects) show up here for free.

    [KDA_SHAPE=B,T,H,K] [MLA_SHAPE=B,H,T,S] python benchmarks/compile_report.py [bf16|fp32] [fwd json] [bwd json]

The json objects replace fields of the launches the kernels pick (``chunk_fwd.ForwardLaunch``, applied to the forward
and to the backward's recompute, and ``chunk_bwd.BackwardLaunch``; its ``gate_prec`` is passed to
``backward_launch``, which picks the gate kernel's warps from it), e.g.
``python benchmarks/compile_report.py bf16 '{"chunk_maxnreg": 128}'``. It compiles with the Triton it imports:
to match the GPU machine's compiler, put that version first (``pip install --target /tmp/t36 triton==3.6.0``, then
``PYTHONPATH=/tmp/t36``). The launch code runs for real on CPU tensors of shape KDA_SHAPE (default 1,256,2,128;
both gates, forward and backward, and one decoding step of B sequences through each decode kernel, with the launches
``decode_launch`` / ``fused_decode_launch`` pick), and the MLA decode attention on MLA_SHAPE (default 1,64,1,4096: B
sequences, H heads, T new tokens, S cache positions of DeepSeek-V3's latent dims L = 512, R = 64; with and without a
bool mask, the launch ``mla_decode_launch`` picks for 132 multiprocessors); a stand-in driver names sm_90 as the
target and every launch compiles its kernel without running it (the decoding kernels as dependent launches, as
graphed decoding on an H100 launches them), so the outputs are garbage and only the compiled kernels matter. Uses
the cuobjdump that ships in the Triton wheel.
"""

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class _Sm90Driver:
    """Just enough of a driver for ``JITFunction.run`` to compile for sm_90 without a device."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_all(dtype, forward_fields, backward_fields):
    """Run the forward and backward launch code and both decode steps for both gates, the MLA decode attention, the
    MoE decode at 1 and 64 tokens and the other kernels (projections, routing, AttnRes, grouped experts, mxfp4 grouped
    GEMM); return
    {kernel name: [compiled kernels]}."""
    driver.set_active(_Sm90Driver())
    compiled = {}
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.setdefault(self.fn.__name__, []).append(kernel)
        return kernel

    JITFunction.run = compile_only
    try:
        from kda_moe.kernels.kda import chunk_bwd, chunk_fwd, fused_decode, recurrent
        from kda_moe.kernels.moe import decode as moe_decode

        B, T, H, K = (int(n) for n in os.environ.get("KDA_SHAPE", "1,256,2,128").split(","))
        q, k, v, g = (torch.randn(B, T, H, K, dtype=dtype) for _ in range(4))
        beta, A_log, dt_bias = torch.randn(B, T, H, dtype=dtype), torch.zeros(H), torch.zeros(H * K)
        backward_fields = dict(backward_fields)
        gate_prec = backward_fields.pop("gate_prec", "bf16")
        for lb in (-5.0, None):
            forward = chunk_fwd.forward_launch(K, K, B * H, dtype)
            backward = chunk_bwd.backward_launch(K, K, B * H, dtype, gate_prec=gate_prec)
            recompute = dataclasses.replace(backward.recompute, **forward_fields)
            _, _, scores = chunk_fwd.chunk_kda_fwd(q, k, v, g, beta, A_log, dt_bias, lb, K ** -0.5, None, False, None,
                                                   keep_scores=True,
                                                   launch=dataclasses.replace(forward, **forward_fields))
            chunk_bwd.chunk_kda_bwd(q, k, v, g, beta, A_log, dt_bias, lb, K ** -0.5, None, None, v, None, scores,
                                    launch=dataclasses.replace(backward, recompute=recompute, **backward_fields))
            state = torch.zeros(B, H, K, K)
            step = [t[:, 0].contiguous() for t in (q, k, v, g, beta)]
            recurrent.launch_decode(*step, A_log, dt_bias, state, lb, K ** -0.5, recurrent.decode_launch(K))
            qkv, gate = torch.randn(B, 3 * H * K, dtype=dtype), torch.randn(B, H * K, dtype=dtype)
            conv_weight, conv_state = torch.randn(3 * H * K, 4, dtype=dtype), torch.zeros(B, 3 * H * K, 3, dtype=dtype)
            # the decay gate's logits from their low-rank input and f_b's weight as in every config; the output gate's
            # low-rank too as in Kimi Linear (softplus), full-rank as in K3 (bounded)
            rank_input, up_weight = torch.randn(B, K, dtype=dtype), torch.randn(H * K, K, dtype=dtype)
            gate, gate_weight = (gate, None) if lb is not None else (rank_input, up_weight)
            for multiprocessors in (B * H, 132):  # one program a head, and heads split over an H100's multiprocessors
                fused_decode.launch_fused_decode(qkv, conv_weight, conv_state, rank_input, up_weight, step[4], A_log,
                                                 dt_bias, state, gate, gate_weight, torch.ones(K, dtype=dtype), 1e-5,
                                                 lb, K ** -0.5,
                                                 fused_decode.fused_decode_launch(B * H, K, K, multiprocessors))
        compile_mla_decode(dtype)
        E, top_k, L, I = 64, 8, 1024, 512
        gate_up, down = torch.zeros(E, 2 * I, L, dtype=dtype), torch.zeros(E, L, I, dtype=dtype)
        for tokens in (1, moe_decode.MAX_DECODE_TOKENS):
            index = torch.zeros(tokens, top_k, dtype=torch.long)
            hidden, weights = torch.zeros(tokens, L, dtype=dtype), torch.zeros(tokens, top_k)
            shared = [torch.zeros(I, L, dtype=dtype), torch.zeros(I, L, dtype=dtype), torch.zeros(L, I, dtype=dtype)]
            for shared_expert in (None, shared):  # alone, and with the anchor config's shared expert
                # as a decoding step runs them: the layer's input RMSNorm inside, the residual added to the sum
                moe_decode.launch_moe_decode(hidden, index, weights, gate_up, down, shared_expert, "situ", 4.0, 25.0,
                                             moe_decode.moe_decode_launch(tokens, L, I), torch.ones(L, dtype=dtype),
                                             1e-5, torch.zeros_like(hidden))
        compile_projections(dtype)
        compile_routing()
        compile_attn_res(dtype)
        compile_grouped_experts(dtype)
        compile_mxfp4_grouped_mm(dtype)
    finally:
        JITFunction.run = launch
    return compiled


def compile_mla_decode(dtype):
    """The MLA decode attention's kernels on MLA_SHAPE, unmasked and with a bool mask (a static cache's decode step)."""
    from kda_moe.kernels.mla import decode

    B, H, T, S = (int(n) for n in os.environ.get("MLA_SHAPE", "1,64,1,4096").split(","))
    L, R = 512, 64
    inputs = [torch.randn(*shape, dtype=dtype) for shape in [(B, H, T, L), (B, H, T, R), (B, 1, S, L), (B, 1, S, R)]]
    launch = decode.mla_decode_launch(B, H * T, S, L, dtype, multiprocessors=132)
    for mask in (None, torch.ones(B, 1, T, S, dtype=torch.bool)):
        decode.launch_mla_decode(*inputs, mask, (L + R) ** -0.5, launch)


def compile_projections(dtype):
    """The projection kernel on a KDA layer's six input projections of the anchor config (width 1024, 8 heads of
    128), the layer's input RMSNorm inside, and on its output projection, the residual added, at 1 and 16 token
    rows."""
    from kda_moe.kernels.linear import MAX_PROJECTION_TOKENS, decode

    hidden = 1024
    weights = [torch.zeros(n, hidden, dtype=dtype) for n in (1024, 1024, 1024, 128, 8, 128)]
    for tokens in (1, MAX_PROJECTION_TOKENS):
        x, launch = torch.zeros(tokens, hidden, dtype=dtype), decode.projection_launch(tokens, hidden, dtype)
        decode.launch_projections(x, weights, launch, norm_weight=torch.ones(hidden, dtype=dtype), eps=1e-5)
        decode.launch_projections(x, weights[:1], launch, residual=torch.zeros_like(x))


def compile_routing():
    """The router's logits from bf16 states of K3's width 7168 and its top-k kernel for K3's 384 experts, top-8, at 1
    and 64 tokens."""
    from kda_moe.kernels.moe import routing

    for tokens in (1, 64):
        routing._router_logits(torch.zeros(tokens, 7168, dtype=torch.bfloat16), torch.zeros(384, 7168),
                               torch.ones(7168, dtype=torch.bfloat16), 1e-5)  # the layer's input RMSNorm inside
        routing._sigmoid_top_k(torch.zeros(tokens, 384), torch.zeros(384), 8, True, 1.0)


def compile_attn_res(dtype):
    """The Block AttnRes mix's forward and backward kernels at width 1024 with 4 blocks (the anchor config's deepest
    mix) and K3's width 7168 with 8, on 8 token rows."""
    from kda_moe.kernels.attn_res import mix_kernel

    for blocks, d in ((4, 1024), (8, 7168)):
        partial, stored, weight = torch.zeros(8, d, dtype=dtype), torch.zeros(blocks, 8, d, dtype=dtype), torch.zeros(d)
        _, weights, rstd = mix_kernel._mix_fwd(partial, stored, weight, weight, 1e-6)
        mix_kernel.attn_res_mix_bwd_op(partial, stored, weight, weight, weights, rstd, partial)


def compile_grouped_experts(dtype):
    """The grouped experts' weighted-activation kernels, forward and backward, at the anchor config's expert width
    (I = 512) and K3's (2048), SiTU-GLU with both caps, on 64 pair rows."""
    from kda_moe.kernels.moe import grouped

    for intermediate in (512, 2048):
        gate_up, weights = torch.zeros(64, 2 * intermediate, dtype=dtype), torch.zeros(64, dtype=dtype)
        grouped._weighted_glu(gate_up, weights, True, 4.0, 25.0)
        grouped.weighted_glu_bwd_op(gate_up, weights, torch.zeros(64, intermediate, dtype=dtype), True, 4.0, 25.0)


def compile_mxfp4_grouped_mm(dtype):
    """The mxfp4 grouped GEMM, forward (x W^T) and transposed (x W, the gradient in x), on the anchor config's experts'
    gate and up rows stored mxfp4 (64 experts, [2I, l] = [1024, 1024]) at 8 and at 128 rows an expert (512 and 8192
    rows: the two row tiles ``mxfp4_launch`` picks from)."""
    from kda_moe.kernels.moe import mxfp4

    E, N, K = 64, 1024, 1024
    packed, scale = torch.zeros(E, N, K // 2, dtype=torch.uint8), torch.zeros(E, N, K // 32, dtype=torch.uint8)
    for S in (512, 8192):
        offsets = torch.arange(1, E + 1, dtype=torch.int32) * (S // E)
        for transposed in (False, True):
            x = torch.zeros(S, N if transposed else K, dtype=dtype)
            mxfp4._mxfp4_grouped_mm(x, packed, scale, offsets, transposed)


def main():
    dtype = torch.float32 if "fp32" in sys.argv[1:2] else torch.bfloat16
    configs = [json.loads(a) for a in sys.argv[2:4]] + [{}, {}]
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    print(f"{'kernel#variant (launch order)':<32} warps  regs  spill stack  shared")
    from kda_moe.kernels import dependent_launch

    dependent_launch._hardware_supports = lambda device: True  # the decoding kernels as graphed decoding launches them
    with dependent_launch.dependent_launches():
        compiled = compile_all(dtype, configs[0], configs[1])
    for name, kernels in compiled.items():
        for i, kernel in enumerate(kernels):
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                       text=True).stdout
            regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
            print(f"{name + '#' + str(i):<32} {kernel.metadata.num_warps:>5} {regs:>5} {stack:>11} "
                  f"{kernel.metadata.shared:>7}")


if __name__ == "__main__":
    main()
