"""README, code and tests describe the package as it is: no development diary, and no pointer to files a user's
clone does not have. The measured history belongs in benchmarks/PERFORMANCE.md (a changelog keyed by date and
commit) and in commit messages."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Session labels of the development log (the word "stop" or "run" followed by a session number or letter), and the
# design documents kept outside the repository.
DIARY = re.compile(r"\bstop [0-9]+|\brun [A-Z][0-9]*\b", re.IGNORECASE)
OUTSIDE_FILES = re.compile(r"\bSPEC\.md\b|\bSTYLE\.md\b|\.\./shared\b")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".jinja", ".ini", ".cfg", ".txt", ""}


def tracked_text_files() -> list[Path]:
    """The repository's text files outside benchmarks/ (whose PERFORMANCE.md and result files are the history)."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    files = [ROOT / name for name in names.splitlines() if not name.startswith("benchmarks/")]
    files += [path for path in (ROOT / "benchmarks").glob("*.py")]
    return [path for path in files if path.suffix in TEXT_SUFFIXES and path.is_file()]


@pytest.mark.parametrize("pattern", [DIARY, OUTSIDE_FILES], ids=["no-development-diary", "no-outside-files"])
def test_readme_code_and_tests_hold_no_development_history_or_outside_references(pattern):
    hits = []
    for path in tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)
