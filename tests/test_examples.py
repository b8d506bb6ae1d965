"""The examples run as users run them (subprocesses, offline, FutureWarnings as errors): the README demo with its
defaults on the base install, the datasets + evaluate fine-tuning script, the scaled-down context-extension curriculum
(on one process and on 2 context-parallel ranks under torchrun) and the multimodal chat; plus the chunked loss the
curriculum relies on."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import tiny_model
from huggingface_hub import ModelCard

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# Import names of what only the `examples` / `dev` extras install (pyproject.toml); triton is left out because
# PyTorch's CUDA build brings it.
EXTRAS_ONLY = ("datasets", "evaluate", "pytest", "hypothesis", "fla", "einops", "matplotlib")
# A sitecustomize that hides packages from every import finder, as if they were not installed.
HIDE_PACKAGES = """import sys


class Hiding:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.finder, name)


HIDDEN = {hidden}
sys.meta_path[:] = [Hiding(finder) if hasattr(finder, "find_spec") else finder for finder in sys.meta_path]
"""


def run_example(script, *args, cwd, timeout, hide=()):
    """Runs `python -W error::FutureWarning examples/<script> args...` in `cwd`, with the packages `hide` names
    unimportable."""
    env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1"}
    if hide:
        site = cwd / "hide-packages"
        site.mkdir()
        (site / "sitecustomize.py").write_text(HIDE_PACKAGES.format(hidden=set(hide)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    command = [sys.executable, "-W", "error::FutureWarning", str(EXAMPLES / script), *args]
    start = time.time()
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{script} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result, time.time() - start


def load_example(name):
    sys.path.insert(0, str(EXAMPLES))  # as `python examples/<name>.py` has it: the examples import each other
    spec = importlib.util.spec_from_file_location(f"kda_moe_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_demo_runs_with_its_defaults_on_the_base_install(tmp_path):
    """`python examples/quickstart.py` with none of the extras' packages importable: Trainer with a progress bar,
    the loss clearly falls, the saved folder has a valid model card and reloads, and the LoRA adapter changes the
    generation."""
    result, seconds = run_example("quickstart.py", cwd=tmp_path, timeout=600, hide=EXTRAS_ONLY)
    summary = json.loads((tmp_path / "outputs" / "quickstart" / "summary.json").read_text())
    losses = summary["losses"]
    assert losses[-1] < losses[0] - 1.0, losses  # clearly falls, not noise
    assert summary["lora_losses"][-1] < summary["lora_losses"][0]
    assert summary["adapter_changed_output"] and summary["lora_generation"] != summary["generation_without_adapter"]
    assert "it/s]" in result.stderr or "s/it]" in result.stderr  # Trainer's tqdm progress bar
    model_dir = tmp_path / "outputs" / "quickstart" / "model"
    card = ModelCard.load(model_dir / "README.md", ignore_metadata_errors=False)
    assert card.data.library_name == "transformers" and "quickstart.py" in card.text
    assert (tmp_path / "outputs" / "quickstart" / "lora-adapter" / "adapter_model.safetensors").exists()
    print(f"quickstart: {seconds:.0f}s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")


def test_finetune_on_local_jsonl_reports_perplexity_with_evaluate(tmp_path):
    out = tmp_path / "ft"
    args = ("--tiny", "--max-steps", "8", "--block-size", "64", "--batch-size", "8", "--gradient-checkpointing")
    args += ("--output-dir", str(out))
    result, _ = run_example("finetune.py", *args, cwd=tmp_path, timeout=300)
    metrics = json.loads((out / "metrics.json").read_text())
    before, after = metrics["before"], metrics["after"]
    assert after["eval_perplexity"] < before["eval_perplexity"]
    # The evaluate metric (token-weighted) agrees with Trainer's eval loss on these equal-length blocks.
    assert math.isclose(after["eval_perplexity"], math.exp(after["eval_loss"]), rel_tol=1e-4)
    assert after["eval_tokens"] > 0 and "validation perplexity after" in result.stdout
    assert (out / "model.safetensors").exists() and (out / "README.md").exists() and (out / "tokenizer.json").exists()


def test_context_extension_curriculum_runs_scaled_down(tmp_path):
    context = load_example("context_extension")
    result, _ = run_example("context_extension.py", "--scale-down", "--no-progress-bar", cwd=tmp_path, timeout=300)
    stages = json.loads((tmp_path / "outputs" / "context_extension" / "stages.json").read_text())
    assert [s["seq_len"] for s in stages] == [s.seq_len for s in context.SCALED_DOWN_STAGES]
    # The scaled-down lengths keep the recipe's ratios (8K -> 64K -> 256K -> 1M).
    ratios = lambda plan: [b.seq_len / a.seq_len for a, b in zip(plan, plan[1:])]  # noqa: E731
    assert ratios(context.SCALED_DOWN_STAGES) == ratios(context.STAGES) == [8, 4, 4]
    assert [s.seq_len for s in context.STAGES] == [8192, 65536, 262144, 1048576]
    assert stages[0]["init_from"] == "fresh model"
    for previous, stage in zip(stages, stages[1:]):
        assert stage["init_from"] == previous["saved_to"]  # each stage continues from the previous checkpoint
    for stage in stages:
        assert stage["gradient_checkpointing"] and stage["documents_per_row"] > 1  # checkpointing, packed rows
        assert len(stage["losses"]) == stage["steps"] and all(math.isfinite(x) for x in stage["losses"])
        config = json.loads((tmp_path / stage["saved_to"] / "config.json").read_text())
        assert config["max_position_embeddings"] >= stage["seq_len"]


def test_multimodal_chat_trains_saves_reloads_and_replies(tmp_path):
    out = tmp_path / "mm"
    result, _ = run_example("multimodal.py", "--steps", "3", "--output-dir", str(out), cwd=tmp_path, timeout=300)
    assert "image tokens" in result.stdout and "assistant: " in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kda_moe" and (out / "processor_config.json").exists()


def test_context_extension_curriculum_runs_context_parallel_on_2_ranks(tmp_path):
    """`torchrun --nproc-per-node 2 examples/context_extension.py --scale-down` on CPU (gloo): every stage trains with
    each packed row split across the 2 ranks, with finite losses, and saves a checkpoint the next stage loads."""
    env = {**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONWARNINGS"] = "error::FutureWarning"  # as run_example's -W, in every rank
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(EXAMPLES / "context_extension.py"), "--scale-down", "--no-progress-bar"]  # fmt: skip
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert result.returncode == 0, f"torchrun exited {result.returncode}:\n{output}"
    stages = json.loads((tmp_path / "outputs" / "context_extension" / "stages.json").read_text())
    assert len(stages) == 4 and stages[0]["init_from"] == "fresh model"
    for previous, stage in zip(stages, stages[1:]):
        assert stage["init_from"] == previous["saved_to"]
    for stage in stages:
        assert stage["context_parallel_ranks"] == 2 and stage["documents_per_row"] > 1
        assert len(stage["losses"]) == stage["steps"] and all(math.isfinite(x) for x in stage["losses"])
        assert (tmp_path / stage["saved_to"] / "config.json").exists()
