"""The routed experts of a decoding step on the GPU: the MoE decode kernel against transformers' experts
implementations on the same weights, with the copy bandwidth measured in the same run.

    python benchmarks/moe_decode.py OUTDIR [shapes=anchor,k3] [tokens=1,8,32,64] [tune]      (kda_moe importable)

Shapes (bf16): ``anchor`` = benchmarks/model.py's anchor config's experts (64, top-8, full width 1024, intermediate
512, SwiGLU); ``k3`` = K3's widths (latent 3584, intermediate 3072, top-16, SiTU-GLU) over 384 experts (25 GB of
weights). Per shape and token count N, the tokens route by the top-k of uniform random scores; ms per call of:

- ``ours``: ``moe_decode`` on the Triton backend, called eagerly and replayed from a CUDA graph (``ours_graph``);
- ``grouped_mm`` (transformers' default), ``batched_mm`` and ``eager``: a ``KdaMoeExperts`` on the torch backend under
  each ``experts_implementation``, called eagerly (``batched_mm`` and ``grouped_mm`` also from a CUDA graph where they
  can be captured; the eager loop reads the routing on the host and cannot).

Bytes: ``expert_MB`` is what the kernel, grouped_mm and the eager loop read of the weights (the distinct chosen experts,
once each); batched_mm gathers each (token, choice)'s expert into a new tensor and multiplies that: 3 x N x k experts
(``batched_MB``). ``ours_GBps`` = expert bytes / the graphed kernel's time, ``ours_of_copy`` its share of the copy
bandwidth; ``rel_err`` the kernel's error against the fp32 reference (``routed_experts``) on the same inputs. ``tune``
also times the launch settings of ``knobs`` (``moe_decode_launch``'s pick first) at every row, graphed, and lists
the fastest under the table.

Writes OUTDIR/moe_decode.json after every row (a run cut short keeps what it measured) and OUTDIR/moe_decode.md.
"""

import dataclasses
import os
import sys

import torch

from kda_moe.kernels.backend import triton
from kda_moe.kernels.moe import decode, moe_decode, routed_experts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_timing.py beside us, also when loaded by path
import kernel_timing  # noqa: E402

dev = "cuda"
DTYPE = torch.bfloat16
SHAPES = {"anchor": (64, 8, 1024, 512, "silu"), "k3": (384, 16, 3584, 3072, "situ")}  # E, k, l, I, activation
TOKENS = (1, 8, 32, 64)
CAPS = dict(gate_cap=4.0, up_cap=25.0)  # SiTU-GLU's (the config's defaults)


def experts_inputs(N, E, k, L, I, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(N, L, generator=gen, device=dev, dtype=DTYPE)
    weights, index = torch.rand(N, E, generator=gen, device=dev).topk(k, dim=-1)
    return x, index, (weights / weights.sum(-1, keepdim=True)).to(DTYPE)


def transformers_experts(E, k, L, I, activation, gate_up, down):
    """A ``KdaMoeExperts`` on the torch backend holding ``gate_up`` / ``down`` (shared, not copied)."""
    from kda_moe import KdaMoeTextConfig
    from kda_moe.modeling.modeling_kda_moe import KdaMoeExperts

    config = KdaMoeTextConfig(num_experts=E, num_experts_per_tok=k, hidden_size=L, routed_expert_hidden_size=L,
                              moe_intermediate_size=I, kernel_backend="torch", hidden_act=activation)
    with torch.device("meta"):
        experts = KdaMoeExperts(config)
    experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down, requires_grad=False)
    return experts


