"""The README's Python snippets run, in order, as a reader would paste them (one interpreter, a fresh folder)."""

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_snippets_run_in_order(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 5, "the quick tour's snippets are missing from README.md"
    script = "\n".join(
        f"print('== README snippet {i}', flush=True)\nexec(compile({block!r}, 'README snippet {i}', 'exec'))"
        for i, block in enumerate(blocks)
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"== README snippet {len(blocks) - 1}" in result.stdout
