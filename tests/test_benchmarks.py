"""benchmarks/kda.py and benchmarks/model.py end to end on CPU (kda.py under the Triton interpreter, with stand-in
timings; model.py with a tiny config): their plumbing (variants, error checks, tables) must not rot between the GPU
runs that use them. The numbers are not checked here."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton kernels in the interpreter (no CUDA)", allow_module_level=True)
pytest.importorskip("triton")

from benchmark_testing import load_benchmark  # noqa: E402


@pytest.fixture
def interpreted_kda_benchmark(monkeypatch):
    """benchmarks/kda.py on CPU under the interpreter: fp32 inputs, every timing 1 ms, every peak 2 GiB."""
    bench = load_benchmark("kda.py")
    make = bench.make

    def make_fp32(B, T, H, K):  # the interpreter's bf16 tl.dot is wrong, so the stand-in run is fp32
        return tuple(t.float() for t in make(B, T, H, K))

    monkeypatch.setattr(bench, "dev", "cpu")
    monkeypatch.setattr(bench, "make", make_fp32)
    monkeypatch.setattr(bench, "ceilings", lambda: (1.0, 1.0))
    monkeypatch.setattr(bench, "bench", lambda fn, grad_to_none=None, rep=100: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "peak_gib", lambda fn: (fn(), 2.0)[1])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu (interpreter)")
    return bench


def test_kda_benchmark_writes_its_table_with_our_errors(tmp_path, monkeypatch, interpreted_kda_benchmark):
    bench = interpreted_kda_benchmark
    monkeypatch.setattr(bench, "SHAPES", [(1, 70, 2, 16), (1, 64, 1, 16)])
    monkeypatch.setattr(sys, "argv", ["kda.py", str(tmp_path), "fast", "nodecode", "shapes=1x70x2"])
    bench.main(str(tmp_path))

    result = json.loads((tmp_path / "kda_bench.json").read_text())
    (row,) = result["rows"]  # shapes= kept one of the two
    assert (row["B"], row["T"], row["H"]) == (1, 70, 2) and "check_error" not in row
    assert row["ours_bounded_fwd_ms"] == row["ours_bounded_fwdbwd_ms"] == 1.0
    assert row["rel_err_o_bounded"] < 1e-4 and row["rel_err_o_softplus"] < 1e-4 and row["finite"]
    assert set(row["rel_err_grads_bounded"]) == {"q", "k", "v", "g", "beta", "A_log", "dt_bias"}
    assert max(row["rel_err_grads_bounded"].values()) < 1e-3
    table = (tmp_path / "kda_bench.md").read_text()
    assert "| 1x70x2 | fwd | 1.00 ms |" in table and "| 1x70x2 | fwdbwd | 1.00 ms |" in table
    assert row["ours_bounded_fwdbwd_peak_GiB"] == 2.0 and table.splitlines()[-1].endswith("| 2.00 / - |")


def test_kda_benchmark_without_fast_times_each_stage_and_kernel(tmp_path, monkeypatch, interpreted_kda_benchmark):
    """Without ``fast`` the benchmark also times each stage of our pipeline alone (stand-in timings here), profiles
    one forward + backward per kernel (on CPU the profiler sees the interpreter's torch ops, longest first) and times
    the softplus gate under both gate draws."""
    bench = interpreted_kda_benchmark
    monkeypatch.setattr(bench, "SHAPES", [(1, 64, 1, 16)])
    profile_once = bench.kernel_times
    monkeypatch.setattr(bench, "kernel_times", lambda step, iterations=10: profile_once(step, iterations=1))
    monkeypatch.setattr(sys, "argv", ["kda.py", str(tmp_path), "nodecode"])
    bench.main(str(tmp_path))

    result = json.loads((tmp_path / "kda_bench.json").read_text())
    assert set(result["stage_ms"]) == {"fwd_chunk", "fwd_scan", "fwd_chunk_tf32_inverse", "bwd_recompute", "bwd_scan",
                                       "bwd_state_grads", "bwd_wy_grads", "bwd_gate_grads"}
    times = list(result["kernel_ms"].values())
    assert times and all(ms > 0 for ms in times) and times == sorted(times, reverse=True)
    (row,) = result["rows"]  # the softplus gate under both draws: the benchmark's steep gates and mild_dt_bias's
    assert row["ours_softplus_fwd_ms"] == row["ours_softplus_mild_fwd_ms"] == row["ours_softplus_mild_fwdbwd_ms"] == 1.0
    assert "ours softplus, mild gates" in (tmp_path / "kda_bench.md").read_text()


def test_kda_benchmark_decode_tables_time_the_fused_layer_step(tmp_path, monkeypatch, interpreted_kda_benchmark):
    """``decode``: the decode kernel's table, then a KDA layer's decode step: ours as three launches and fused, each
    eager and graphed (no CUDA graph on CPU: the stand-in replays the call), the fused kernel under each launch of
    ``fused_knobs``, the torch reference, and the fused step's error against the fp32 reference (fp32 inputs here)."""
    bench = interpreted_kda_benchmark
    for name, value in [("DECODE_BATCHES", [2, 1]), ("DECODE_HEADS", 2), ("DECODE_DIM", 16),
                        ("DECODE_DTYPE", torch.float32), ("graphed", lambda fn: fn)]:
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(sys, "argv", ["kda.py", str(tmp_path), "decode"])
    bench.main(str(tmp_path))

    result = json.loads((tmp_path / "kda_bench.json").read_text())
    assert not result["rows"] and [d["B"] for d in result["decode"]] == [2, 1]
    for d in result["decode"]:
        for name in ("unfused", "unfused_graph", "fused", "fused_graph", "torch"):
            assert d[f"step_{name}_ms"] == 1.0
        assert len(d["step_knob_ms"]) == len(bench.fused_knobs(16)) and set(d["step_knob_ms"].values()) == {1.0}
        assert d["step_rel_err_fused"] < 1e-5 and d["step_rel_err_fused_state"] < 1e-5
    table = (tmp_path / "kda_bench.md").read_text()
    assert "| B | ours unfused | unfused, graph | ours fused | fused, graph |" in table
    assert "| 1 | 1000.0 | 1000.0 | 1000.0 | 1000.0 |" in table


def test_every_kda_kernel_compiles_for_an_h200_and_fits_its_shared_memory():
    """The interpreter accepts code the compiler rejects: compile every KDA kernel (chunked with its steep-chunk
    pre-pass and diagonal-block pass, decode, fused layer decode), the MLA and MoE decode kernels, the projection
    kernel, the top-k router, the AttnRes mix, the grouped experts' weighted activation and the mxfp4 grouped GEMM for
    sm_90 (no GPU needed) through benchmarks/compile_report.py, in a process without the interpreter."""
    import subprocess

    from triton.runtime import driver

    if not hasattr(driver, "set_active"):  # the report's stand-in sm_90 driver plugs in there
        pytest.skip("this Triton has no driver.set_active: benchmarks/compile_report.py needs updating for it")
    root = Path(__file__).resolve().parents[1]
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "compile_report.py"), "bf16"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines()[1:] if "#" in line]
    kernels = {row[0].split("#")[0] for row in rows}
    assert kernels == {"_steep_chunks_kernel", "_diagonal_scores_kernel", "_chunk_kernel", "_scan_kernel", "_scan_bwd_kernel", "_state_grads_kernel", "_wy_grads_kernel",
                       "_gate_grads_kernel", "_decode_kernel", "_fused_decode_kernel", "_mla_split_kernel",
                       "_mla_combine_kernel", "_moe_up_kernel", "_moe_down_kernel", "_moe_sum_kernel", "_projections_kernel",
                       "_router_logits_kernel", "_sigmoid_top_k_kernel", "_attn_res_fwd_kernel", "_attn_res_bwd_kernel",
                       "_weighted_glu_fwd_kernel", "_weighted_glu_bwd_kernel", "_mxfp4_grouped_mm_kernel"}, out.stdout
    for name, warps, regs, stack, shared in rows:
        assert int(shared) <= 227 * 1024, (name, shared)  # the most shared memory one H100 / H200 block can have


