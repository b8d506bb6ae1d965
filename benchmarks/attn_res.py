"""The Block AttnRes mix on the GPU: our fused Triton kernel vs flash-linear-attention 0.6.0's ``fused_attnres`` vs our
PyTorch reference, forward and forward + backward.

    python benchmarks/attn_res.py OUTDIR [cpu]          (kda_moe importable; fla 0.6.0 for its column)

Shapes (rows = B*T, d, N blocks; the mix reads N + 1 sources): the anchor config's 16384 rows of width 1024 with 1 to
4 blocks, and K3's width 7168 with 8. Sources bf16, norm and query weights fp32, as in bf16 training. fla gets the
same sources as a list (blocks, then the partial sum), ``rms_weight`` = our norm weight and ``query`` = our query
weight, so both compute the same function. Each row also gives both sides' errors against our fp32 reference
(output, and the worst of the four gradients) and our achieved GB/s over the fewest bytes (the sources read once and
the output written once forward; backward also reads the sources and the output gradient once and writes the
sources' gradients). Writes OUTDIR/attn_res_bench.md and .json after every row and prints the table.

``cpu``: tiny fp32 shapes on the CPU, our kernels under the Triton interpreter (``TRITON_INTERPRET=1`` is set before
kda_moe is imported), no fla, each time from one call: a check of the plumbing, not of speed.
"""

import json
import os
import sys
import time

if __name__ == "__main__" and "cpu" in sys.argv[2:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402

from kda_moe.kernels.attn_res import attn_res_mix  # noqa: E402
from kda_moe.kernels.attn_res.reference import attn_res_mix as reference_mix  # noqa: E402

SHAPES = [(16384, 1024, n) for n in (1, 2, 3, 4)] + [(16384, 7168, 8)]
CPU_SHAPES = [(10, 40, 1), (10, 40, 3)]
EPS = 1e-6


def gpu_time(fn, grad_to_none):
    """Median ms of ``fn`` on the GPU."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=grad_to_none)


def cpu_time(fn, grad_to_none):
    """ms of one call of ``fn`` (the interpreter: plumbing, not speed)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def make(rows, d, blocks, dtype, device):
    """bf16 (or ``dtype``) sources of different sizes, fp32 weights far from the uniform mixture, an output
    gradient; the weights and sources need grad."""
    gen = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    scales = torch.linspace(0.5, 2.0, blocks, device=device)[:, None, None]
    partial, stored = r(rows, d).to(dtype), (r(blocks, rows, d) * scales).to(dtype)
    norm_weight, query_weight = 1 + 0.1 * r(d), r(d) * d ** -0.5 * 4
    leaves = [t.requires_grad_() for t in (partial, stored, norm_weight, query_weight)]
    return leaves, r(rows, d).to(dtype)


def sides(fused_attnres):
    """Each compared implementation as ``fn(partial, blocks, norm_weight, query_weight) -> out``."""
    fns = {
        "ours": lambda p, b, w, q: attn_res_mix(p, b, w, q, EPS, backend="triton"),
        "torch_ref": lambda p, b, w, q: reference_mix(p, b, w, q, EPS),
    }
    if fused_attnres is not None:
        fns["fla"] = lambda p, b, w, q: fused_attnres(q, [*b.unbind(0), p], w, rms_eps=EPS)
    return fns


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def errors(fn, leaves, grad_out):
    """``fn``'s output error and its worst gradient error against the fp32 reference on the same inputs."""
    def run(f, cast):
        inputs = [t.detach().to(cast(t)).requires_grad_() for t in leaves]
        out = f(*inputs)
        return [out, *torch.autograd.grad(out, inputs, grad_out.to(out.dtype))]

    got = run(fn, lambda t: t.dtype)
    expected = run(lambda *x: reference_mix(*x, EPS), lambda t: torch.float32)
    return rel(got[0], expected[0]), max(rel(a, b) for a, b in zip(got[1:], expected[1:]))


def min_bytes(rows, d, blocks, dtype, backward):
    size = rows * d * torch.finfo(dtype).bits // 8
    forward = (blocks + 1) * size + size
    return forward + ((blocks + 1) * size + size + (blocks + 1) * size if backward else 0)


def main(out, cpu=False):
    os.makedirs(out, exist_ok=True)
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    timer = cpu_time if cpu else gpu_time
    fused_attnres = None
    if not cpu:
        try:
            from fla.ops.attnres import fused_attnres
        except Exception as e:  # noqa: BLE001
            print("fla not importable:", e)
    res = {"torch": torch.__version__, "triton": triton.__version__,
           "gpu": "cpu (interpreter)" if cpu else torch.cuda.get_device_name(), "rows": []}
    for rows, d, blocks in CPU_SHAPES if cpu else SHAPES:
        leaves, grad_out = make(rows, d, blocks, dtype, device)
        row = dict(rows=rows, d=d, blocks=blocks)
        for name, fn in sides(fused_attnres).items():
            try:
                row[f"{name}_fwd_ms"] = timer(lambda: fn(*leaves), None)
                row[f"{name}_fwdbwd_ms"] = timer(lambda: fn(*leaves).backward(grad_out), leaves)
                if name != "torch_ref":
                    row[f"{name}_rel_err_out"], row[f"{name}_rel_err_grad"] = errors(fn, leaves, grad_out)
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                if cpu or name == "ours":
                    raise
            if not cpu:
                torch.cuda.empty_cache()
        for p in ("fwd", "fwdbwd"):
            if f"ours_{p}_ms" in row:
                row[f"ours_{p}_GBps"] = min_bytes(rows, d, blocks, dtype, p == "fwdbwd") / row[f"ours_{p}_ms"] / 1e6
        res["rows"].append(row)
        text = write_table(res, out)
    print(text)
    return res


def write_table(res, out):
    """Write OUTDIR/attn_res_bench.md and .json from what ``res`` holds so far; returns the markdown."""
    md = [f"GPU: {res['gpu']}; torch {res['torch']}, triton {res['triton']}. Sources bf16 (fp32 on CPU), weights fp32; "
          "errors against our fp32 reference (output / worst gradient).", "",
          "| rows x d, N blocks | pass | ours | fla fused_attnres | torch ref | fla / ours | torch / ours | "
          "ours GB/s | rel err ours | rel err fla |", "|---|---|---|---|---|---|---|---|---|---|"]
    ms = lambda x: f"{x:.3f} ms" if x is not None else "-"  # noqa: E731
    ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
    for r in res["rows"]:
        err = {side: (f"{r[f'{side}_rel_err_out']:.1e} / {r[f'{side}_rel_err_grad']:.1e}"
                      if f"{side}_rel_err_out" in r else r.get(f"{side}_error", "-")) for side in ("ours", "fla")}
        for p in ("fwd", "fwdbwd"):
            ours, fla, ref = (r.get(f"{side}_{p}_ms") for side in ("ours", "fla", "torch_ref"))
            gbps = f"{r[f'ours_{p}_GBps']:.0f}" if f"ours_{p}_GBps" in r else "-"
            md.append(f"| {r['rows']} x {r['d']}, N={r['blocks']} | {p} | {ms(ours)} | {ms(fla)} | {ms(ref)} | "
                      f"{ratio(fla, ours)} | {ratio(ref, ours)} | {gbps} | {err['ours']} | {err['fla']} |")
    text = "\n".join(md)
    open(os.path.join(out, "attn_res_bench.md"), "w").write(text + "\n")
    json.dump(res, open(os.path.join(out, "attn_res_bench.json"), "w"), indent=1)
    return text


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".", cpu="cpu" in sys.argv[2:])
