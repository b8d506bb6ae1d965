"""Routed experts kept mxfp4 against the same experts in bf16: one expert layer at K3's widths on the Triton
backend, forward and forward + backward in the tokens (frozen experts, as under LoRA), with the weight bytes read.

    python benchmarks/mxfp4_experts.py OUTDIR [tokens=1024,4096,16384] [experts=384] [cpu]   (kda_moe importable)

K3's expert widths (latent 3584, intermediate 3072, top-16, SiTU-GLU) over ``experts`` experts (384 hold 25 GB in
bf16; K3's 896 would leave no room for the decoded copy of the third case), bf16 tokens routed by the top-k of random
scores. Each case is one ``grouped_experts`` call:

- ``bf16``: the weights in bf16 (a model loaded with ``routed_expert_format="dense"``), the bf16 decoding of the same
  packed bytes, so every case computes with the same weights;
- ``mxfp4``: the packed weights (``Mxfp4Weight``, 4.25 bits a weight), decoded in registers by the grouped kernel;
- ``decode_then_bf16``: the packed weights decoded to bf16 by the PyTorch reference (``dequantize_mxfp4``, a few
  experts at a time) on every call, then the bf16 call: a packed model without a fused kernel.

``weight_GB``: the expert bytes a case reads once (2 bytes a weight, 17 / 32 packed; the third case also writes and
reads the decoded copy); ``tok_per_s``: tokens over the forward time; ``rel_err``: the mxfp4 output against the bf16
case's. Writes OUTDIR/mxfp4_experts.md and .json after every row and prints the table.

``cpu``: tiny fp32 shapes, the kernels under the Triton interpreter (``TRITON_INTERPRET=1`` set before kda_moe is
imported), each time from one call: a check of the plumbing, not of speed.
"""

import json
import os
import sys
import time

