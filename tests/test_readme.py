"""The README's recipes run as written, each in a fresh interpreter."""

import pathlib
import re

import pytest

from tests.helpers.processes import run_python

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
def test_recipe_runs(title, code):
    run_python(code, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
