"""The all-reduces of an optimized HLO module (JAX's compiled text).

Shared by the test that a cycle exchanges gradients once
(`tests/distribution/test_data_parallel_local.py`) and the benchmark that
counts the bytes exchanged (`benchmarks/jax_collectives.py`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_ARRAY = re.compile(r"\b([a-z]+)(\d*)\[([\d,]*)\]")
# Bytes per element of a type written without its width.
_BYTES = {"pred": 1}


class AllReduce(NamedTuple):
    elements: int
    bytes: int


def _array(kind: str, bits: str, dims: str) -> AllReduce:
    elements = int(np.prod([int(d) for d in dims.split(",") if d]))
    return AllReduce(elements, elements * (int(bits) // 8 if bits else _BYTES.get(kind, 4)))


def all_reduces(hlo: str) -> dict[str, list[AllReduce]]:
    """Each all-reduce's size, `"outside"` and `"inside"` conditional
    branches (where the update of a cycle's last micro-step runs)."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        found = _COMPUTATION.match(line)
        if found:
            name = found.group(1)
            computations[name] = []
        elif name is not None:
            computations[name].append(line)
    branches = set()
    for lines in computations.values():
        for line in lines:
            for names in re.findall(r"branch_computations=\{([^}]*)\}", line):
                branches.update(n.strip().lstrip("%") for n in names.split(","))
    found: dict[str, list[AllReduce]] = {"outside": [], "inside": []}
    for name, lines in computations.items():
        for line in lines:
            if " all-reduce(" not in line:
                continue
            result = line.split("=", 1)[1].split("all-reduce(")[0]
            arrays = [_array(*a) for a in _ARRAY.findall(result)]
            found["inside" if name in branches else "outside"].append(
                AllReduce(sum(a.elements for a in arrays), sum(a.bytes for a in arrays))
            )
    return found
