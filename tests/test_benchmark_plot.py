"""benchmarks/plot.py on the committed H200 results (the README's figure is drawn from them, each number from the
latest file that measured it), and benchmarks/results/ holding exactly the files README.md and PERFORMANCE.md cite."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def load_plot():
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install -e .[dev])")
    spec = importlib.util.spec_from_file_location("kda_plot", ROOT / "benchmarks" / "plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_merges_files_latest_first_and_writes_the_figure(tmp_path):
    plot = load_plot()
    runs = [RESULTS / name for name in ("2026-12-03_decode_bb30998.json", "2026-12-03_kda_c9c1b34_tf32.json",
                                        "2026-12-03_kda_6e0b9a0.json")]  # fmt: skip
    out = tmp_path / "kda.png"
    rows, decode = plot.plot(out, runs)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    # the later file timed 16 x 4096 x 16 and 1 x 32768 x 96; 4 x 16384 x 16 comes from the earlier one only
    assert rows[(16, 4096, 16)]["ours_bounded_fwdbwd_ms"] == pytest.approx(19.18, abs=0.01)
    assert rows[(4, 16384, 16)]["ours_bounded_fwdbwd_ms"] == pytest.approx(23.68, abs=0.01)
    assert sorted(decode) == [1, 64, 256]
    _, _, sources, _ = plot.merge(runs)
    assert sources[((16, 4096, 16), "fla_safe_fwd_ms")] == "2026-12-03_kda_6e0b9a0.json"
    assert sources[((4, 16384, 16), "fla_safe_fwd_ms")] == "2026-12-03_kda_c9c1b34_tf32.json"


def test_readme_figure_takes_every_shape_from_one_run_with_fla_beside_ours():
    plot = load_plot()
    rows, decode, sources, _ = plot.merge(plot.README_FIGURE_RESULTS)
    for shape, run in (((16, 4096, 16), "2026-12-04_kda_24635c9.json"), ((4, 16384, 16), "2026-12-04_kda_24635c9.json"),
                       ((1, 65536, 16), "2026-12-04_kda_7228260_h16.json"),
                       ((1, 32768, 96), "2026-12-04_kda_7228260_h96.json")):  # fmt: skip
        for column in ("ours_bounded_fwd_ms", "fla_safe_fwd_ms", "ours_bounded_fwdbwd_ms", "fla_safe_fwdbwd_ms"):
            assert sources[(shape, column)] == run
    assert sorted(decode) == [1, 64, 256] and sources[("decode", 256)] == "2026-12-03_decode_bb30998.json"
    assert rows[(16, 4096, 16)]["ours_bounded_fwdbwd_ms"] == pytest.approx(14.10, abs=0.01)
    assert rows[(16, 4096, 16)]["fla_safe_fwdbwd_ms"] == pytest.approx(15.62, abs=0.01)
    assert Path(plot.FIGURE).parent == RESULTS and Path(plot.FIGURE).exists()


def test_results_folder_holds_exactly_the_files_the_docs_cite():
    docs = (ROOT / "README.md").read_text() + (ROOT / "benchmarks" / "PERFORMANCE.md").read_text()
    cited = set(re.findall(r"results/([\w.\-]+\.\w+)", docs))
    kept = {path.relative_to(RESULTS).as_posix() for path in RESULTS.rglob("*") if path.is_file()}
    assert cited - kept == set(), "cited but missing"
    assert kept - cited == set(), "kept but cited nowhere"
