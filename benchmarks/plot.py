r"""Plot benchmark results: benchmarks/kda.py's (fla's time over ours per shape, forward and forward + backward,
against the targets, and the decode step's time per batch size against the copy-bandwidth floor) and
benchmarks/generate.py's (decoded tokens/s per batch size of each side against the bandwidth floor).

    python benchmarks/plot.py [OUT.png RESULT.json [RESULT.json ...]]
    python benchmarks/plot.py generate OUT.png GENERATE.json [GENERATE.json ...]

Each RESULT.json is a ``kda_bench.json`` written by benchmarks/kda.py. Later files override earlier ones per shape
and column, so a run that timed only some shapes or columns can be plotted over an earlier run; the figure's footnote
names the file each plotted number came from. Without arguments it redraws the README's figure, FIGURE from
README_FIGURE_RESULTS. Each GENERATE.json is a ``generate.json`` written by benchmarks/generate.py (merged the same
way, per batch, prompt and side).
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

TARGETS = {"fwd": 2.0, "fwdbwd": 1.3}  # the kernels' goals: fla safe_gate time over ours
STATE_BYTES = 2 * 16 * 128 * 128 * 4  # decode: the fp32 state [H=16, K=128, V=128] read and written, per sequence
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FIGURE = os.path.join(RESULTS, "kda_h200.png")
# The README's figure: the decode panel, then the shapes of 7228260's runs (1 x 65536 x 16, 1 x 32768 x 96), then
# 24635c9's (16 x 4096 x 16, 4 x 16384 x 16, overriding 7228260's 4 x 16384 x 16); fla timed in the same run as ours.
README_FIGURE_RESULTS = [
    os.path.join(RESULTS, name)
    for name in (
        "2026-12-03_decode_bb30998.json",
        "2026-12-04_kda_7228260_h16.json",
        "2026-12-04_kda_7228260_h96.json",
        "2026-12-04_kda_24635c9.json",
    )
]


def merge(paths):
    """(rows, decode, sources): per (B, T, H) the timing columns of the latest file that has them, the decode rows
    per batch size likewise, and for every plotted value the file it came from."""
    rows, decode, sources, copy = {}, {}, {}, None
    for path in paths:
        res = json.load(open(path))
        name = os.path.basename(path)
        for r in res["rows"]:
            shape = (r["B"], r["T"], r["H"])
            for key, value in r.items():
                if key.endswith("_ms"):
                    rows.setdefault(shape, {})[key] = value
                    sources[(shape, key)] = name
        for d in res["decode"]:
            decode[d["B"]] = d
            sources[("decode", d["B"])] = name
            copy = res["copy_GBps"]
    return rows, decode, sources, copy


def plot(out, paths):
    rows, decode, sources, copy = merge(paths)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    shapes = sorted(rows, key=lambda s: (s[2], s[0] * s[1]))
    width = 0.38
    used = set()
    for i, p in enumerate(("fwd", "fwdbwd")):
        xs, ratios = [], []
        for j, s in enumerate(shapes):
            ours, fla = rows[s].get(f"ours_bounded_{p}_ms"), rows[s].get(f"fla_safe_{p}_ms")
            if ours and fla:
                xs.append(j + (i - 0.5) * width)
                ratios.append(fla / ours)
                used.update({sources[(s, f"ours_bounded_{p}_ms")], sources[(s, f"fla_safe_{p}_ms")]})
        bars = ax.bar(xs, ratios, width, label="forward" if p == "fwd" else "forward + backward",
                      color=("tab:blue", "tab:orange")[i])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.axhline(TARGETS[p], color=("tab:blue", "tab:orange")[i], ls="--", lw=1,
                   label=f"target {TARGETS[p]}x ({'forward' if p == 'fwd' else 'fwd+bwd'})")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(shapes)), [f"{b}x{t}x{h}" for b, t, h in shapes])
    ax.set_xlabel("B x T x H (K = V = 128, bf16, bounded gate)")
    ax.set_ylabel("fla chunk_kda(safe_gate=True) time / ours")
    ax.set_title("Chunked KDA vs fla 0.6.0 (above 1: ours faster)")
    ax.legend(fontsize=8, loc="upper left")

    bs = sorted(decode)
    for key, label in (("ours_ms", "ours"), ("ours_graph_ms", "ours, CUDA graph"), ("fla_ms", "fla fused_recurrent")):
        bx.plot(bs, [decode[b].get(key, float("nan")) * 1e3 for b in bs], marker="o", label=label)
    if copy:
        bx.plot(bs, [b * STATE_BYTES / copy / 1e3 for b in bs], "k--", lw=1, label="state traffic at copy bandwidth")
    used.update(sources[("decode", b)] for b in bs)
    bx.set_xscale("log", base=2)
    bx.set_yscale("log")
    bx.set_xlabel("batch (sequences decoded per step)")
    bx.set_ylabel("one decode step, us (H=16, K=V=128)")
    bx.set_title("KDA decode step")
    bx.legend(fontsize=8)
    fig.text(0.01, 0.01, "data: " + ", ".join(sorted(used)), fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=110)
    return rows, decode


GENERATE_LINES = (("dynamic", "ours, dynamic cache", "tab:blue"), ("static", "ours, static + compiled", "tab:green"),
                  ("graphed", "ours, static, graphed blocks", "tab:purple"), ("theirs", "transformers + fla", "tab:orange"),
                  ("floor", "bandwidth floor", "k"))


def plot_generate(out, paths):
    """Decoded tokens/s against the batch size, one panel per prompt length, a line per side (rows where a side failed
    are left out of its line) and the bandwidth floor dashed. ``paths``: ``generate.json`` files of one or several
    calls; a later file's row overrides an earlier one's for the same batch, prompt and side. Returns
    {prompt: {side: {batch: tokens/s}}}."""
    series, names, header = {}, [], None
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        header = header or res
        names.append(os.path.basename(path))
        for row in res["rows"]:
            for side, _, _ in GENERATE_LINES:
                if "tok_s" in row.get(side, {}):
                    series.setdefault(row["prompt"], {}).setdefault(side, {})[row["batch"]] = row[side]["tok_s"]
    prompts = sorted(series)
    fig, axes = plt.subplots(1, len(prompts), figsize=(5.5 * len(prompts), 4.5), squeeze=False)
    for ax, prompt in zip(axes[0], prompts):
        for side, label, color in GENERATE_LINES:
            points = sorted(series[prompt].get(side, {}).items())
            if points:
                ax.plot(*zip(*points), marker="o", color=color, ls="--" if side == "floor" else "-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        batches = sorted({batch for side in series[prompt].values() for batch in side})
        ax.set_xticks(batches, [str(batch) for batch in batches])
        ax.set_xlabel("batch (sequences decoded per step)")
        ax.set_ylabel("decoded tokens/s")
        ax.set_title(f"generate(), {prompt:,}-token prompts")
        ax.legend(fontsize=8)
    fig.text(0.01, 0.01, f"{header['gpu']}, {header['dtype']}, {header['params'] / 1e6:.0f}M parameters; data: "
             f"{', '.join(names)}", fontsize=7, color="0.4")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=110)
    return series


if __name__ == "__main__":
    if sys.argv[1:2] == ["generate"]:
        if len(sys.argv) < 4:
            sys.exit("usage: python benchmarks/plot.py generate OUT.png GENERATE.json [GENERATE.json ...]")
        plot_generate(sys.argv[2], sys.argv[3:])
        sys.exit()
    if len(sys.argv) == 2:
        sys.exit("usage: python benchmarks/plot.py [OUT.png RESULT.json [RESULT.json ...]]")
    out, paths = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 2 else (FIGURE, README_FIGURE_RESULTS)
    plot(out, paths)
