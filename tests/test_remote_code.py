"""Self-contained checkpoints: the flattening of the package source (`kda_moe.remote_code`) on small fixture packages,
and folders written by `save_pretrained` loading with `trust_remote_code=True` in a fresh environment that has
transformers and torch but not kda_moe: logits and greedy continuations match the installed package, with and without
triton, and the bundled Triton kernels run (under Triton's interpreter on CPU)."""

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path, PurePosixPath

import numpy as np
import pytest
import torch
from conftest import tiny_model
from multimodal_testing import tiny_multimodal_model, tiny_processor
from transformers.dynamic_module_utils import get_relative_imports

from kda_moe.model_cards import GENERATED_MARK
from kda_moe.remote_code import PACKAGE_ROOT, RemoteCodeError, flat_module_name, flatten_package


# ----------------------------------------------------------------------------------------------------------------
# Flattening, on fixture packages
# ----------------------------------------------------------------------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(textwrap.dedent(source).encode("utf-8"))
    return root


@pytest.mark.parametrize(
    "path, flat",
    [
        ("modeling/modeling_kda_moe.py", "modeling_kda_moe"),
        ("configuration/configuration_kda_moe.py", "configuration_kda_moe"),
        ("processing/image_processing_kda_moe.py", "image_processing_kda_moe"),
        ("kernels/kda/chunk_fwd.py", "kernels_kda_chunk_fwd"),
        ("kernels/kda/__init__.py", "kernels_kda"),
        ("kernels/conv/causal_conv.py", "kernels_causal_conv"),
        ("model_cards/template.py", "model_cards_template"),
        ("model_cards/__init__.py", "model_cards"),
        ("compat.py", "compat"),
        ("modeling_kda_moe.py", "modeling_kda_moe"),  # a flattened folder keeps its names
    ],
)
def test_flat_names_join_folders_the_file_name_does_not_already_name(path, flat):
    assert flat_module_name(PurePosixPath(path)) == flat


FIXTURE = {
    "modeling/modeling_x.py": '''\
        """Model; a docstring line may mention relative imports mid-line: from .nothing import x."""

        import torch

        from ..configuration.configuration_x import XConfig
        from ..ops.kda import (
            kda_op,
            other_op,
        )
        from ..ops.kda.impl \\
            import IMPL_NAME


        def build():  # é: non-ASCII text stays byte-identical
            from ..helpers import helper  # reached only through this function

            return helper(XConfig(), kda_op, other_op, IMPL_NAME)
        ''',
    "configuration/configuration_x.py": """\
        class XConfig:
            pass
        """,
    "ops/kda/__init__.py": """\
        from .impl import kda_op, other_op
        """,
    "ops/kda/impl.py": """\
        IMPL_NAME = "impl"


        def kda_op():
            return "kda"


        def other_op():
            return "other"
        """,
    "helpers.py": """\
        def helper(*parts):
            return [type(part).__name__ if not isinstance(part, str) else part for part in parts]
        """,
    "unused.py": """\
        from .helpers import helper
        """,
}


