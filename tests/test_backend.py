"""The backend switch: env override, per-call 'auto', explicit 'triton' never falls back silently, and the import
layout it rests on (Triton imported in one place; kernel modules that fail to import raise)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kda_moe.kernels import backend
from kda_moe.kernels.backend import BACKENDS, resolve_backend
from kda_moe.kernels.conv import short_conv, short_conv_step
from kda_moe.kernels.kda import kimi_delta_attention
from kda_moe.kernels.norm import gated_rms_norm

PACKAGE_ROOT = Path(backend.__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("KDA_MOE_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_backends_are_the_three_documented_names():
    assert BACKENDS == ("auto", "triton", "torch")


def test_auto_on_cpu_gives_torch():
    x = torch.randn(2)
    assert resolve_backend("auto", x) == "torch"
    assert resolve_backend("torch", x) == "torch"


def test_env_var_overrides_the_requested_backend(monkeypatch):
    monkeypatch.setenv("KDA_MOE_BACKEND", "torch")
    assert resolve_backend("triton", torch.randn(2)) == "torch"
    monkeypatch.setenv("KDA_MOE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("torch", torch.randn(2)) == ("triton" if backend.TRITON_AVAILABLE else "torch")


def test_unknown_backend_names_raise_listing_the_allowed_values(monkeypatch):
    allowed = r"allowed values are \('auto', 'triton', 'torch'\)"
    with pytest.raises(ValueError, match=r"Unknown kernel backend 'cuda' \(from kernel_backend\).*" + allowed):
        resolve_backend("cuda", torch.randn(2))
    monkeypatch.setenv("KDA_MOE_BACKEND", "fast")
    with pytest.raises(ValueError, match=r"Unknown kernel backend 'fast' \(from the env var KDA_MOE_BACKEND\)"):
        resolve_backend("auto", torch.randn(2))


def test_every_public_op_refuses_triton_without_triton_and_names_the_fix(monkeypatch):
    monkeypatch.setattr(backend, "TRITON_AVAILABLE", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    H, K = 2, 4
    q = torch.randn(1, 3, H, K)
    fix = r"triton package, which is not installed.*kernel_backend='torch'"
    with pytest.raises(ImportError, match=fix):
        kimi_delta_attention(q, q, q, q, torch.randn(1, 3, H), torch.zeros(H), torch.zeros(H * K), backend="triton")
    with pytest.raises(ImportError, match=fix):
        short_conv(torch.randn(1, 3, 5), torch.randn(5, 4), backend="triton")
    with pytest.raises(ImportError, match=fix):
        short_conv_step(torch.randn(1, 5), torch.randn(5, 4), torch.zeros(1, 5, 3), backend="triton")
    with pytest.raises(ImportError, match=fix):
        gated_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), backend="triton")
    assert resolve_backend("auto", torch.randn(2)) == "torch"


@pytest.mark.skipif(not backend.TRITON_AVAILABLE, reason="triton is not installed")
def test_explicit_triton_on_cpu_raises_unless_interpreted(monkeypatch):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="needs CUDA tensors but got tensors on cpu.*TRITON_INTERPRET=1"):
        gated_rms_norm(x, x, torch.ones(8), backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", x) == "triton"


def _run_python(code):
    """Run ``code`` in a fresh interpreter that finds the kda_moe these tests import (on this process's sys.path)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).parent)


def test_without_triton_the_package_imports_and_runs_the_reference():
    """Triton missing (CPU wheels of torch): ``import kda_moe`` works, ``"auto"`` runs the reference and an explicit
    ``"triton"`` says what to install."""
    out = _run_python(
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import kda_moe\n"
        "from kda_moe.kernels import backend\n"
        "from kda_moe.kernels.norm import gated_rms_norm\n"
        "x = torch.randn(2, 8)\n"
        "assert not backend.TRITON_AVAILABLE\n"
        "assert gated_rms_norm(x, x, torch.ones(8)).shape == (2, 8)\n"
        "try:\n"
        "    gated_rms_norm(x, x, torch.ones(8), backend='triton')\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: kernel_backend='triton' needs the triton package" in out.stdout


@pytest.mark.skipif(not backend.TRITON_AVAILABLE, reason="triton is not installed")
def test_a_kernel_module_that_fails_to_import_raises_instead_of_falling_back():
    """Where Triton is installed, an error in one of our kernel modules surfaces at ``import kda_moe`` rather than
    leaving that op on the reference without a word."""
    out = _run_python("import sys; sys.modules['kda_moe.kernels.kda.chunk'] = None\nimport kda_moe\n")
    assert out.returncode != 0 and "kda_moe.kernels.kda.chunk" in out.stderr, (out.stdout, out.stderr[-3000:])


def _shipped_packages() -> list[str]:
    """pyproject.toml's ``packages``, as folders relative to the repository root ("" for the root)."""
    import tomllib

    packages = tomllib.loads((PACKAGE_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return [name.removeprefix("kda_moe").lstrip(".").replace(".", "/") for name in packages]


def _package_sources():
    """The files the package ships: the modules of every package pyproject.toml lists."""
    return [path for folder in _shipped_packages() for path in (PACKAGE_ROOT / folder).glob("*.py")]


def test_every_folder_the_package_imports_from_is_shipped():
    """A folder of modules left out of pyproject.toml's ``packages`` imports from a checkout but not from a wheel:
    every relative import of a shipped module must land in a shipped folder."""
    shipped = {PACKAGE_ROOT / folder for folder in _shipped_packages()}
    unshipped = []
    for path in _package_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = path.parents[node.level - 1]
                target = base.joinpath(*node.module.split(".")) if node.module else base
                folder = target if target.is_dir() else target.parent
                if folder.resolve() not in {f.resolve() for f in shipped}:
                    unshipped.append(f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno} imports from {folder.name}/")
    assert not unshipped, unshipped


def test_triton_is_imported_only_by_the_backend_inside_a_try():
    """transformers' remote-code loader refuses a file whose top-level imports name a package that is not installed
    unless they sit in a ``try``; CPU machines have no Triton, so only kernels/backend.py imports it, guarded."""
    importers = {}
    for path in _package_sources():
        tree = ast.parse(path.read_text())
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for b in t.body for n in ast.walk(b)}
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "triton" or n.startswith("triton.") for n in names):
                importers.setdefault(str(path.relative_to(PACKAGE_ROOT)), []).append(id(node) in guarded)
    assert importers == {os.path.join("kernels", "backend.py"): [True, True, True]}  # triton, its language, gdc


def test_relative_imports_take_names_from_modules():
    """Every relative import reads ``from .module import names`` with names that are not modules (no
    ``from . import submodule``): the form transformers' remote-code loader follows, file by file."""
    offenders = []
    for path in _package_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split(".")) if node.module else base
            for alias in node.names:
                if node.module is None or (target / f"{alias.name}.py").exists() or (target / alias.name).is_dir():
                    offenders.append(f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno} imports {alias.name}")
    assert not offenders


def test_kernels_folder_is_a_namespace_portion():
    """No kernels/__init__.py: a Python started in the checkout root finds Hugging Face's installed ``kernels``
    package, not this folder (tests/test_checkout_root.py runs that case)."""
    assert (PACKAGE_ROOT / "kernels" / "backend.py").exists()
    assert not (PACKAGE_ROOT / "kernels" / "__init__.py").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_picks_triton_for_inputs_the_kernels_take():
    x = torch.randn(2, device="cuda")
    assert resolve_backend("auto", x) == "triton"
    assert resolve_backend("auto", x, supported=False) == "torch"  # inputs the kernel does not take
    assert resolve_backend("triton", x, supported=False) == "triton"  # explicit: the kernel raises
    assert resolve_backend("auto", x, torch.randn(2)) == "torch"  # mixed devices stay on torch
