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
import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kda_moe.kernels.linear import decode, decode_projections

dev = "cuda"
DTYPE = torch.bfloat16
HIDDEN = 1024
SETS = {"kda": (1024, 1024, 1024, 128, 8, 128), "mla": (768, 288, 512), "o_proj": (1024,)}  # output widths
GROUPS = {"kda": [3, 1, 1, 1]}  # q | k | v leave the kernel as one tensor, as the model asks
TOKENS = (1, 8, 16)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100)


def copy_GBps() -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) on 1 GiB."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / bench(lambda: dst.copy_(src)) / 1e6


def graphed(fn):
    """``fn`` captured in a CUDA graph after a warm-up call; returns the replay."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def launches(tokens):
    """``projection_launch``'s pick first, then other settings."""
    picked = decode.projection_launch(tokens, HIDDEN, DTYPE)
    others = [dataclasses.replace(picked, block_out=bn, block_k=bk, warps=w, stages=st)
              for bn in (16, 32) for bk in (128, 256, 512) for w in (2, 4, 8) for st in (2, 4)]
    return [picked] + [launch for launch in others if launch != picked]


def describe(launch) -> str:
    return f"n{launch.block_out} k{launch.block_k} w{launch.warps} s{launch.stages}"


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
        d["ours_us"] = 1e3 * bench(graphed(ours))
        d["ours_GBps"] = weight_bytes / d["ours_us"] / 1e3
        d["ours_of_copy"] = d["ours_GBps"] / GBps
        d["cublas_us"] = 1e3 * bench(graphed(cublas))
        if tune:
            d["launch_us"] = {}
            for other in launches(N):
                call = lambda other=other: decode.launch_projections(  # noqa: E731
                    x, weights, other, GROUPS.get(name))
                try:
                    d["launch_us"][describe(other)] = 1e3 * bench(graphed(call))
                except Exception as error:  # e.g. more shared memory than a multiprocessor has
                    print(f"  {describe(other)}: {type(error).__name__}: {str(error)[:100]}", flush=True)
    return d


COLUMNS = ["set", "N", "weights", "weight_MB", "launch", "ours_us", "ours_GBps", "ours_of_copy", "cublas_us", "rel_err"]


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def table(rows, GBps) -> str:
    def cell(value):
        return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = [f"copy bandwidth {GBps:.0f} GB/s; {device_name()}", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    tuned = [r for r in rows if "launch_us" in r]
    if tuned:
        lines += ["", "Launch settings, us per call (graphed), fastest first:", ""]
        for r in tuned:
            ranked = sorted(r["launch_us"].items(), key=lambda item: item[1])
            lines.append(f"- {r['set']} N={r['N']}: " + "; ".join(f"{name} {us:.1f}" for name, us in ranked[:6])
                         + f" (pick: {r['launch_us'][r['launch']]:.1f})")
    return "\n".join(lines)


def main(out):
    args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
    sets = args.get("sets", ",".join(SETS)).split(",")
    tokens = [int(n) for n in args.get("tokens", ",".join(map(str, TOKENS))).split(",")]
    os.makedirs(out, exist_ok=True)
    GBps = copy_GBps()
    rows = []
    for name in sets:
        for N in tokens:
            rows.append(row(name, N, GBps, "tune" in sys.argv[2:]))
            print(rows[-1], flush=True)
            with open(os.path.join(out, "decode_projections.json"), "w") as f:
                json.dump(dict(copy_GBps=GBps, device=device_name(), rows=rows), f, indent=1)
    with open(os.path.join(out, "decode_projections.md"), "w") as f:
        f.write(table(rows, GBps) + "\n")
    print(table(rows, GBps))


if __name__ == "__main__":
    main(sys.argv[1])
