"""The package's layout, as docs/ARCHITECTURE.md describes it.

Read from the source files (no TensorFlow needed): imports between the
package's modules run one way, and every module but the public ones is
private.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

import gradaccum

SOURCE = pathlib.Path(gradaccum.__file__).parent
PUBLIC_MODULES = {"gradaccum", "gradaccum.callbacks", "gradaccum.demo", "gradaccum.layers", "gradaccum.schedules"}


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


def test_one_core_for_every_backend():
    """Only the backend package chooses a backend's hooks: every module
    above it (the core, the state, persistence, the proxy) is written once,
    for every backend."""
    graph = _import_graph()
    hooks = {m for m in graph if m.startswith("gradaccum._backend.")}
    for module, imported in graph.items():
        # tf_keras's optimizer families run on TensorFlow only.
        if module.startswith("gradaccum._backend") or module == "gradaccum._tf_keras":
            continue
        assert not imported & hooks, (module, imported & hooks)


def test_no_module_imports_tensorflow_at_import_time_but_the_tensorflow_hooks():
    """`import gradaccum` must work where TensorFlow is not installed: only
    the TensorFlow hooks and tf_keras support import it at module level."""
    for name, path in _modules().items():
        if name == "gradaccum._tf_keras" or name.startswith("gradaccum._backend.tensorflow"):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert not roots & {"tensorflow", "tf_keras"}, name


# The modules that may import TensorFlow (or the TensorFlow hooks) anywhere,
# also inside a function: the backend package, tf_keras's optimizer
# families and TensorFlow checkpoints. Keras 3's optimizer family asks the
# backend (`Replicas`) for strategies, TensorFlow variables and masked updates.
TENSORFLOW_MODULES = ("gradaccum._backend", "gradaccum._tf_keras", "gradaccum._persistence.checkpoint")


def _tensorflow_imports(tree: ast.AST) -> list[int]:
    """The lines of every import of TensorFlow, tf_keras or the TensorFlow
    hooks in `tree`, at any depth (in functions, under `TYPE_CHECKING`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        if any(n.split(".")[0] in ("tensorflow", "tf_keras") or n.startswith("gradaccum._backend.tensorflow")
               for n in names):
            lines.append(node.lineno)
    return lines


def test_tensorflow_imports_are_found_at_any_depth():
    source = "import typing\nif typing.TYPE_CHECKING:\n    import tensorflow as tf\ndef f():\n" \
             "    from gradaccum._backend.tensorflow import kept\n    import keras\n"
    assert _tensorflow_imports(ast.parse(source)) == [3, 5]


def test_only_the_tensorflow_modules_import_tensorflow():
    """Every other module asks the backend's hooks (`gradaccum._backend`)
    for what TensorFlow does differently, so it runs unchanged on JAX and
    PyTorch."""
    for name, path in _modules().items():
        if name in TENSORFLOW_MODULES or name.startswith("gradaccum._backend."):
            continue
        found = _tensorflow_imports(ast.parse(path.read_text()))
        assert not found, (name, found)


def test_only_the_backends_know_where_the_cycle_position_is_kept():
    """The core asks the cycle's position (`gradaccum._backend.position`)
    one way on every backend: whether it is kept on the host is the
    backend's to know."""
    for name, path in _modules().items():
        if name.startswith("gradaccum._backend"):
            continue
        nodes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Name, ast.Attribute))]
        names = {n.id if isinstance(n, ast.Name) else n.attr for n in nodes}
        host = sorted(n for n in names if n.startswith("host_"))
        assert not host, (name, host)


def test_the_modules_above_probe_no_backend_hook():
    """What the modules above `_backend` ask a backend is declared (on
    `Backend` or one of its groups), never probed with `getattr`."""
    for name, path in _modules().items():
        if name.startswith("gradaccum._backend"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            target = node.args[0]
            probed = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
            assert not (node.func.id in ("getattr", "hasattr") and probed.endswith("backend")), (name, node.lineno)


def _declared_methods(module: pathlib.Path, protocol: str) -> list[str]:
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == protocol:
            return [f.name for f in node.body if isinstance(f, ast.FunctionDef)]
    raise AssertionError(f"{protocol} not found in {module}")


def test_the_backend_seam_stays_narrow():
    """`Backend` declares at most 20 methods: the tensor work, distribution
    and gradients are groups of their own (`Tensors`, `Replicas`,
    `Gradients`), and kept slices an optional protocol (`KeptSlices`)."""
    seam = SOURCE / "_backend" / "__init__.py"
    declared = _declared_methods(seam, "Backend")
    assert len(declared) <= 20, declared
    for group in ("Tensors", "Replicas", "Gradients", "KeptSlices"):
        assert not set(_declared_methods(seam, group)) & set(declared), group


def test_modules_and_classes_stay_small():
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        lines = len(path.read_text().splitlines())
        assert lines <= 400, (name, lines)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= 300, (name, node.name, size)


def test_importing_patches_nothing():
    """Importing gradaccum changes nothing in Keras; the first accumulating
    optimizer installs `ACCUMULATE`, importing `gradaccum.layers` `LAYERS`."""
    script = textwrap.dedent(
        """
        import keras
        from gradaccum import _patches

        backend = keras.config.backend()
        accumulate_specs = _patches.for_backend(_patches.ACCUMULATE, backend)
        layers_specs = _patches.for_backend(_patches.LAYERS, backend)

        def current():
            return [
                _patches._resolve(spec.target).__dict__.get(spec.name)
                for spec in accumulate_specs + layers_specs
            ]

        before = current()
        import gradaccum
        assert current() == before
        gradaccum.accumulate(keras.optimizers.SGD(), 2)
        after = current()
        accumulate_count = len(accumulate_specs)
        assert all(a is not b for a, b in zip(after[:accumulate_count], before)), "accumulate"
        assert after[accumulate_count:] == before[accumulate_count:]
        import gradaccum.layers  # noqa: F401
        assert all(a is not b for a, b in zip(current(), before)), "layers"
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_the_public_type_names_itself():
    import keras

    plain = gradaccum.accumulate(keras.optimizers.SGD(), 2)
    scaled = gradaccum.accumulate(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), 2)
    for opt in (plain, scaled):
        assert type(opt).__name__ == "AccumulatingOptimizer"
        assert type(opt) is gradaccum.AccumulatingOptimizer
        with pytest.raises(AttributeError, match="'AccumulatingOptimizer' object"):
            opt.reduction = "sum"


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
        "schedules",
    ]
    for name in gradaccum.__all__:
        assert getattr(gradaccum, name) is not None