def test_flattening_follows_relative_imports_and_rewrites_only_their_headers(tmp_path):
    root = write_package(tmp_path / "pkg", FIXTURE)
    (root / "ops" / "kda" / "__init__.py").write_bytes(b"from .impl import kda_op, other_op\r\n")  # CRLF kept
    sources = flatten_package(root, [PurePosixPath("modeling/modeling_x.py")])
    assert list(sources) == ["configuration_x", "helpers", "modeling_x", "ops_kda", "ops_kda_impl"]  # not unused.py

    original = (root / "modeling/modeling_x.py").read_text(encoding="utf-8")
    expected = (
        original.replace("from ..configuration.configuration_x import", "from .configuration_x import")
        .replace("from ..ops.kda import", "from .ops_kda import")
        .replace("from ..ops.kda.impl \\\n    import", "from .ops_kda_impl import")
        .replace("from ..helpers import", "from .helpers import")
    )
    assert sources["modeling_x"] == expected
    assert sources["ops_kda"] == "from .ops_kda_impl import kda_op, other_op\r\n"
    assert sources["configuration_x"] == (root / "configuration/configuration_x.py").read_text()

    # transformers' loader sees exactly these imports, and the flat folder imports and runs as one package.
    bundle = tmp_path / "bundle" / "flat_fixture"
    bundle.mkdir(parents=True)
    for name, source in sources.items():
        (bundle / f"{name}.py").write_bytes(source.encode("utf-8"))
    expected_imports = {"configuration_x", "ops_kda", "ops_kda_impl", "helpers"}
    assert set(get_relative_imports(bundle / "modeling_x.py")) == expected_imports
    (bundle / "__init__.py").touch()
    sys.path.insert(0, str(bundle.parent))
    try:
        from flat_fixture.modeling_x import build

        assert build() == ["XConfig", "function", "function", "impl"]
    finally:
        sys.path.remove(str(bundle.parent))
        for name in [name for name in sys.modules if name.startswith("flat_fixture")]:
            del sys.modules[name]

    # Flattening a flat folder again (a re-save from remote code) reproduces it byte for byte.
    (bundle / "__init__.py").unlink()
    assert flatten_package(bundle, [PurePosixPath("modeling_x.py")]) == sources


@pytest.mark.parametrize(
    "source, message",
    [
        ("from . import impl\n", "imports the module 'impl'"),
        ("from .impl import *\n", "star import"),
        ("from .missing import name\n", "does not exist"),
        ("from ..outside import name\n", "above the package root"),
        ("import os; from .impl import kda_op\n", "must start its line"),
        ('"""Docs.\n\nfrom .impl import kda_op reads like an import.\n"""\n', "reword the lines"),
        ("from kda_moe.configuration import KdaMoeTextConfig\n", "imports 'kda_moe.configuration' absolutely"),
    ],
)
def test_unflattenable_import_forms_raise_errors_that_name_the_fix(tmp_path, source, message):
    root = write_package(tmp_path / "pkg", {"mod.py": source, "impl.py": "def kda_op():\n    pass\n"})
    with pytest.raises(RemoteCodeError, match=message):
        flatten_package(root, [PurePosixPath("mod.py")])


def test_names_imported_from_a_namespace_folder_or_colliding_flat_names_raise(tmp_path):
    root = write_package(tmp_path / "ns", {"mod.py": "from .ops import X\n", "ops/impl.py": "X = 1\n"})
    with pytest.raises(RemoteCodeError, match="folder without `__init__.py`"):
        flatten_package(root, [PurePosixPath("mod.py")])
    root = write_package(
        tmp_path / "collide", {"mod.py": "from .a.b_c import X\nfrom .a_b.c import Y\n", "a/b_c.py": "X = 1\n",
                               "a/__init__.py": "", "a_b/c.py": "Y = 1\n", "a_b/__init__.py": ""}
    )  # fmt: skip
    with pytest.raises(RemoteCodeError, match="both flatten to a_b_c.py"):
        flatten_package(root, [PurePosixPath("mod.py")])


def test_model_cards_import_nothing_from_modeling():
    sources = flatten_package(PACKAGE_ROOT, [PurePosixPath("model_cards/__init__.py")])
    assert set(sources) == {"model_cards", "model_cards_template"}


# ----------------------------------------------------------------------------------------------------------------
# A fresh environment: transformers, torch (and triton, PIL), no kda_moe
# ----------------------------------------------------------------------------------------------------------------

HIDE_TRITON = """
import importlib.abc, sys

class HideTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HideTriton())
"""


