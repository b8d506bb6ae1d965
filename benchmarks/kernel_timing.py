"""What the single-kernel benchmarks share (``moe_decode.py``, ``mla_decode.py``, ``decode_projections.py``): times
from ``triton.testing.do_bench``, the copy bandwidth measured in the same run, CUDA-graph replays, sweeps of launch
settings, and the markdown table with each row's fastest settings. The scripts import it as ``kernel_timing`` (each
puts its own folder on the path) and call it through the module, so that a test's stand-ins replace it everywhere."""

import json
import os

import torch
from triton.testing import do_bench


def bench(fn) -> float:
    """Milliseconds per call of ``fn``."""
    return do_bench(fn, warmup=25, rep=100)


def copy_GBps() -> float:
    """Device-to-device copy bandwidth (read + write bytes per second) on 1 GiB."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / bench(lambda: dst.copy_(src)) / 1e6


def graphed(fn):
    """``fn`` captured in a CUDA graph after a warm-up call; returns the replay, or None where the call cannot be
    captured (a host read inside it) or does not compile (a launch setting beyond the multiprocessor's resources)."""
    try:
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay
    except Exception as error:
        print(f"  no CUDA graph: {type(error).__name__}: {str(error)[:120]}", flush=True)
        torch.cuda.synchronize()
        return None


def sweep(launches, describe, call) -> dict[str, float]:
    """Microseconds per graphed ``call(launch)`` for each of ``launches`` that compiles, keyed by ``describe``."""
    times = {}
    for launch in launches:
        replay = graphed(lambda launch=launch: call(launch))
        if replay is not None:
            times[describe(launch)] = 1e3 * bench(replay)
    return times


def options(argv: list[str], **defaults) -> tuple[dict[str, list], bool]:
    """The script's ``key=a,b`` arguments as lists of the default's element type (the default where a key is absent),
    and whether ``tune`` was given. An unknown key or word raises, naming the ones the script takes."""
    given = dict(a.split("=", 1) if "=" in a else (a, "") for a in argv)
    unknown = sorted(set(given) - set(defaults) - {"tune"})
    if unknown:
        raise SystemExit(f"unknown options {unknown}: this script takes "
                         + " ".join(f"{key}=a,b" for key in defaults) + " and tune")
    values = {key: [type(default[0])(v) for v in given[key].split(",")] if key in given else list(default)
              for key, default in defaults.items()}
    return values, "tune" in given


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def run(out: str, name: str, columns: list[str], label, measure) -> None:
    """Measure the rows ``measure(GBps)`` yields (GBps: the copy bandwidth, measured first), writing OUTDIR/<name>.json
    after every row (a run cut short keeps what it measured); then OUTDIR/<name>.md, the ``table``, printed too."""
    os.makedirs(out, exist_ok=True)
    GBps = copy_GBps()
    rows = []
    for row in measure(GBps):
        rows.append(row)
        print(row, flush=True)
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(dict(copy_GBps=GBps, device=device_name(), rows=rows), f, indent=1)
    markdown = table(rows, columns, GBps, label)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)


def table(rows: list[dict], columns: list[str], GBps: float, label) -> str:
    """The rows' ``columns`` as a markdown table; then, for the rows with a sweep (``launch_us``), the six fastest
    settings and the pick's time (``launch``), each row named by ``label(row)``."""

    def cell(value):
        return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = [f"copy bandwidth {GBps:.0f} GB/s; {device_name()}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    tuned = [r for r in rows if r.get("launch_us")]
    if tuned:
        lines += ["", "Launch settings, us per call (graphed), fastest first:", ""]
        for r in tuned:
            ranked = sorted(r["launch_us"].items(), key=lambda item: item[1])
            pick = r["launch_us"].get(r["launch"])
            lines.append(f"- {label(r)}: " + "; ".join(f"{name} {us:.1f}" for name, us in ranked[:6])
                         + f" (pick: {'-' if pick is None else f'{pick:.1f}'})")
    return "\n".join(lines)
