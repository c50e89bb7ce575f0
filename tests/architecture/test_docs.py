"""The documentation's code runs as written: every fenced ```python block of
README.md and of the pages under docs/, each in a fresh interpreter.

A block runs on the Keras backend it sets (`os.environ["KERAS_BACKEND"] =
...`), TensorFlow otherwise, in the environment whose backend that is: the
`keras3` environment runs the TensorFlow blocks, `keras3-jax` and
`keras3-torch` the others (this file's name has no backend's suffix, so all
three collect it). Blocks for a backend not active here are skipped with that reason.

An HTML comment on the line before a fence (invisible on GitHub and on the
site) changes how a block runs:

- `<!-- test: setup -->` runs `SETUP` first: NumPy data `x`, `y` (256
  samples) and a small regression `model`, not compiled; for snippets that
  start from "your model and data".
- `<!-- test: skip: why -->` does not run the block. `NOT_RUN` lists every
  such block, so the list stays short and deliberate.

The selected blocks start together, as many at a time as there are CPUs
(each is mostly an interpreter importing its backend); each test waits for
its own.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import keras
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

SETUP = """\
import numpy as np
import keras

_rng = np.random.default_rng(0)
x = _rng.normal(size=(256, 5)).astype("float32")
y = (x @ _rng.normal(size=(5, 1))).astype("float32")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
"""

# Every block marked `skip`, by page and the first words of its reason: a
# new skip must be added here on purpose.
NOT_RUN = {
    ("docs/guides/distribution.md", "needs two worker processes"),
}

_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!--\s*test:\s*(setup|skip:\s*(.*?))\s*-->\s*$")
_BACKEND = re.compile(r"""os\.environ\[["']KERAS_BACKEND["']\]\s*=\s*["'](\w+)["']""")


class Block(NamedTuple):
    page: str  # relative to the repository root
    line: int  # of the opening fence
    code: str
    backend: str
    setup: bool
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    blocks = []
    for path in PAGES:
        text = path.read_text()
        for match in _FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = _MARK.search(before)
            code = match.group(1)
            backend = _BACKEND.search(code)
            blocks.append(Block(
                page=str(path.relative_to(ROOT)),
                line=line,
                code=code,
                backend=backend.group(1) if backend else "tensorflow",
                setup=bool(mark) and mark.group(1) == "setup",
                skip=mark.group(2) if mark and mark.group(2) is not None else None,
            ))
    return blocks


BLOCKS = _blocks()
ACTIVE = keras.config.backend()


def test_the_pages_have_code_to_run():
    assert len(BLOCKS) >= 20, [b.id for b in BLOCKS]
    assert {b.backend for b in BLOCKS} == {"tensorflow", "jax", "torch"}


def test_only_the_listed_blocks_are_skipped():
    skipped = {(b.page, b.skip) for b in BLOCKS if b.skip is not None}
    assert {(page, reason.split(" (")[0].rstrip(".")) for page, reason in skipped} == NOT_RUN


def _runnable_here(block: Block) -> str | None:
    """Why `block` does not run here, or None."""
    if block.skip is not None:
        return f"marked not runnable: {block.skip}"
    if block.backend != ACTIVE:
        return f"a {block.backend} block: runs where {block.backend} is the Keras backend"
    return None


def _run(block: Block, directory: pathlib.Path) -> subprocess.CompletedProcess:
    directory.mkdir(parents=True)
    script = directory / "block.py"
    script.write_text((SETUP if block.setup else "") + block.code)
    env = dict(os.environ, KERAS_BACKEND=block.backend, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=directory
    )


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected blocks that run here, started together: id -> future."""
    selected = [
        item.callspec.params["block"]
        for item in request.session.items
        if item.originalname == "test_block_runs" and item.module is request.module
    ]
    root = tmp_path_factory.mktemp("docs")
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = {
            b.id: pool.submit(_run, b, root / f"{i}") for i, b in enumerate(selected) if _runnable_here(b) is None
        }
        yield futures
        for future in futures.values():
            future.cancel()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs(block, runs):
    reason = _runnable_here(block)
    if reason is not None:
        pytest.skip(reason)
    if importlib.util.find_spec(block.backend) is None:  # pragma: no cover - a broken environment
        pytest.fail(f"{block.backend} is the active backend but is not installed")
    result = runs[block.id].result()
    assert result.returncode == 0, f"{block.id}\n{result.stderr[-4000:]}"
