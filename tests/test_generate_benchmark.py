"""benchmarks/generate.py end to end on CPU with a tiny Kimi Linear config (transformers' model on its PyTorch paths,
ours from its checkpoint, fp32 so that greedy tokens can be compared exactly), and its figure: the plumbing (cases,
rows, floor, tables, options) must not rot between the GPU runs that use it. The timings are not checked."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(name):
    spec = importlib.util.spec_from_file_location(f"{Path(name).stem}_script", ROOT / "benchmarks" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def bench(monkeypatch):
    from test_kimi_linear_checkpoints import import_kimi_linear_on_torch, tiny_kimi_linear_config

    bench = load_script("generate.py")
    monkeypatch.setattr(bench.model_bench, "dev", "cpu")
    monkeypatch.setattr(bench.model_bench, "anchor_config", tiny_kimi_linear_config)
    kimi_linear_class = lambda: import_kimi_linear_on_torch().KimiLinearForCausalLM  # noqa: E731
    monkeypatch.setattr(bench.model_bench, "kimi_linear_class", kimi_linear_class)
    monkeypatch.setattr(bench, "DTYPE", torch.float32)
    return bench


RUN = dict(batches=[1, 3], prompts=[6], new_tokens=4)


def test_generate_benchmark_writes_a_row_per_batch_and_prompt_with_every_side(tmp_path, bench, monkeypatch):
    """Every side of every row has its step time (or, for a side that fails, its error); with a prefill budget of 8
    tokens the 3 x 6 prompts go through generate()'s chunked prefill, 2 tokens a chunk, on every side."""
    monkeypatch.setattr(bench, "PREFILL_TOKENS", 8)
    res = bench.main(str(tmp_path), **RUN)

    saved = json.loads((tmp_path / "generate.json").read_text())
    assert saved == json.loads(json.dumps(res))
    assert [(row["batch"], row["prompt"]) for row in saved["rows"]] == [(1, 6), (3, 6)]
    for row in saved["rows"]:
        for side in ("dynamic", "theirs"):
            assert row[side]["ms_per_step"] > 0 and row[side]["tok_s"] > 0, row[side]
            assert 0 < row[side]["prefill_s"] < row[side]["generate_s"]
            assert row[side]["prefill_chunk_size"] == (None if row["batch"] == 1 else 2)
        assert row["static"].keys() & {"ms_per_step", "error"}  # a failing case records its error and the run goes on
        # the graphed step is a difference of two generate() times: on a busy CPU, at 4 tokens, noise can outweigh it
        assert isinstance(row["graphed"]["ms_per_step"], float)
        assert row["graphed"]["same_as_dynamic"]["shortest_prefix"] == 4
        # fp32, same weights: our greedy tokens are transformers'
        assert row["dynamic"]["same_as_theirs"] == dict(positions=row["batch"] * 4, of=row["batch"] * 4,
                                                        shortest_prefix=4)
        assert row["floor"]["ms_per_step"] > 0
    table = (tmp_path / "generate.md").read_text()
    assert "| 1 x 6 |" in table and "| 3 x 6 |" in table and "copy bandwidth" in table


def test_bandwidth_floor_counts_the_active_weights_states_and_latent_cache(bench, tmp_path):
    """At batch 1 a step reads every weight but the embedding table and the unselected experts (k of E per MoE
    layer); at batch b the expected number of distinct experts is E * (1 - (1 - k/E)^b); KDA states grow with the
    batch, the MLA latent cache with batch and context."""
    config = bench.model_bench.anchor_config()
    with bench.tempfile.TemporaryDirectory() as folder:
        _, ours = bench.model_bench.build_models(config, folder)
    experts = [m for m in ours.modules() if isinstance(m, bench.KdaMoeExperts)]
    expert_bytes = sum(p.nbytes for m in experts for p in m.parameters())
    embedding = ours.get_input_embeddings().weight.nbytes
    total = sum(p.nbytes for p in ours.parameters())
    num_experts, top_k = ours.config.num_experts, ours.config.num_experts_per_tok

    one = bench.step_bytes(ours, batch=1, context=10)
    assert one["weights"] == pytest.approx(total - embedding - expert_bytes * (1 - top_k / num_experts))
    three = bench.step_bytes(ours, batch=3, context=20)
    selected = num_experts * (1 - (1 - top_k / num_experts) ** 3)
    assert three["weights"] == pytest.approx(one["weights"] + expert_bytes * (selected - top_k) / num_experts)
    assert three["kda_state"] == 3 * one["kda_state"] and three["mla_cache"] == 6 * one["mla_cache"]
    latent = ours.config.kv_lora_rank + ours.config.qk_rope_head_dim
    assert one["mla_cache"] == ours.config.layer_types.count("full_attention") * 10 * latent * 4  # fp32 here


