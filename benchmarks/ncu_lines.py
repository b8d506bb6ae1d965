"""Where the KDA Triton kernels spend their time, per Python source line: Nsight Compute's warp-stall samples of one
warm forward + backward, attributed through each kernel's line table.

    python benchmarks/ncu_lines.py OUTDIR [BxTxHxK] [softplus]       (on the GPU machine; default 4x4096x16x128)

Runs one forward + backward of ``chunk_kda_triton`` (bf16, bounded gate unless ``softplus``) under ``ncu --set full``
with a fresh Triton cache, exports every KDA kernel launch's SASS with its stall samples, finds the launch's cubin in
that cache (the one whose instructions match), reads its line table with the ``nvdisasm`` that ships with Triton, and
writes OUTDIR/ncu_lines.txt: per launch its duration, registers, occupancy and issue-slot use, then the source lines
that hold most samples with their main stall reasons (``long_sb``: waiting on global / local memory, ``barrier``: a
``__syncthreads``, ``short_sb``: shared memory or MUFU, ``wait``: fixed latencies). Lines inside Triton's own
library (``standard.py``) are its reductions and scans.
"""

import csv
import io
import os
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

KERNELS = ("_chunk_kernel", "_scan_kernel", "_scan_bwd_kernel", "_state_grads_kernel", "_wy_grads_kernel",
           "_gate_grads_kernel")
METRICS = ("Duration", "Registers Per Thread", "Achieved Occupancy", "Issue Slots Busy")


def line_table(sass_text):
    """{instruction offset: (file name, line)} from ``nvdisasm -g`` output, and the opcodes in order."""
    where, opcodes, loc = {}, [], None
    for text in sass_text.splitlines():
        m = re.match(r'\s*//## File "(.*)", line (\d+)', text)
        if m:
            loc = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", text)
        if m:
            where[int(m.group(1), 16)] = loc
            opcodes.append(_opcode(m.group(2).split()))
    return where, opcodes


def read_source_csv(text):
    """ncu's ``--page source --csv --print-source sass`` export of one launch: rows of (offset, opcode, samples,
    {stall reason: samples}), offsets relative to the kernel's first instruction."""
    rows = list(csv.reader(io.StringIO(text)))
    start = next(i for i, r in enumerate(rows) if r[:2] == ["Address", "Source"])
    header, data = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    samples = header.index("Warp Stall Sampling (All Samples)")
    stalls = [(i, h[len("stall_"):]) for i, h in enumerate(header) if h.startswith("stall_") and "(" not in h]
    base = int(data[0][0], 16)
    return [(int(r[0], 16) - base, _opcode(r[1].split()), int(r[samples] or 0),
             {name: int(r[i] or 0) for i, name in stalls}) for r in data]


def _opcode(tokens):
    """An instruction's opcode from its tokens, past a predicate (``@P0 BRA ...``)."""
    tokens = tokens[1:] if tokens and tokens[0].startswith("@") else tokens
    return tokens[0].rstrip(";") if tokens else ""


def attribute(rows, where, top=25):
    """The ``top`` source lines by stall samples: [(share, (file, line), [(reason, share of the line), ...])]."""
    total = sum(r[2] for r in rows) or 1
    per_line, reasons = Counter(), defaultdict(Counter)
    for offset, _, samples, stalls in rows:
        loc = where.get(offset)
        per_line[loc] += samples
        reasons[loc].update(stalls)
    return [(n / total, loc, [(why, c / max(n, 1)) for why, c in reasons[loc].most_common(3)])
            for loc, n in per_line.most_common(top)]


def source_text(loc, roots):
    for root in roots:
        path = root / loc[0]
        if path.exists():
            return path.read_text().splitlines()[loc[1] - 1].strip()
    return ""


def cubin_for(opcodes, cubins, nvdisasm):
    """The line table of the cached cubin whose instructions are the launch's (same length and opcodes)."""
    for path in cubins:
        sass = subprocess.run([nvdisasm, "-g", "-c", str(path)], capture_output=True, text=True).stdout
        where, ops = line_table(sass)
        if ops == opcodes:
            return where
    return None


