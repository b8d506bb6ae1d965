"""benchmarks/plot.py on the committed H200 results: the README's figure is drawn from them, each number from the
latest run that measured it."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install -e .[dev])")
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200-2026-12-03"
LATEST = RESULTS.parent / "h200-2026-12-04"


def load_plot():
    spec = importlib.util.spec_from_file_location("kda_plot", RESULTS.parents[1] / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_merges_runs_latest_first_and_writes_the_figure(tmp_path):
    plot = load_plot()
    runs = [RESULTS / f"run_{name}.json" for name in ("E_decode", "F", "H", "I")]
    out = tmp_path / "kda.png"
    rows, decode = plot.plot(out, runs)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    # run I timed only ours at 4x16384x16 with today's defaults; fla's columns there come from run F
    row = rows[(4, 16384, 16)]
    assert row["ours_bounded_fwdbwd_ms"] == pytest.approx(20.39, abs=0.01)
    assert row["fla_safe_fwdbwd_ms"] == pytest.approx(16.03, abs=0.01)
    assert rows[(16, 4096, 16)]["ours_bounded_fwdbwd_ms"] == pytest.approx(19.18, abs=0.01)  # run H over run F
    assert sorted(decode) == [1, 64, 256]
    _, _, sources, _ = plot.merge(runs)
    assert sources[((4, 16384, 16), "ours_bounded_fwd_ms")] == "run_I.json"
    assert sources[((4, 16384, 16), "fla_safe_fwd_ms")] == "run_F.json"


def test_readme_figure_takes_every_shape_from_one_same_run_measurement():
    """The README's file list: stop 20's run O timed ours and fla at 16 x 4096 x 16, run O16 at the two other 16-head
    shapes, run O96 at the 96-head one, overriding runs K, K96 and N; the decode panel keeps run E's."""
    plot = load_plot()
    latest = ("K", "K96", "N", "O16", "O96", "O")
    runs = [RESULTS / "run_E_decode.json"] + [LATEST / f"run_{name}.json" for name in latest]
    rows, decode, sources, _ = plot.merge(runs)
    for shape, run in (((16, 4096, 16), "run_O.json"), ((4, 16384, 16), "run_O16.json"),
                       ((1, 65536, 16), "run_O16.json"), ((1, 32768, 96), "run_O96.json")):
        for column in ("ours_bounded_fwd_ms", "fla_safe_fwd_ms", "ours_bounded_fwdbwd_ms", "fla_safe_fwdbwd_ms"):
            assert sources[(shape, column)] == run
    assert sorted(decode) == [1, 64, 256] and sources[("decode", 256)] == "run_E_decode.json"
    assert rows[(16, 4096, 16)]["ours_bounded_fwdbwd_ms"] == pytest.approx(14.37, abs=0.01)
    assert rows[(16, 4096, 16)]["fla_safe_fwdbwd_ms"] == pytest.approx(15.43, abs=0.01)