def test_tf32_emulation_shows_the_gate_gradients_keep_their_precision_through_tf32_products():
    """benchmarks/tf32_emulation.py cuts every tf32 product's operands as the H200's MMA does. The gate gradient
    cancels the row and column sides of every score-gradient pair and dt_bias's sums it over every token, so a
    rounding that differed between the two sides would show there (dt_bias off by more than 1e-2 at this shape);
    with tf32 products (the default for fp32 inputs) they stay about as close as with tf32x3. In a subprocess, since
    the script patches the interpreter's products."""
    import subprocess

    from kda_moe.kernels.kda import chunk_bwd

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tf32_emulation.py"
    out = subprocess.run([sys.executable, str(script), "1x256x1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("tf32", "tf32x3"):
            rows[cells[0]] = dict(zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias"), map(float, cells[1:])))
    # the default: bf16 operands for bf16 inputs, tf32 (the first row) for fp32 inputs such as these
    assert set(rows) == {"tf32", "tf32x3"}
    assert chunk_bwd.backward_launch(128, 128, 2, torch.float32).gate_prec == "bf16"
    for prec in ("tf32", "tf32x3"):
        assert rows[prec]["dt_bias"] < 3e-3 and rows[prec]["g"] < 3e-3, (prec, rows[prec])


@pytest.fixture
def tiny_model_benchmark(monkeypatch):
    """benchmarks/model.py on CPU with a tiny config and transformers' Kimi Linear on its PyTorch paths."""
    from test_kimi_linear_checkpoints import import_kimi_linear_on_torch, tiny_kimi_linear_config

    bench = load_benchmark("model.py")
    monkeypatch.setattr(bench, "dev", "cpu")
    monkeypatch.setattr(bench, "anchor_config", tiny_kimi_linear_config)
    monkeypatch.setattr(bench, "kimi_linear_class", lambda: import_kimi_linear_on_torch().KimiLinearForCausalLM)
    monkeypatch.setattr(bench, "CASES", [("train_step", (1, 32)), ("prefill", (40,)), ("generate", (2, 8, 3))])
    return bench


def test_model_benchmark_times_both_models_on_one_checkpoint(tmp_path, tiny_model_benchmark):
    """benchmarks/model.py end to end on CPU with a tiny config: transformers' Kimi Linear (on its PyTorch paths) and
    ours from its checkpoint agree on the logits, and every case gets a row with both sides' throughput."""
    tiny_model_benchmark.main(str(tmp_path))

    result = json.loads((tmp_path / "model_bench.json").read_text())
    assert result["logits_rel_err"] < 1e-5 and result["logits_rel_err_torch_backend"] < 1e-5
    assert [(row["case"], row["shape"]) for row in result["rows"]] == [("train_step", [1, 32]), ("prefill", [40]),
                                                                        ("generate", [2, 8, 3])]
    for row in result["rows"]:
        for side in ("theirs", "ours"):
            assert "error" not in row[side], row[side]
            assert row[side]["decode_tok_s" if row["case"] == "generate" else "tok_s"] > 0
    # training also with ours' loss from the logits; training and prefill also with transformers' experts
    timed_in = {side: [row["case"] for row in result["rows"] if side in row] for side in tiny_model_benchmark.VARIANTS}
    assert timed_in == {"ours_logits_loss": ["train_step"], "ours_transformers_experts": ["train_step", "prefill"]}
    assert all(row[side]["tok_s"] > 0 for row in result["rows"] for side in tiny_model_benchmark.VARIANTS if side in row)
    table = (tmp_path / "model_bench.md").read_text()
    assert "| train_step 1x32 |" in table and "| generate 2x8x3 |" in table and "loss from the logits" in table
    assert "transformers' grouped_mm experts" in table


def test_model_benchmark_cut_short_keeps_the_sides_it_measured(tmp_path, tiny_model_benchmark, monkeypatch):
    """A run stopped during our side of the first case (a call's time limit) has already written transformers' side
    of that case to the table."""
    run_case = tiny_model_benchmark.run_case

    def stopped_at_ours(model, case, shape, vocab):
        if isinstance(model, tiny_model_benchmark.KdaMoeForCausalLM):
            raise KeyboardInterrupt  # not an Exception: the case loop does not catch it, as it cannot catch a kill
        return run_case(model, case, shape, vocab)

    monkeypatch.setattr(tiny_model_benchmark, "run_case", stopped_at_ours)
    with pytest.raises(KeyboardInterrupt):
        tiny_model_benchmark.main(str(tmp_path))

    (row,) = json.loads((tmp_path / "model_bench.json").read_text())["rows"]
    assert row["case"] == "train_step" and row["theirs"]["tok_s"] > 0 and "ours" not in row
    assert "| train_step 1x32 |" in (tmp_path / "model_bench.md").read_text()


def test_model_benchmark_profile_writes_each_sides_training_step_profile(tmp_path, tiny_model_benchmark):
    """``profile``: a profiler table of one training step per side (on CPU its ops; their matmuls appear), and no
    timed cases."""
    tiny_model_benchmark.main(str(tmp_path), profile=True)

    assert not (tmp_path / "model_bench.json").exists()
    for side in ("theirs", "ours"):
        table = (tmp_path / f"model_profile_{side}.txt").read_text()
        assert "Self CPU" in table and "aten::mm" in table, table[:400]


def test_model_benchmark_runs_only_the_kinds_of_case_picked(tmp_path, tiny_model_benchmark):
    """``cases=prefill``: the prefill rows alone."""
    tiny_model_benchmark.main(str(tmp_path), kinds=["prefill"])

    result = json.loads((tmp_path / "model_bench.json").read_text())
    assert [row["case"] for row in result["rows"]] == ["prefill"]


def test_ncu_lines_charges_each_instructions_stall_samples_to_its_source_line():
    """benchmarks/ncu_lines.py's attribution, on a made-up kernel: nvdisasm's line table (with a predicated
    instruction) and ncu's per-instruction samples (absolute addresses, one stall column per reason)."""
    lines = load_benchmark("ncu_lines.py")
    sass = "\n".join([
        '\t//## File "/x/kernels/kda/chunk_fwd.py", line 10',
        "        /*0000*/                   LDG.E R2, [R4.64] ;",
        "        /*0010*/                   FADD R3, R2, R2 ;",
        '\t//## File "/x/triton/language/standard.py", line 263',
        "        /*0020*/              @P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;",
        "        /*0030*/                   FADD R3, R3, R5 ;",
    ])
    where, opcodes = lines.line_table(sass)
    assert opcodes == ["LDG.E", "FADD", "BAR.SYNC.DEFER_BLOCKING", "FADD"]
    assert where[0x10] == ("chunk_fwd.py", 10) and where[0x30] == ("standard.py", 263)
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb", "stall_barrier",
              "stall_barrier (Not Issued)"]
    rows = [["7f00", "LDG.E R2, [R4.64] ;", "1", "0", "0", "0"], ["7f10", "FADD R3, R2, R2 ;", "5", "5", "0", "0"],
            ["7f20", "@P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;", "3", "0", "3", "2"], ["7f30", "FADD R3, R3, R5 ;", "1", "0",
                                                                                 "0", "0"]]
    csv_text = "\n".join(",".join(f'"{c}"' for c in r) for r in [["Kernel Name", "k"], header] + rows)
    parsed = lines.read_source_csv(csv_text)
    assert [r[1] for r in parsed] == opcodes and [r[0] for r in parsed] == [0, 0x10, 0x20, 0x30]
    (s1, loc1, why1), (s2, loc2, why2) = lines.attribute(parsed, where)
    assert (s1, loc1, why1[0]) == (0.6, ("chunk_fwd.py", 10), ("long_sb", 5 / 6))
    assert (s2, loc2, why2[0]) == (0.4, ("standard.py", 263), ("barrier", 0.75))


def test_parallel_benchmark_times_every_layout_on_two_gloo_ranks(tmp_path):
    """benchmarks/parallel.py under torchrun on 2 CPU ranks (gloo), the tiny model: every layout trains, counts the
    distinct tokens of its step (tp / ep: the ranks share a row; fsdp2, hsdp, cp, fsdp_x_cp: 2 rows' worth) and is
    compared with the single rank's throughput; the single layout's step is split by phase and by decoder layer."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(root / "benchmarks" / "parallel.py"), str(tmp_path), "model=tiny", "tokens=32", "steps=1",
               "experts=8"]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "parallel.json").read_text())
    results = report["results"]
    assert report["world"] == 2 and list(results) == ["single", "fsdp2", "hsdp", "tp", "ep", "cp", "fsdp_x_cp"]
    tokens = {"single": 32, "fsdp2": 64, "hsdp": 64, "tp": 32, "ep": 32, "cp": 64, "fsdp_x_cp": 64}
    for layout, result in results.items():
        assert result["s"] > 0 and result["tok_s"] * result["s"] == pytest.approx(tokens[layout]), layout
        gpus = 1 if layout == "single" else 2
        efficiency = result["tok_s"] / (gpus * results["single"]["tok_s"])
        assert f"| {layout} | {gpus} | {result['tok_s']:,.0f} |" in out.stdout and f"{efficiency:.2f} |" in out.stdout
    split_step_figures_are_consistent(results["single"], (tmp_path / "parallel.md").read_text())


def split_step_figures_are_consistent(single, markdown):
    """The single layout's split (tiny model, fp32 on CPU, one timed step): the phases add up to the step, each part's
    times fit in the model's, bytes are numel x 4 of a model built here, AdamW holds two moments and a step count a
    parameter, and every figure has its row in the second table."""
    from kda_moe import KdaMoeForCausalLM

    parallel = load_benchmark("parallel.py")
    with torch.device("meta"):
        model = KdaMoeForCausalLM(parallel.model_config("tiny", 8))
    phases = ("fwd_s", "bwd_s", "opt_s")
    assert all(single[key] > 0 for key in phases) and sum(single[key] for key in phases) <= single["s"] * 1.01
    assert single["fwd_bwd_peak_bytes"] is None and single["peak_GB"] is None  # CPU: no allocator statistics
    parameters = list(model.parameters())
    assert single["param_bytes"] == single["grad_bytes"] == 4 * sum(p.numel() for p in parameters)
    assert single["optim_bytes"] == 2 * single["param_bytes"] + 4 * len(parameters)
    assert single["saved_bytes"] > 0
    kinds = {"linear_attention": "KDA", "full_attention": "MLA", "dense": "dense MLP", "sparse": "LatentMoE"}
    expected = {}
    for index, layer in enumerate(model.model.layers):
        attention, mlp = kinds[model.config.layer_types[index]], kinds[model.config.mlp_layer_types[index]]
        expected.update({f"layer {index}": layer, f"layer {index} {attention}": layer.self_attn,
                         f"layer {index} {mlp}": layer.mlp})  # fmt: skip
    assert list(single["parts"]) == list(expected)
    for name, part in single["parts"].items():
        numel = sum(p.numel() for p in expected[name].parameters())
        assert part["param_bytes"] == part["grad_bytes"] == 4 * numel and part["optim_bytes"] == 8 * numel + 4 * len(
            list(expected[name].parameters())
        ), name
        assert 0 < part["fwd_s"] <= single["fwd_s"] and 0 < part["bwd_s"] <= single["bwd_s"], name
        assert 0 < part["saved_bytes"] <= single["saved_bytes"], name
    for index in range(len(model.model.layers)):
        layer, attention, mlp = (single["parts"][name] for name in list(expected)[3 * index : 3 * index + 3])
        assert all(attention[key] + mlp[key] <= layer[key] for key in ("fwd_s", "bwd_s", "param_bytes"))
    layer_seconds = [single["parts"][f"layer {index}"]["fwd_s"] for index in range(len(model.model.layers))]
    assert sum(layer_seconds) <= single["fwd_s"]
    milliseconds = " | ".join(f"{single[key] * 1e3:.2f}" for key in phases)
    assert f"| model | {milliseconds} |" in markdown
    assert all(f"| {name} | " in markdown for name in expected)


def test_parallel_benchmark_single_layout_with_frozen_experts_builds_on_the_device(tmp_path, monkeypatch):
    """``layouts=single frozen=experts`` on one gloo rank: the model is built in place (no checkpoint written) and
    the routed experts' weights take no gradient and no AdamW state, while everything else trains as before."""
    import socket

    from kda_moe import KdaMoeForCausalLM

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            GLOO_SOCKET_IFNAME="lo").items():
        monkeypatch.setenv(name, value)
    parallel = load_benchmark("parallel.py")
    single = parallel.main(tmp_path, model="tiny", layouts="single", tokens=16, steps=1, experts=8,
                           frozen="experts")["single"]
    assert not (tmp_path / "checkpoint").exists()
    with torch.device("meta"):
        model = KdaMoeForCausalLM(parallel.model_config("tiny", 8))
    trained = [p for name, p in model.named_parameters() if ".mlp.experts." not in name]
    assert len(trained) < len(list(model.parameters()))
    assert single["param_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    assert single["grad_bytes"] == 4 * sum(p.numel() for p in trained)
    assert single["optim_bytes"] == 8 * sum(p.numel() for p in trained) + 4 * len(trained)
    assert "routed experts frozen" in (tmp_path / "parallel.md").read_text()
    with pytest.raises(ValueError, match="frozen='all'"):
        parallel.main(tmp_path, model="tiny", frozen="all")


def test_parallel_benchmark_refuses_unknown_layouts_and_models(tmp_path):
    parallel = load_benchmark("parallel.py")
    with pytest.raises(ValueError, match="unknown layouts \\['dp'\\]"):
        parallel.main(tmp_path, model="tiny", layouts="single,dp")
    with pytest.raises(ValueError, match="model='k4'"):
        parallel.main(tmp_path, model="k4")


def test_attn_res_benchmark_cpu_mode_writes_its_table(tmp_path):
    """benchmarks/attn_res.py ``cpu``: tiny fp32 shapes, our kernels under the interpreter, no fla column; ours within
    1e-5 of the fp32 reference in the output and every gradient."""
    bench = load_benchmark("attn_res.py")
    result = bench.main(str(tmp_path), cpu=True)

    assert [(r["rows"], r["d"], r["blocks"]) for r in result["rows"]] == bench.CPU_SHAPES
    for row in result["rows"]:
        assert row["ours_rel_err_out"] < 1e-5 and row["ours_rel_err_grad"] < 1e-5
        assert all(row[f"{side}_{p}_ms"] > 0 for side in ("ours", "torch_ref") for p in ("fwd", "fwdbwd"))
        assert not any(key.startswith("fla") for key in row)
    table = (tmp_path / "attn_res_bench.md").read_text()
    assert "| 10 x 40, N=3 | fwdbwd |" in table and json.loads((tmp_path / "attn_res_bench.json").read_text())["rows"]


def test_mxfp4_experts_benchmark_cpu_mode_writes_its_table(tmp_path):
    """benchmarks/mxfp4_experts.py ``cpu``: tiny fp32 shapes under the interpreter; the packed kernel's output equals
    the dense call's on the decoded weights (1e-5) and the weights take 4.25 bits."""
    bench = load_benchmark("mxfp4_experts.py")
    result = bench.main(str(tmp_path), cpu=True)

    (row,) = result["rows"]
    assert row["rel_err"] < 1e-5 and row["bits_per_weight"] == 4.25
    assert all(row[f"{case}_{p}_ms"] > 0 for case in bench.CASES for p in ("fwd", "fwdbwd"))
    table = (tmp_path / "mxfp4_experts.md").read_text()
    assert "| 12 x 2 of 5 | mxfp4 |" in table and json.loads((tmp_path / "mxfp4_experts.json").read_text())["rows"]


def test_kernel_benchmark_options_parse_lists_keep_defaults_and_refuse_unknown_keys():
    timing = load_benchmark("kernel_timing.py")
    args, tune = timing.options(["batches=1,32", "tune"], shapes=["anchor", "k3"], batches=(1, 8))
    assert args == {"shapes": ["anchor", "k3"], "batches": [1, 32]} and tune
    assert timing.options(["shapes=k3"], shapes=["anchor", "k3"], batches=(1, 8)) == (
        {"shapes": ["k3"], "batches": [1, 8]}, False)
    with pytest.raises(SystemExit, match=r"unknown options \['batch', 'tunes'\]: this script takes shapes=a,b"):
        timing.options(["batch=1", "tunes"], shapes=["anchor"])
