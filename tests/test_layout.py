"""The package's layout, as docs/ARCHITECTURE.md describes it.

Read from the source files (no TensorFlow needed): imports between the
package's modules run one way, and every module but the public ones is
private.
"""

from __future__ import annotations

import ast
import pathlib

import gradaccum

SOURCE = pathlib.Path(gradaccum.__file__).parent
PUBLIC_MODULES = {"gradaccum", "gradaccum.callbacks", "gradaccum.demo", "gradaccum.layers"}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in SOURCE.rglob("*.py"):
        parts = ("gradaccum",) + path.relative_to(SOURCE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _import_graph() -> dict[str, set[str]]:
    """Module-level imports between the package's modules.

    `from gradaccum import _x` is an import of the module `gradaccum._x`
    (the package itself is initialised first in any case).
    """
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module.split(".")[0] != "gradaccum":
                continue
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            targets = [m for m in submodules if m in modules] or [node.module]
            graph[name].update(t for t in targets if t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_cycle_detection_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_imports_between_modules_run_one_way():
    assert _cycles(_import_graph()) == []


def test_lower_layers_do_not_import_upper_ones():
    graph = _import_graph()
    # The backend and the patches are the bottom: they know no accumulation.
    bottom = [m for m in graph if m.startswith("gradaccum._backend") or m == "gradaccum._patches"]
    for module in bottom:
        above = {m for m in graph[module] if not (m.startswith("gradaccum._backend") or m == "gradaccum._patches")}
        assert not above, (module, above)
    # Optimizer families know nothing of the proxy, the state or the cycle.
    for module in ("gradaccum._family", "gradaccum._keras3", "gradaccum._tf_keras", "gradaccum._families"):
        above = {m for m in graph[module] if not m.startswith("gradaccum._backend")}
        assert above <= {"gradaccum._family", "gradaccum._keras3"}, (module, graph[module])


def test_the_cores_of_the_backends_stand_apart():
    """The JAX/PyTorch core imports nothing of TensorFlow's, and the
    modules every backend imports do not import the TensorFlow core."""
    graph = _import_graph()
    tensorflow_core = {
        "gradaccum._accumulation", "gradaccum._state", "gradaccum._strategies",
        "gradaccum._tf_keras",
    }
    for module in graph:
        if module.startswith("gradaccum._portable"):
            assert not graph[module] & tensorflow_core, module
            assert not any(m.startswith("gradaccum._backend.tensorflow") for m in graph[module]), module
    shared = ("gradaccum", "gradaccum._proxy", "gradaccum._api", "gradaccum._engines",
              "gradaccum._loss_scale", "gradaccum._loss_counts", "gradaccum._batch_norm",
              "gradaccum._accumulation_base")
    for module in shared:
        assert not graph[module] & tensorflow_core, (module, graph[module])


def test_no_module_imports_tensorflow_at_import_time_but_the_tensorflow_core():
    """`import gradaccum` must work where TensorFlow is not installed: only
    the TensorFlow core and tf_keras support import it at module level."""
    allowed = {
        "gradaccum._accumulation", "gradaccum._state", "gradaccum._strategies",
        "gradaccum._tf_keras",
    }
    for name, path in _modules().items():
        if name in allowed or name.startswith("gradaccum._backend.tensorflow"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert not roots & {"tensorflow", "tf_keras"}, name


def test_implementation_modules_are_private():
    for name in _modules():
        if name in PUBLIC_MODULES:
            continue
        leaf = name.split(".")[1]
        assert leaf.startswith("_"), name


def test_public_names():
    assert sorted(gradaccum.__all__) == [
        "AccumulatingOptimizer",
        "AccumulationState",
        "accumulate",
        "accumulating",
        "callbacks",
        "layers",
    ]
    for name in gradaccum.__all__:
        assert getattr(gradaccum, name) is not None
