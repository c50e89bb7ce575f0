"""The README's recipes run as written, each in a fresh interpreter."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _recipes():
    text = README.read_text()
    section = text.split("## Recipes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"### (.+?)\n(.*?)```python\n(.*?)```", section, flags=re.S)
    return [(title.strip(), code) for title, _, code in blocks]


def test_readme_has_the_recipes():
    titles = [t for t, _ in _recipes()]
    for wanted in ("model.fit", "Custom training loop", "Mixed precision",
                   "MirroredStrategy", "Third-party training code", "Resuming",
                   "Token-level losses"):
        assert any(wanted in t for t in titles), (wanted, titles)


@pytest.mark.parametrize("title, code", _recipes(), ids=[t for t, _ in _recipes()])
def test_recipe_runs(title, code, tmp_path):
    script = tmp_path / "recipe.py"
    script.write_text(code)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