@contextlib.contextmanager
def one_thread():
    """Tiny models: threads only add start-up and contention costs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def perturbed(model, seed=1):
    """Non-zero AttnRes pseudo-queries, router biases and position tables (zero or constant at init), so the
    comparisons see every block at work."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("res.proj.weight", "e_score_correction_bias", "pos_emb.weight")):
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A venv without system site packages whose `.pth` lists the folders holding transformers, torch and their
    dependencies. An editable kda_moe is found through a `.pth` import hook of such a folder, which a folder listed in
    a `.pth` does not run: kda_moe is not importable there."""
    import huggingface_hub
    import PIL
    import transformers

    work = tmp_path_factory.mktemp("remote_code")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], check=True)
    python = work / "venv" / "bin" / "python"
    needed = {Path(module.__file__).resolve().parents[1] for module in (transformers, torch, huggingface_hub, np, PIL)}
    site_dirs = [path for path in dict.fromkeys(sys.path) if path and Path(path).resolve() in needed]
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    (Path(purelib) / "kda_moe_test_dependencies.pth").write_text("\n".join(site_dirs) + "\n")
    return work, python


def run_fresh(fresh, script: str, *, env: dict | None = None, hide_triton: bool = False) -> str:
    """Run `script` with the fresh venv's Python (cwd, HF_HOME and module cache in the work folder, offline), after
    `HIDE_TRITON` if `hide_triton`."""
    work, python = fresh
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    run_env |= {"HF_HOME": str(work / "hf"), "HF_MODULES_CACHE": str(work / "modules"), "HF_HUB_OFFLINE": "1"}
    run_env |= {"OMP_NUM_THREADS": "1"}  # as `one_thread`
    run_env |= env or {}
    result = subprocess.run(
        [python, "-c", (HIDE_TRITON if hide_triton else "") + textwrap.dedent(script), str(work)],
        capture_output=True,
        text=True,
        cwd=work,
        env=run_env,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    return result.stdout


@pytest.fixture(scope="module")
def saved(fresh):
    """A tiny text model (KDA, MLA, AttnRes, LatentMoE; head dim 16 for the Triton kernels), a tiny multimodal model
    with its processor, and the image processor alone, saved; inputs and the installed package's outputs beside them."""
    work, _ = fresh
    text = perturbed(tiny_model(seed=0, linear_head_dim=16))
    text.save_pretrained(work / "text")
    multimodal = perturbed(tiny_multimodal_model(seed=0, text_config={"linear_head_dim": 16}))
    processor = tiny_processor(multimodal)
    multimodal.save_pretrained(work / "multimodal")
    processor.save_pretrained(work / "multimodal")
    processor.image_processor.save_pretrained(work / "image-processor")

    input_ids = torch.randint(1, text.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    image = np.random.default_rng(0).integers(0, 256, (22, 30, 3), dtype=np.uint8)
    prompt = f"Look: {processor.image_token} What is it?"
    mm_inputs = dict(processor(text=prompt, images=[image], return_tensors="pt"))
    with torch.no_grad(), one_thread():
        expected = {
            "text_logits": text(input_ids).logits,
            "text_continuation": text.generate(input_ids, max_new_tokens=6, do_sample=False),
            "mm_logits": multimodal(**mm_inputs).logits,
            "mm_continuation": multimodal.generate(**mm_inputs, max_new_tokens=6, do_sample=False),
        }
    torch.save({"input_ids": input_ids, "image": torch.from_numpy(image), "prompt": prompt}, work / "inputs.pt")
    return work, expected, mm_inputs


def test_fresh_environment_has_transformers_but_not_kda_moe(fresh):
    out = run_fresh(
        fresh,
        """
        from importlib.util import find_spec
        print({name: find_spec(name) is not None for name in ("torch", "transformers", "PIL", "kda_moe")})
        """,
    )
    assert "{'torch': True, 'transformers': True, 'PIL': True, 'kda_moe': False}" in out


def test_saved_folders_load_generate_and_save_again_without_kda_moe(fresh, saved):
    work, expected, mm_inputs = saved
    run_fresh(
        fresh,
        """
        import sys
        from pathlib import Path

        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        work = Path(sys.argv[1])
        data = torch.load(work / "inputs.pt")
        results = {}

        def bundled(obj):  # the class comes from the folder's source, in transformers' module cache
            assert type(obj).__module__.startswith("transformers_modules."), type(obj).__module__
            return type(obj).__name__

        for name in ("text", "text-again"):
            model = AutoModelForCausalLM.from_pretrained(work / name, trust_remote_code=True).eval()
            assert bundled(model) == "KdaMoeForCausalLM"
            with torch.no_grad():
                results[f"{name}_logits"] = model(data["input_ids"]).logits
                results[f"{name}_continuation"] = model.generate(data["input_ids"], max_new_tokens=6, do_sample=False)
            if name == "text":
                model.save_pretrained(work / "text-again")
        assert bundled(AutoConfig.from_pretrained(work / "text", trust_remote_code=True)) == "KdaMoeTextConfig"
        assert bundled(AutoModel.from_pretrained(work / "text", trust_remote_code=True)) == "KdaMoeTextModel"

        for name in ("multimodal", "multimodal-again"):
            model = AutoModelForImageTextToText.from_pretrained(work / name, trust_remote_code=True).eval()
            processor = AutoProcessor.from_pretrained(work / name, trust_remote_code=True)
            image_processor = AutoImageProcessor.from_pretrained(work / name, trust_remote_code=True)
            assert bundled(model) == "KdaMoeForConditionalGeneration" and bundled(processor) == "KdaMoeProcessor"
            assert bundled(image_processor) == "KdaMoeImageProcessor"
            inputs = dict(processor(text=data["prompt"], images=[data["image"].numpy()], return_tensors="pt"))
            results[f"{name}_inputs"] = inputs
            with torch.no_grad():
                results[f"{name}_logits"] = model(**inputs).logits
                results[f"{name}_continuation"] = model.generate(**inputs, max_new_tokens=6, do_sample=False)
            if name == "multimodal":
                model.save_pretrained(work / "multimodal-again")
                processor.save_pretrained(work / "multimodal-again")
        image_processor = AutoImageProcessor.from_pretrained(work / "image-processor", trust_remote_code=True)
        assert bundled(image_processor) == "KdaMoeImageProcessor"
        results["image_processor_inputs"] = dict(image_processor(data["image"].numpy()))
        torch.save(results, work / "results.pt")
        """,
    )
    results = torch.load(work / "results.pt")
    # Same weights and torch build; weights loaded into differently aligned memory may take another SIMD path in CPU
    # BLAS, so logits may differ in the last fp32 bits. The greedy continuations must match exactly.
    for name in ("text", "text-again"):
        assert (results[f"{name}_logits"] - expected["text_logits"]).abs().max() < 1e-5, name
        assert torch.equal(results[f"{name}_continuation"], expected["text_continuation"]), name
    for name in ("multimodal", "multimodal-again"):
        assert results[f"{name}_inputs"].keys() == mm_inputs.keys()
        assert all(torch.equal(results[f"{name}_inputs"][key], mm_inputs[key]) for key in mm_inputs), name
        assert (results[f"{name}_logits"] - expected["mm_logits"]).abs().max() < 1e-5, name
        assert torch.equal(results[f"{name}_continuation"], expected["mm_continuation"]), name
    for key, value in results["image_processor_inputs"].items():
        assert torch.equal(value, mm_inputs[key]), key
    # A folder saved by the bundled code carries the same source, byte for byte, and a model card.
    for name in ("text", "multimodal"):
        written = {path.name: path.read_bytes() for path in (work / name).glob("*.py")}
        again = {path.name: path.read_bytes() for path in (work / f"{name}-again").glob("*.py")}
        assert written and written == again, name
        assert GENERATED_MARK in (work / f"{name}-again" / "README.md").read_text(), name


def publish_to_hub_cache(folder: Path, hf_home: Path, repo_id: str) -> None:
    """Lay `folder` out as the Hub cache holds a downloaded repository, so an offline `from_pretrained(repo_id)` takes
    the Hub code path (every `.py` file checked by `check_imports`, fetched one by one)."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_without_triton_every_bundled_file_passes_check_imports_and_the_hub_copy_runs_on_cpu(fresh, saved):
    work, expected, _ = saved
    publish_to_hub_cache(work / "text", work / "hf", "someone/tiny-kda-moe")
    publish_to_hub_cache(work / "multimodal", work / "hf", "someone/tiny-kda-moe-vision")
    run_fresh(
        fresh,
        """
        import sys
        from pathlib import Path

        import torch
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor
        from transformers.dynamic_module_utils import check_imports

        work = Path(sys.argv[1])
        try:
            import triton  # noqa: F401
        except ModuleNotFoundError:
            pass
        else:
            raise AssertionError("triton is still importable")
        files = sorted({*work.joinpath("text").glob("*.py"), *work.joinpath("multimodal").glob("*.py")})
        for file in files:
            check_imports(file)  # what a Hub download runs on every file
        print("checked", len(files))
        data = torch.load(work / "inputs.pt")
        model = AutoModelForCausalLM.from_pretrained("someone/tiny-kda-moe", trust_remote_code=True).eval()
        multimodal = AutoModelForImageTextToText.from_pretrained("someone/tiny-kda-moe-vision", trust_remote_code=True)
        processor = AutoProcessor.from_pretrained("someone/tiny-kda-moe-vision", trust_remote_code=True)
        inputs = processor(text=data["prompt"], images=[data["image"].numpy()], return_tensors="pt")
        with torch.no_grad():
            results = {"text_logits": model(data["input_ids"]).logits, "mm_logits": multimodal.eval()(**inputs).logits}
        assert not any(name.partition(".")[0] == "triton" for name in sys.modules)
        torch.save(results, work / "results-without-triton.pt")
        """,
        hide_triton=True,
    )
    results = torch.load(work / "results-without-triton.pt")
    assert (results["text_logits"] - expected["text_logits"]).abs().max() < 1e-5  # tolerance: see the test above
    assert (results["mm_logits"] - expected["mm_logits"]).abs().max() < 1e-5


def test_bundled_model_runs_its_triton_kernels_and_matches_the_installed_package(fresh, saved):
    pytest.importorskip("triton")
    from kda_moe import KdaMoeForCausalLM

    work, _, _ = saved
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU: Triton's interpreter (conftest sets it)
    input_ids = torch.load(work / "inputs.pt")["input_ids"][:1, :8].to(device)
    installed = KdaMoeForCausalLM.from_pretrained(work / "text", kernel_backend="triton").to(device).eval()
    with torch.no_grad(), one_thread():
        expected = installed(input_ids).logits.cpu()
    run_fresh(
        fresh,
        f"""
        import sys
        from pathlib import Path

        import torch
        from transformers import AutoModelForCausalLM

        work = Path(sys.argv[1])
        input_ids = torch.load(work / "inputs.pt")["input_ids"][:1, :8].to({device!r})
        # kernel_backend="triton" never falls back to the reference: it runs the kernels or raises.
        model = AutoModelForCausalLM.from_pretrained(work / "text", trust_remote_code=True, kernel_backend="triton")
        model = model.to({device!r}).eval()
        with torch.no_grad():
            logits = model(input_ids).logits.cpu()
        kernel_modules = [
            name for name, module in list(sys.modules.items())
            if name.startswith("transformers_modules.") and "@triton.jit" in Path(module.__file__).read_text()
        ]
        assert kernel_modules, "no bundled Triton kernel module was imported"
        torch.save(logits, work / "results-triton.pt")
        """,
        env={} if device == "cuda" else {"TRITON_INTERPRET": "1"},
    )
    logits = torch.load(work / "results-triton.pt")
    # The same kernels on the same inputs and weights: the same numbers.
    assert torch.equal(logits, expected)
