"""The absorbed-MLA decode attention of a decoding step on the GPU: the Triton kernel (split over the cache, then
combined) against its PyTorch reference, with the copy bandwidth measured in the same run.

    python benchmarks/mla_decode.py OUTDIR [shapes=anchor,k3] [batches=1,8,32,128] [contexts=2048,32768] [tune]
                                                                                           (kda_moe importable)

Shapes (bf16, one new token a sequence): ``anchor`` = benchmarks/model.py's anchor config's MLA (8 heads, latent 256,
rotary 32); ``k3`` = K3's (96 heads, latent 512, rotary 64). The cache holds ``context`` positions, the last 32 masked
out by a bool mask as a static cache's unfilled room is. Per row, microseconds per call replayed from a CUDA graph:

- ``ours``: ``mla_decode_attention`` on the Triton backend (``mla_decode_launch``'s pick, named in ``launch``);
- ``reference``: the PyTorch reference (fp32 scores over the whole cache), where its products, the cache broadcast
  over the heads in fp32, fit in 8 GB (the same bound for ``rel_err``).

``cache_MB`` is the latent + rotary cache a call reads; ``ours_GBps`` = those bytes / our time, ``ours_of_copy`` its
share of the copy bandwidth; ``rel_err`` our error against the fp32 reference. ``tune`` also times other launch
settings (block of positions, warps, tiles per split) at every row.

Writes OUTDIR/mla_decode.json after every row (a run cut short keeps what it measured) and OUTDIR/mla_decode.md.
"""

import dataclasses
import os
import sys

import torch

from kda_moe.kernels.backend import multiprocessor_count
from kda_moe.kernels.mla import decode, mla_decode_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # kernel_timing.py beside us, also when loaded by path
import kernel_timing  # noqa: E402

dev = "cuda"
DTYPE = torch.bfloat16
SHAPES = {"anchor": (8, 256, 32), "k3": (96, 512, 64)}  # heads, latent, rotary
BATCHES = (1, 8, 32, 128)
CONTEXTS = (2048, 32768)
UNFILLED = 32  # masked positions at the cache's end


def attention_inputs(B, S, H, L, R, seed=0):
    """q_latent [B, H, 1, L], q_rope [B, H, 1, R], latent [B, 1, S, L], k_rope [B, 1, S, R], mask [B, 1, 1, S]."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    shapes = [(B, H, 1, L), (B, H, 1, R), (B, 1, S, L), (B, 1, S, R)]
    tensors = [torch.randn(*shape, generator=gen, device=dev, dtype=DTYPE) for shape in shapes]
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool, device=dev)
    mask[..., S - UNFILLED:] = False
    return (*tensors, mask)


def launches(B, H, S, L):
    """``mla_decode_launch``'s pick first, then other settings of positions per tile, warps and tiles per split."""
    picked = decode.mla_decode_launch(B, H, S, L, DTYPE, multiprocessor_count(torch.device(dev)))
    others = [dataclasses.replace(picked, block_n=bn, warps=w, split_len=tiles * bn)
              for bn in (32, 64) for w in (2, 4, 8) for tiles in (1, 2, 4, 8)]
    return [picked] + [launch for launch in others if launch != picked]


def describe(launch) -> str:
    return f"m{launch.block_m} n{launch.block_n} w{launch.warps} split {launch.split_len}"


def row(name, B, S, GBps, tune):
    H, L, R = SHAPES[name]
    q_latent, q_rope, latent, k_rope, mask = attention_inputs(B, S, H, L, R)
    scale = (L // 2 + R) ** -0.5
    cache_bytes = (latent.numel() + k_rope.numel()) * latent.element_size()
    launch = decode.mla_decode_launch(B, H, S, L, DTYPE, multiprocessor_count(latent.device))
    d = dict(shape=name, B=B, S=S, H=H, L=L, R=R, cache_MB=cache_bytes / 1e6, launch=describe(launch),
             splits=-(-S // launch.split_len))

    def ours():
        return mla_decode_attention(q_latent, q_rope, latent, k_rope, mask, scale=scale, backend="triton")

    def reference():
        return mla_decode_attention(q_latent, q_rope, latent, k_rope, mask, scale=scale, backend="torch")

    fits_reference = B * H * S * L * 4 < 8e9  # the reference's products broadcast the cache over the heads
    with torch.no_grad():
        if fits_reference:
            expected = mla_decode_attention(q_latent.float(), q_rope.float(), latent.float(), k_rope.float(), mask,
                                            scale=scale, backend="torch")
            d["rel_err"] = ((ours().float() - expected).norm() / expected.norm()).item()
        d["ours_us"] = 1e3 * kernel_timing.bench(kernel_timing.graphed(ours))
        d["ours_GBps"] = cache_bytes / d["ours_us"] / 1e3
        d["ours_of_copy"] = d["ours_GBps"] / GBps
        if fits_reference:
            d["reference_us"] = 1e3 * kernel_timing.bench(kernel_timing.graphed(reference))
        if tune:
            d["launch_us"] = kernel_timing.sweep(launches(B, H, S, L), describe, lambda launch: (
                decode.launch_mla_decode(q_latent, q_rope, latent, k_rope, mask, scale, launch)))
    return d


COLUMNS = ["shape", "B", "S", "cache_MB", "launch", "splits", "ours_us", "ours_GBps", "ours_of_copy", "reference_us",
           "rel_err"]


def main(out):
    args, tune = kernel_timing.options(sys.argv[2:], shapes=list(SHAPES), batches=BATCHES, contexts=CONTEXTS)
    kernel_timing.run(out, "mla_decode", COLUMNS, lambda r: f"{r['shape']} B={r['B']} S={r['S']}", lambda GBps: (
        row(name, B, S, GBps, tune) for name in args["shapes"] for S in args["contexts"] for B in args["batches"]))


if __name__ == "__main__":
    main(sys.argv[1])