if __name__ == "__main__" and "cpu" in sys.argv[2:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from kda_moe.kernels.moe import Mxfp4Weight, dequantize_mxfp4, grouped_experts  # noqa: E402

K3_WIDTHS = dict(k=16, latent=3584, intermediate=3072)
CPU_WIDTHS = dict(k=2, latent=64, intermediate=32)
TOKENS, CPU_TOKENS = (1024, 4096, 16384), (12,)
EXPERTS, CPU_EXPERTS = 384, 5
CAPS = dict(activation="situ", gate_cap=4.0, up_cap=25.0)  # SiTU-GLU's (the config's defaults)
CASES = ("bf16", "mxfp4", "decode_then_bf16")


def gpu_time(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def cpu_time(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def packed_weights(E, N, K, device, gen):
    """Random mxfp4 bytes for [E, N, K] weights: uniform nibbles, scales 2 ** -10 ... 2 ** -6 (values up to 6 / 64,
    about the spread of a trained layer's weights at these widths)."""
    packed = torch.randint(0, 256, (E, N, K // 2), generator=gen, device=device, dtype=torch.uint8)
    scale = torch.randint(117, 122, (E, N, K // 32), generator=gen, device=device, dtype=torch.uint8)
    return Mxfp4Weight(packed, scale)


def decode(weight: Mxfp4Weight, dtype, experts_at_once: int = 16):
    """``dequantize_mxfp4`` a few experts at a time (it decodes in fp32 through an int32 index: 8 bytes a weight)."""
    return torch.cat([dequantize_mxfp4(p, s, dtype) for p, s in zip(weight.packed.split(experts_at_once),
                                                                     weight.scale.split(experts_at_once))])


def row(N, E, widths, dtype, device, timer):
    k, L, I = widths["k"], widths["latent"], widths["intermediate"]
    gen = torch.Generator(device=device).manual_seed(0)
    gate_up, down = packed_weights(E, 2 * I, L, device, gen), packed_weights(E, L, I, device, gen)
    scores = torch.rand(N, E, generator=gen, device=device)
    weights, index = scores.topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    x = torch.randn(N, L, generator=gen, device=device, dtype=dtype).requires_grad_()
    grad_out = torch.randn(N, L, generator=gen, device=device, dtype=dtype)
    decoded = tuple(decode(w, dtype) for w in (gate_up, down))

    def call(case):
        if case == "bf16":
            experts = decoded
        elif case == "mxfp4":
            experts = (gate_up, down)
        else:
            experts = tuple(decode(w, dtype) for w in (gate_up, down))
        return grouped_experts(x, index, weights, *experts, backend="triton", **CAPS)

    dense_bytes = 3 * E * I * L * dtype.itemsize
    packed_bytes = sum(w.packed.numel() + w.scale.numel() for w in (gate_up, down))
    result = dict(tokens=N, experts=E, **widths, weight_GB=dict(bf16=dense_bytes / 1e9, mxfp4=packed_bytes / 1e9,
                                                               decode_then_bf16=(packed_bytes + 2 * dense_bytes) / 1e9))
    outputs = {}
    for case in CASES:
        with torch.no_grad():
            outputs[case] = call(case)
            result[f"{case}_fwd_ms"] = timer(lambda case=case: call(case))
        result[f"{case}_fwdbwd_ms"] = timer(lambda case=case: torch.autograd.grad(call(case), x, grad_out))
        result[f"{case}_tok_per_s"] = N / result[f"{case}_fwd_ms"] * 1e3
    reference = outputs["bf16"].float()
    result["rel_err"] = ((outputs["mxfp4"].float() - reference).norm() / reference.norm()).item()
    result["bits_per_weight"] = 8 * packed_bytes / (3 * E * I * L)
    return result


def write_table(rows, device_name, out):
    lines = [f"routed experts, mxfp4 vs bf16, {device_name}", "",
             "| tokens | case | weight GB read | fwd ms | fwd+bwd ms | tokens/s | vs bf16 (fwd) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        for case in CASES:
            speedup = r["bf16_fwd_ms"] / r[f"{case}_fwd_ms"]
            lines.append(f"| {r['tokens']} x {r['k']} of {r['experts']} | {case} | {r['weight_GB'][case]:.2f} | "
                         f"{r[f'{case}_fwd_ms']:.3f} | {r[f'{case}_fwdbwd_ms']:.3f} | {r[f'{case}_tok_per_s']:,.0f} | "
                         f"{speedup:.2f}x |")
    lines += ["", "mxfp4 output vs bf16: " + ", ".join(f"{r['rel_err']:.1e}" for r in rows) + " (relative); "
              f"{rows[0]['bits_per_weight']} bits a weight"]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "mxfp4_experts.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out, "mxfp4_experts.json"), "w") as f:
        json.dump(dict(device=device_name, rows=rows), f, indent=1)
    return table


def main(out, tokens=None, experts=None, cpu=False):
    os.makedirs(out, exist_ok=True)
    device, dtype, timer = ("cpu", torch.float32, cpu_time) if cpu else ("cuda", torch.bfloat16, gpu_time)
    device_name = "cpu (interpreter)" if cpu else torch.cuda.get_device_name()
    widths = CPU_WIDTHS if cpu else K3_WIDTHS
    rows = []
    for N in tokens or (CPU_TOKENS if cpu else TOKENS):
        rows.append(row(N, experts or (CPU_EXPERTS if cpu else EXPERTS), widths, dtype, device, timer))
        table = write_table(rows, device_name, out)
    print(table)
    return dict(device=device_name, rows=rows)


if __name__ == "__main__":
    options = dict(arg.split("=", 1) for arg in sys.argv[2:] if "=" in arg)
    main(sys.argv[1], tokens=[int(n) for n in options["tokens"].split(",")] if "tokens" in options else None,
         experts=int(options["experts"]) if "experts" in options else None, cpu="cpu" in sys.argv[2:])