@pytest.mark.parametrize("case", ["dynamic", "prefill"])
def test_prompts_past_the_prefill_budget_go_in_chunks_of_the_token_budget_where_no_dense_mask_is_built(bench, case):
    """Ours on the dynamic cache attend a chunk without a mask tensor: only the token budget bounds the chunk, so a
    1M-token prompt goes in 4 forwards."""
    assert bench.prefill_chunk_size(1, 32768, case) is None and bench.prefill_chunk_size(128, 2048, case) is None
    assert bench.prefill_chunk_size(32, 32768, case) == 8192
    assert bench.prefill_chunk_size(128, 32768, case) == 2048
    assert bench.prefill_chunk_size(1, 1048576, case) == 262144


@pytest.mark.parametrize("case", ["static", "theirs"])
def test_prompts_past_the_prefill_budget_go_in_chunks_that_bound_a_dense_mla_mask(bench, case):
    assert bench.prefill_chunk_size(1, 32768, case) is None and bench.prefill_chunk_size(128, 2048, case) is None
    assert bench.prefill_chunk_size(32, 32768, case) == 4096  # 8192 tokens a row would fit, but not their mask
    assert bench.prefill_chunk_size(128, 32768, case) == 1024
    assert bench.prefill_chunk_size(1, 1048576, case) == 4096


def test_prefill_case_logs_each_chunk_as_it_ends_and_reports_time_and_peak_memory(tmp_path, bench, monkeypatch,
                                                                                   capsys):
    """`cases=prefill`: with a budget of 4 prompt tokens a forward, a 1 x 6 prompt goes in chunks of 4 (4, then 6
    tokens done) and a 2 x 6 one in chunks of 2; a line per chunk is printed as it ends, and the prefill's own table
    gives each row's chunk, seconds and tokens/s (peak memory is the GPU's: "-" here). Each chunk continues the
    cache of the ones before: the last chunk's logits are those of one forward over the whole prompt."""
    monkeypatch.setattr(bench, "PREFILL_TOKENS", 4)
    calls = []

    def recorded_prefill(model, input_ids, **kwargs):
        output = prefill_in_chunks(model, input_ids, **kwargs)
        calls.append((model, input_ids, output))
        return output

    prefill_in_chunks = bench.prefill_in_chunks
    monkeypatch.setattr(bench, "prefill_in_chunks", recorded_prefill)
    res = bench.main(str(tmp_path), **bench.parse_options(["cases=prefill", "batches=1,2", "prompts=6"]))

    rows = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert [row["prefill"]["prefill_chunk_size"] for row in rows] == [4, 2]
    assert [[chunk["tokens"] for chunk in row["prefill"]["chunks"]] for row in rows] == [[4, 6], [2, 4, 6]]
    for row in rows:
        entry = row["prefill"]
        assert 0 < entry["chunks"][0]["seconds"] <= entry["chunks"][-1]["seconds"] == entry["prefill_s"]
        assert entry["tok_s"] == pytest.approx(row["batch"] * 6 / entry["prefill_s"])
        assert entry["peak_GB"] is None and set(row) == {"batch", "prompt", "floor", "prefill"}
    printed = capsys.readouterr().out
    for line in ("prefill 1 x 6: 4 tokens in", "prefill 1 x 6: 6 tokens in", "prefill 2 x 6: 2 tokens in"):
        assert line in printed
    assert printed.index("prefill 1 x 6: 4 tokens") < printed.index("prefill 1 x 6: 6 tokens")
    assert " s, peak - GB" in printed
    table = (tmp_path / "generate.md").read_text()
    assert "| 1 x 6 | 4 |" in table and "| 2 x 6 | 2 |" in table and "ours (dynamic cache)" not in table
    assert res["rows"] == rows

    model = calls[-1][0]
    with torch.no_grad():
        whole = model(torch.cat([input_ids for _, input_ids, _ in calls[-3:]], dim=1), logits_to_keep=1).logits
    torch.testing.assert_close(calls[-1][2].logits, whole, rtol=1e-5, atol=1e-5)


def test_generate_benchmark_cut_short_keeps_the_cases_it_measured(tmp_path, bench, monkeypatch):
    """A run stopped during our first case (a call's time limit) has already written transformers' case."""
    run_case = bench.run_case

    def stopped_at_ours(model, case, *args):
        if case == "dynamic":
            raise KeyboardInterrupt  # not an Exception: the case loop does not catch it, as it cannot catch a kill
        return run_case(model, case, *args)

    monkeypatch.setattr(bench, "run_case", stopped_at_ours)
    with pytest.raises(KeyboardInterrupt):
        bench.main(str(tmp_path), **RUN)
    (row,) = json.loads((tmp_path / "generate.json").read_text())["rows"]
    assert row["theirs"]["tok_s"] > 0 and "dynamic" not in row


