"""A Python started in the checkout root (which puts the root on sys.path) imports transformers and kda_moe and runs
a model, whether or not Hugging Face's ``kernels`` package is installed: our top-level folders shadow nothing.

The root is the kda_moe package itself, so its folders (``kernels/``, ``configuration/``, ...) are importable there
as top-level names. ``kernels/`` has no ``__init__.py``: a namespace portion loses to an installed regular package
of that name, and transformers reads a namespace package without a version as "not installed".
"""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("kernels", "configuration", "modeling", "processing", "model_cards", "examples", "benchmarks", "tests",
             "compat")

# Makes the installed `kernels` distribution invisible to imports and to importlib.metadata, as if it were not
# installed; the checkout's `kernels/` folder stays findable on sys.path.
HIDE_HUB_KERNELS = '''
import importlib.machinery, importlib.metadata, os, sys

_hub_kernels = os.path.dirname(str(importlib.metadata.distribution("kernels").locate_file("kernels")))


class _HideHubKernels:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name != "kernels":
            return None
        entries = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.realpath(_hub_kernels)]
        spec = importlib.machinery.PathFinder.find_spec(name, entries)
        if spec is None:
            raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
        return spec


_find_distributions = importlib.machinery.PathFinder.find_distributions
importlib.machinery.PathFinder.find_distributions = staticmethod(
    lambda *args, **kwargs: (d for d in _find_distributions(*args, **kwargs) if d.metadata["Name"] != "kernels")
)
sys.meta_path.insert(0, _HideHubKernels)
'''

IMPORT_AND_RUN = '''
import json, sys
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils.import_utils import is_kernels_available
import accelerate, huggingface_hub, safetensors
import kda_moe

config = AutoConfig.for_model("kda_moe_text", vocab_size=64)  # the defaults: a small model
model = AutoModelForCausalLM.from_config(config).eval()
with torch.no_grad():
    logits = model(torch.randint(0, 64, (1, 5))).logits
assert logits.shape == (1, 5, 64) and torch.isfinite(logits).all()
shadowed = {}
for name in %(top_level)r:
    module = sys.modules.get(name)
    if module is not None:
        shadowed[name] = getattr(module, "__file__", None) or list(getattr(module, "__path__", []))
print("kernels available:", is_kernels_available())
print("top-level modules:", json.dumps(shadowed))
'''


def run_in_checkout_root(prelude: str = "") -> str:
    code = prelude + IMPORT_AND_RUN % {"top_level": TOP_LEVEL}
    out = subprocess.run([sys.executable, "-c", code], cwd=CHECKOUT, capture_output=True, text=True, timeout=600,
                         env={n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"})
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def hub_kernels_installed() -> bool:
    try:
        importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def loaded_from_checkout(stdout: str) -> list[str]:
    """The top-level modules that the child loaded from the checkout (named in its last line)."""
    shadowed = json.loads(stdout.strip().splitlines()[-1].split(":", 1)[1])
    return [name for name, where in shadowed.items() if str(CHECKOUT) in str(where)]


@pytest.mark.parametrize("hub_kernels", ["installed", "absent"])
def test_python_started_in_the_checkout_root_imports_transformers_and_runs_a_model(hub_kernels):
    """Where Hugging Face's ``kernels`` is installed, ``kernels`` is that package and nothing is loaded from the
    checkout's top-level folders. Where it is absent (hidden here if installed), ``kernels`` resolves to the
    checkout's folder at most, which transformers reads as "not installed" and never imports from."""
    installed = hub_kernels_installed()
    if hub_kernels == "installed" and not installed:
        pytest.skip("Hugging Face's kernels package is not installed")
    out = run_in_checkout_root(HIDE_HUB_KERNELS if hub_kernels == "absent" and installed else "")
    if hub_kernels == "installed":
        assert loaded_from_checkout(out) == [], out
    else:
        assert "kernels available: False" in out and set(loaded_from_checkout(out)) <= {"kernels"}, out
