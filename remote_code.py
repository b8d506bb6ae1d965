r"""Self-contained checkpoints: the package source a saved folder needs, flattened into the folder.

`save_pretrained` of our models and processors calls `write_remote_code(folder, {"AutoConfig": KdaMoeTextConfig, ...})`:
it writes the modules that define those classes, and every module they reach through relative imports, into the
folder and returns the `auto_map` that names them. `Auto*.from_pretrained(folder, trust_remote_code=True)` then loads
the folder, or its copy on the Hub, where transformers and torch are installed and kda_moe is not.

The files follow the rules of transformers' remote-code loader (`transformers.dynamic_module_utils`):
- it imports the files of one folder as one package, so each relative import becomes `from .<flat name> import names`,
  and the names must not be modules (`from . import chunk` has no flat form);
- it finds a file's dependencies with the regex `^\s*from\s+\.(\S+)\s+import`, so a relative import must start its
  line, and no other line may match (a docstring line reading like one would send the loader after a missing file);
- it copies only the `.py` files found that way: code reached this way must not need the package's data files;
- for a Hub repository it runs `check_imports` on every file: absolute imports outside `try` blocks must be installed
  where the folder is loaded (an optional dependency such as triton is imported in a `try` block).

A module's flat name is its path below the package root joined with `_`, leaving out each folder that the name already
contains: `kernels/kda/chunk_fwd.py` -> `kernels_kda_chunk_fwd`, `modeling/modeling_kda_moe.py` -> `modeling_kda_moe`,
`processing/image_processing_kda_moe.py` -> `image_processing_kda_moe`; a package's `__init__.py` takes the package's
name (`configuration/__init__.py` -> `configuration`). Only the header of each relative import (`from ..x.y import`)
is rewritten; every other byte of the source is kept. Code that runs from such a folder (a model loaded with
`trust_remote_code=True` and saved again) finds its modules flat already: they keep their names and are written again.
"""

import ast
import inspect
import re
from pathlib import Path, PurePosixPath

PACKAGE_ROOT = Path(__file__).resolve().parent
# Absolute imports of this package would need it installed where the folder is loaded.
PACKAGE_NAME = __name__.rpartition(".")[0]
# How transformers' `get_relative_imports` reads a module's relative imports.
LOADER_IMPORT_PATTERNS = (r"^\s*import\s+\.(\S+)\s*$", r"^\s*from\s+\.(\S+)\s+import")
# The header of a relative import: `from`, the dots and dotted name (whitespace and line continuations allowed), `import`.
_IMPORT_HEADER = re.compile(r"from\b((?:\s|\\\r?\n|[.\w])*?)(?<!\w)import\b")


class RemoteCodeError(ValueError):
    """The package source cannot be written as a flat remote-code folder (the message names the file, line and fix)."""


def flat_module_name(path: PurePosixPath) -> str:
    """The flat module name of the module file `path` (relative to the package root)."""
    folders = path.parent.parts
    if path.name == "__init__.py":
        folders, name = folders[:-1], path.parent.name
    else:
        name = path.stem
    for folder in reversed(folders):
        if f"_{folder}_" not in f"_{name}_":
            name = f"{folder}_{name}"
    return name


def _module_path(root: Path, parts: tuple[str, ...]) -> PurePosixPath | None:
    """The file of module `parts` below `root` (`a/b.py` or `a/b/__init__.py`), None if there is none."""
    path = PurePosixPath(*parts)
    if (root / f"{path}.py").is_file():
        return PurePosixPath(f"{path}.py")
    if (root / path / "__init__.py").is_file():
        return path / "__init__.py"
    return None


def _import_target(root: Path, path: PurePosixPath, node: ast.ImportFrom) -> PurePosixPath:
    """The module file a relative `from ... import ...` in module `path` reads its names from; raises for the forms
    a flat folder cannot express."""
    statement = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
    where = f"{path}, line {node.lineno}: `{statement}`"
    package = path.parent.parts
    kept = len(package) - (node.level - 1)
    if kept < 0:
        raise RemoteCodeError(f"{where} reaches above the package root.")
    parts = package[:kept] + tuple(node.module.split(".") if node.module else ())
    for alias in node.names:
        if alias.name == "*":
            raise RemoteCodeError(f"{where}: a star import; name the imported names.")
        if _module_path(root, (*parts, alias.name)) is not None:
            raise RemoteCodeError(
                f"{where} imports the module {alias.name!r}, which a flat folder cannot express; import the names "
                f"it needs from it (`from {'.' * node.level}{(node.module + '.') if node.module else ''}{alias.name} "
                "import name`)."
            )
    if not parts:
        raise RemoteCodeError(f"{where} imports from the package root; import the names from the module defining them.")
    target = _module_path(root, parts)
    if target is None:
        folder = root / PurePosixPath(*parts)
        reason = "is a folder without `__init__.py`" if folder.is_dir() else "does not exist"
        raise RemoteCodeError(
            f"{where}: the module {'/'.join(parts)} {reason}; import the names from a module file "
            f"(`from {'.' * node.level}{node.module or ''}.<module> import name`)."
        )
    return target