def child(shape, softplus):
    """The profiled program: warm up (compiles), then one forward + backward between cudaProfilerStart / Stop, on
    benchmarks/kda.py's inputs (its ``make``) and gate bound."""
    import torch

    from kda import LB, make  # benchmarks/kda.py, beside this script
    from kda_moe.kernels.kda.chunk import chunk_kda_triton

    inputs = [t.requires_grad_() for t in make(*shape)]
    do = torch.randn_like(inputs[2])
    lb = None if softplus else LB
    step = lambda: chunk_kda_triton(*inputs, gate_lower_bound=lb)[0].backward(do)
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(out, shape, softplus):
    import triton

    out.mkdir(parents=True, exist_ok=True)
    ncu = os.environ.get("NCU") or shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu) and not shutil.which(ncu):
        raise SystemExit(f"Nsight Compute's ncu not found (tried {ncu}); put it on PATH or set NCU=/path/to/ncu.")
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    cache = out / "triton_cache"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    report = out / "ncu_lines"
    args = ["x".join(map(str, shape))] + (["softplus"] if softplus else [])
    subprocess.run([ncu, "--clock-control", "none", "--profile-from-start", "off", "--set", "full",
                    "--kernel-name", "regex:" + "|".join(KERNELS), "-o", str(report), "-f",
                    sys.executable, __file__, "--child", *args], env=env, check=True)
    details = list(csv.reader(io.StringIO(subprocess.run(
        [ncu, "-i", f"{report}.ncu-rep", "--page", "details", "--csv"], capture_output=True, text=True).stdout)))
    head = details[0]
    metrics = defaultdict(dict)  # launch id -> {metric: "value unit"}
    names = {}
    for r in details[1:]:
        row = dict(zip(head, r))
        names[row["ID"]] = row["Kernel Name"]
        if row["Metric Name"] in METRICS:
            metrics[row["ID"]][row["Metric Name"]] = f"{row['Metric Value']} {row['Metric Unit']}".strip()
    roots = [Path(__file__).resolve().parents[1] / "kernels" / "kda", Path(triton.__file__).parent / "language"]
    cubins = sorted(cache.rglob("*.cubin"))
    lines = [f"ncu_lines: one forward + backward at {args[0]}, bf16, {'softplus' if softplus else 'bounded'} gate"]
    seen = Counter()
    for launch, name in sorted(names.items(), key=lambda item: int(item[0])):
        kernel = name.split("(")[0].strip()
        skip = seen[kernel]
        seen[kernel] += 1
        text = subprocess.run([ncu, "-i", f"{report}.ncu-rep", "--kernel-name", kernel, "--launch-skip", str(skip),
                               "--launch-count", "1", "--page", "source", "--csv", "--print-source", "sass"],
                              capture_output=True, text=True).stdout
        rows = read_source_csv(text)
        where = cubin_for([op for _, op, _, _ in rows], [c for c in cubins if c.stem == kernel], nvdisasm)
        lines.append(f"\n{kernel} (launch {skip}): " + ", ".join(f"{m} {v}" for m, v in metrics[launch].items()))
        if where is None:
            lines.append("  (no cached cubin matches this launch's instructions)")
            continue
        for share, loc, why in attribute(rows, where):
            reasons = ", ".join(f"{w} {100 * s:.0f}%" for w, s in why)
            place = f"{loc[0]}:{loc[1]}" if loc else "?"
            code = source_text(loc, roots)[:70] if loc else ""
            lines.append(f"  {100 * share:5.1f}%  {place:<22} {reasons:<42} {code}")
    (out / "ncu_lines.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(tuple(int(x) for x in sys.argv[2].split("x")), "softplus" in sys.argv[3:])
    else:
        shape = next((a for a in sys.argv[2:] if "x" in a), "4x4096x16x128")
        main(Path(sys.argv[1]), tuple(int(x) for x in shape.split("x")), "softplus" in sys.argv[2:])
