"""A decoding step's input projections on the GPU: the Triton projection kernel (several weights of one input in one
launch) against one cuBLAS GEMM per weight, with the copy bandwidth measured in the same run.

    python benchmarks/decode_projections.py OUTDIR [sets=kda,mla,o_proj] [tokens=1,8,16] [tune]  (kda_moe importable)

Weight sets (bf16, benchmarks/model.py's anchor config): ``kda`` = a KDA layer's six (q, k, v 1024 x 1024, the forget
and output gates' first factors 128 x 1024, beta 8 x 1024; q | k | v written side by side); ``mla`` = an MLA layer's
three (query 768, latent + rotary key 288, output gate 512, each x 1024); ``o_proj`` = one 1024 x 1024 weight. Per set
and token count, microseconds per call replayed from a CUDA graph:

- ``ours``: ``decode_projections`` on the Triton backend (``projection_launch``'s pick, named in ``launch``);
- ``cublas``: ``F.linear`` once per weight.

``weight_MB`` is what a call reads; ``ours_GBps`` = those bytes / our time, ``ours_of_copy`` its share of the copy
bandwidth; ``rel_err`` our error against fp32 products. ``tune`` also times other launch settings (output channels
per program, reduction slice, warps, pipeline depth) at every row.

Writes OUTDIR/decode_projections.json after every row and OUTDIR/decode_projections.md.
"""

import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

from kda_moe.kernels.backend import triton
from kda_moe.kernels.linear import decode, decode_projections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_timing.py beside us, also when loaded by path
import kernel_timing  # noqa: E402

dev = "cuda"
DTYPE = torch.bfloat16
HIDDEN = 1024
SETS = {"kda": (1024, 1024, 1024, 128, 8, 128), "mla": (768, 288, 512), "o_proj": (1024,)}  # output widths
GROUPS = {"kda": [3, 1, 1, 1]}  # q | k | v leave the kernel as one tensor, as the model asks
TOKENS = (1, 8, 16)


def launches(tokens):
    """``projection_launch``'s pick first, then other settings."""
    picked = decode.projection_launch(tokens, HIDDEN, DTYPE)
    others = [dataclasses.replace(picked, block_out=bn, block_k=bk, warps=w, stages=st)
              for bn in (16, 32) for bk in (128, 256, 512) for w in (2, 4, 8) for st in (2, 4)]
    if tokens < 16:  # unpadded token rows: products on the CUDA cores, narrower blocks of output channels
        others += [dataclasses.replace(picked, rows=triton.next_power_of_2(tokens), block_out=bn, block_k=bk,
                                       warps=w, stages=3)
                   for bn in (4, 8, 16) for bk in (256, 512) for w in (2, 4)]
    return [picked] + [launch for launch in others if launch != picked]


def describe(launch) -> str:
    return f"m{launch.rows} n{launch.block_out} k{launch.block_k} w{launch.warps} s{launch.stages}"


def row(name, N, GBps, tune):
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(N, HIDDEN, generator=gen, device=dev, dtype=DTYPE)
    weights = [torch.randn(n, HIDDEN, generator=gen, device=dev, dtype=DTYPE) * HIDDEN ** -0.5 for n in SETS[name]]
    weight_bytes = sum(w.numel() for w in weights) * DTYPE.itemsize
    launch = decode.projection_launch(N, HIDDEN, DTYPE)
    d = dict(set=name, N=N, weights=len(weights), weight_MB=weight_bytes / 1e6, launch=describe(launch))

    def ours():
        return decode_projections(x, weights, backend="triton", group_sizes=GROUPS.get(name))

    def cublas():
        return [F.linear(x, w) for w in weights]

    with torch.no_grad():
        expected = torch.cat([x.float() @ w.float().T for w in weights], dim=-1)
        d["rel_err"] = ((torch.cat(ours(), dim=-1).float() - expected).norm() / expected.norm()).item()
        d["ours_us"] = 1e3 * kernel_timing.bench(kernel_timing.graphed(ours))
        d["ours_GBps"] = weight_bytes / d["ours_us"] / 1e3
        d["ours_of_copy"] = d["ours_GBps"] / GBps
        d["cublas_us"] = 1e3 * kernel_timing.bench(kernel_timing.graphed(cublas))
        if tune:
            d["launch_us"] = kernel_timing.sweep(
                launches(N), describe, lambda launch: decode.launch_projections(x, weights, launch, GROUPS.get(name)))
    return d


COLUMNS = ["set", "N", "weights", "weight_MB", "launch", "ours_us", "ours_GBps", "ours_of_copy", "cublas_us", "rel_err"]


def main(out):
    args, tune = kernel_timing.options(sys.argv[2:], sets=list(SETS), tokens=TOKENS)
    kernel_timing.run(out, "decode_projections", COLUMNS, lambda r: f"{r['set']} N={r['N']}",
        lambda GBps: (row(name, N, GBps, tune) for name in args["sets"] for N in args["tokens"]))


if __name__ == "__main__":
    main(sys.argv[1])
