"""Self-contained checkpoints: the flattening of the package source (`kda_moe.remote_code`) on small fixture packages."""

import sys
import textwrap
from pathlib import Path, PurePosixPath

import pytest
from transformers.dynamic_module_utils import get_relative_imports

from kda_moe.remote_code import RemoteCodeError, flat_module_name, flatten_package


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