def test_generate_benchmark_options_pick_the_cases_batches_and_prompts(bench, tmp_path, monkeypatch):
    options = bench.parse_options(["cases=theirs,dynamic", "batches=2", "prompts=5,7", "new_tokens=3",
                                   "prefill_chunk=3"])
    assert options == dict(cases=["theirs", "dynamic"], batches=[2], prompts=[5, 7], new_tokens=3, prefill_chunk=3)
    res = bench.main(str(tmp_path), **options)
    assert [(row["batch"], row["prompt"]) for row in res["rows"]] == [(2, 5), (2, 7)]
    assert all("static" not in row and row["dynamic"]["prefill_chunk_size"] == 3 for row in res["rows"])
    assert all(row["dynamic"]["same_as_theirs"]["shortest_prefix"] == 3 for row in res["rows"])
    for bad in (["cases=eager"], ["new_tokens=1"], ["batch=2"], ["prefill_chunk=0"]):
        with pytest.raises(SystemExit):
            bench.parse_options(bad)


def test_plot_draws_tokens_per_second_of_each_side_from_the_json_files(tmp_path):
    """Rows of a later file override an earlier file's for the same batch, prompt and side; a side's failed rows are
    left out of its line."""
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install -e .[dev])")
    rows = [dict(batch=b, prompt=p, dynamic=dict(tok_s=10.0 * b), static=dict(error="Traceback ... Error: x"),
                 theirs=dict(tok_s=5.0 * b), floor=dict(tok_s=100.0 * b)) for p in (2048, 32768) for b in (1, 8, 32)]
    later = [dict(batch=8, prompt=32768, static=dict(tok_s=300.0), theirs=dict(tok_s=41.0), floor=dict(tok_s=800.0))]
    paths = [tmp_path / "first.json", tmp_path / "later.json"]
    for path, part in zip(paths, (rows, later)):
        path.write_text(json.dumps(dict(gpu="cpu", dtype="bfloat16", params=1e6, rows=part)))
    series = load_script("plot.py").plot_generate(tmp_path / "generate.png", paths)
    assert (tmp_path / "generate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "generate.png").stat().st_size > 20_000
    assert sorted(series) == [2048, 32768] and set(series[2048]) == {"dynamic", "theirs", "floor"}
    assert series[32768]["theirs"] == {1: 5.0, 8: 41.0, 32: 160.0} and series[32768]["static"] == {8: 300.0}
    assert series[32768]["dynamic"] == {1: 10.0, 8: 80.0, 32: 320.0}


def test_plot_command_line_draws_the_generate_figure(tmp_path, bench):
    import subprocess

    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install -e .[dev])")
    bench.main(str(tmp_path), cases=["theirs", "dynamic"], batches=[1], prompts=[5], new_tokens=3)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plot.py"), "generate", str(tmp_path / "g.png"),
                          str(tmp_path / "generate.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_profile_writes_the_host_split_and_the_step_table(tmp_path, monkeypatch):
    """benchmarks/decode_profile.py on CPU (no graph: the table lists CPU operators): the step, the host split and
    an operator table, in the markdown and the json; the graphed case without the host split; the timings are not
    checked."""
    from test_kimi_linear_checkpoints import import_kimi_linear_on_torch, tiny_kimi_linear_config

    profile = load_script("decode_profile.py")
    monkeypatch.setattr(profile.model_bench, "dev", "cpu")
    monkeypatch.setattr(profile.model_bench, "anchor_config", tiny_kimi_linear_config)
    monkeypatch.setattr(profile.model_bench, "kimi_linear_class",
                        lambda: import_kimi_linear_on_torch().KimiLinearForCausalLM)
    monkeypatch.setattr(profile.generate_bench, "DTYPE", torch.float32)
    res = profile.main(str(tmp_path), batch=2, prompt=6, new_tokens=8)

    assert json.loads((tmp_path / "decode_profile.json").read_text()) == json.loads(json.dumps(res))
    assert res["step_ms"] > 0 and all(us > 0 for us in res["host_us"].values())
    assert res["kernels"]["source"] == "cpu_ops" and res["kernels"]["steps"] == 7
    assert any(op["name"] == "aten::linear" for op in res["kernels"]["top"])
    table = (tmp_path / "decode_profile.md").read_text()
    assert "| prepare_inputs_for_generation |" in table and "| the rest: generate()'s own loop |" in table
    assert (tmp_path / "trace.json.gz").exists()
    graphed = profile.main(str(tmp_path / "graphed"), case="graphed", batch=1, prompt=6, new_tokens=8)
    assert graphed["case"] == "graphed" and graphed["step_ms"] > 0 and graphed["host_us"] == {}
    table = (tmp_path / "graphed" / "decode_profile.md").read_text()
    assert "graphed blocks" in table and "| the step (decode time over its steps) |" in table
    assert "prepare_inputs_for_generation" not in table
    with pytest.raises(SystemExit, match="new_tokens must be 8 or more"):
        profile.parse_options(["new_tokens=4"])
    with pytest.raises(SystemExit, match="unknown option"):
        profile.parse_options(["case=dynamic"])
    assert profile.parse_options(["batch=8", "prompt=32768", "case=graphed"]) == dict(batch=8, prompt=32768,
                                                                                       case="graphed")