def knobs(N, L, I):
    picked = decode.moe_decode_launch(N, L, I)
    others = [dataclasses.replace(picked, block_inter=bi, block_out=bo, block_k=bk, warps=w, stages=st)
              for bi, bo, bk, w, st in [(16, 32, 128, 4, 2), (16, 32, 128, 4, 4), (16, 32, 256, 4, 2),
                                        (32, 32, 64, 4, 3), (16, 64, 64, 4, 3), (32, 64, 128, 4, 3),
                                        (16, 32, 64, 2, 3), (64, 64, 64, 8, 3), (16, 16, 128, 4, 3),
                                        (16, 16, 256, 4, 2)]]
    if N < 16:  # unpadded token rows: products on the CUDA cores, narrower blocks of channels
        others += [dataclasses.replace(picked, rows=triton.next_power_of_2(N), block_inter=bi, block_out=bo,
                                       block_k=bk, warps=w, stages=st)
                   for bi, bo, bk, w, st in [(4, 8, 256, 4, 3), (8, 8, 256, 4, 3), (4, 16, 128, 4, 3),
                                             (8, 16, 512, 4, 2), (16, 32, 128, 4, 3), (2, 4, 512, 2, 3)]]
    return [picked] + [launch for launch in others if launch != picked]


def row(name, N, shape, GBps, tune):
    E, k, L, I, activation = shape
    gen = torch.Generator(device=dev).manual_seed(1)
    gate_up = torch.randn(E, 2 * I, L, generator=gen, device=dev, dtype=DTYPE) * (3 * L ** -0.5)
    down = torch.randn(E, L, I, generator=gen, device=dev, dtype=DTYPE) * (I ** -0.5)
    x, index, weights = experts_inputs(N, E, k, L, I)
    expert_bytes = index.unique().numel() * 3 * I * L * gate_up.element_size()
    d = dict(shape=name, N=N, E=E, k=k, l=L, I=I, distinct_experts=index.unique().numel(),
             expert_MB=expert_bytes / 1e6, batched_MB=3 * N * k * 3 * I * L * gate_up.element_size() / 1e6)

    def ours():
        return moe_decode(x, index, weights, gate_up, down, activation=activation, backend="triton", **CAPS)

    with torch.no_grad():
        if N * k * 3 * I * L * 4 < 8e9:  # the reference gathers each (token, choice)'s expert in fp32
            reference = routed_experts(x, index, weights, gate_up, down, activation, **CAPS).float()
            d["rel_err"] = ((ours().float() - reference).norm() / reference.norm()).item()
        d["ours_ms"] = kernel_timing.bench(ours)
        replay = kernel_timing.graphed(ours)
        d["ours_graph_ms"] = kernel_timing.bench(replay)
        d["ours_GBps"] = expert_bytes / d["ours_graph_ms"] / 1e6
        d["ours_of_copy"] = d["ours_GBps"] / GBps
        experts = transformers_experts(E, k, L, I, activation, gate_up, down)
        for implementation in ("grouped_mm", "batched_mm", "eager"):
            if implementation == "batched_mm" and d["batched_MB"] > 20e3:
                continue  # the gathered copy would not fit
            experts.config._experts_implementation = implementation
            call = lambda: experts(x, index, weights)  # noqa: E731
            d[f"{implementation}_ms"] = kernel_timing.bench(call)
            if implementation != "eager":
                replay = kernel_timing.graphed(call)
                d[f"{implementation}_graph_ms"] = kernel_timing.bench(replay) if replay else None
        if tune:
            d["launch"] = str(decode.moe_decode_launch(N, L, I))
            d["launch_us"] = kernel_timing.sweep(knobs(N, L, I), str, lambda launch: decode.launch_moe_decode(
                x, index, weights, gate_up, down, None, activation, *CAPS.values(), launch))
    return d


COLUMNS = ["shape", "N", "distinct_experts", "expert_MB", "ours_ms", "ours_graph_ms", "ours_GBps", "ours_of_copy",
           "grouped_mm_ms", "grouped_mm_graph_ms", "batched_mm_ms", "batched_mm_graph_ms", "eager_ms", "rel_err"]


def main(out):
    args, tune = kernel_timing.options(sys.argv[2:], shapes=list(SHAPES), tokens=TOKENS)
    kernel_timing.run(out, "moe_decode", COLUMNS, lambda r: f"{r['shape']} N={r['N']}",
        lambda GBps: (row(name, N, SHAPES[name], GBps, tune) for name in args["shapes"] for N in args["tokens"]))


if __name__ == "__main__":
    main(sys.argv[1])