def _own_package_import(node: ast.AST) -> str | None:
    """The module an absolute import of this package names (`import kda_moe.x`, `from kda_moe import y`), else None."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [node.module]
    else:
        return None
    return next((name for name in names if name.split(".")[0] == PACKAGE_NAME), None)


def _flatten_module(root: Path, path: PurePosixPath) -> tuple[str, list[PurePosixPath]]:
    """The source of module `path` with its relative imports rewritten to flat names, and the modules they name."""
    source = (root / path).read_bytes().decode("utf-8")
    tree = ast.parse(source, filename=str(path))
    line_starts = [0] + [match.end() for match in re.finditer("\n", source)]
    edits, targets, flat_names = [], [], set()
    for node in ast.walk(tree):
        if (module := _own_package_import(node)) is not None:
            raise RemoteCodeError(
                f"{path}, line {node.lineno} imports {module!r} absolutely; a folder loaded without {PACKAGE_NAME} "
                "installed cannot run it. Use a relative import."
            )
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        target = _import_target(root, path, node)
        start = line_starts[node.lineno - 1]
        indent = source[start : start + node.col_offset]  # whitespace when the import starts its line
        header = None if indent.strip() else _IMPORT_HEADER.match(source, start + node.col_offset)
        written = re.sub(r"[\s\\]", "", header.group(1)) if header else None
        if written != "." * node.level + (node.module or ""):
            raise RemoteCodeError(
                f"{path}, line {node.lineno}: a relative import must start its line as `from .module import names` "
                "(transformers' loader finds imports line by line)."
            )
        flat = flat_module_name(target)
        edits.append((header.start(), header.end(), f"from .{flat} import"))
        targets.append(target)
        flat_names.add(flat)
    for begin, end, text in sorted(edits, reverse=True):
        source = source[:begin] + text + source[end:]
    seen_by_loader = {name for pattern in LOADER_IMPORT_PATTERNS for name in re.findall(pattern, source, re.MULTILINE)}
    if seen_by_loader != flat_names:
        raise RemoteCodeError(
            f"{path}: transformers' loader would read the relative imports {sorted(seen_by_loader)} from the flattened "
            f"file, which imports {sorted(flat_names)}; reword the lines that read like a relative import (e.g. in a "
            "docstring) so that they do not start with `from .`."
        )
    return source, targets


def flatten_package(root: Path, entries: list[PurePosixPath]) -> dict[str, str]:
    """{flat name: flattened source} of the modules `entries` (files below `root`) and of every module they reach
    through relative imports, imports inside functions included."""
    root = Path(root)
    sources: dict[str, str] = {}
    origins: dict[str, PurePosixPath] = {}
    pending = sorted(set(entries))
    while pending:
        path = pending.pop(0)
        if path.parts == ("__init__.py",):
            raise RemoteCodeError("The package root's `__init__.py` cannot be written as remote code.")
        flat = flat_module_name(path)
        if flat in origins:
            if origins[flat] != path:
                raise RemoteCodeError(f"{origins[flat]} and {path} both flatten to {flat}.py; rename one of them.")
            continue
        origins[flat] = path
        sources[flat], targets = _flatten_module(root, path)
        pending.extend(sorted(set(targets)))
    return dict(sorted(sources.items()))


def _package_path(cls: type) -> PurePosixPath:
    """The file defining `cls`, relative to the package root."""
    file = Path(inspect.getfile(cls)).resolve()
    if not file.is_relative_to(PACKAGE_ROOT):
        raise RemoteCodeError(f"{cls.__qualname__} is defined in {file}, outside {PACKAGE_ROOT}; it cannot be bundled.")
    return PurePosixPath(file.relative_to(PACKAGE_ROOT).as_posix())


def write_remote_code(save_directory, auto_classes: dict[str, type]) -> dict[str, str]:
    """Write the flattened source of `auto_classes` ({"AutoConfig": KdaMoeTextConfig, ...}) into `save_directory`
    and return the folder's `auto_map` ({"AutoConfig": "configuration_kda_moe.KdaMoeTextConfig", ...})."""
    paths = {auto_name: _package_path(cls) for auto_name, cls in auto_classes.items()}
    sources = flatten_package(PACKAGE_ROOT, list(paths.values()))
    folder = Path(save_directory)
    folder.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        (folder / f"{name}.py").write_bytes(source.encode("utf-8"))
    return {auto_name: f"{flat_module_name(paths[auto_name])}.{cls.__name__}" for auto_name, cls in auto_classes.items()}


__all__ = ["write_remote_code", "flatten_package", "flat_module_name", "RemoteCodeError"]
