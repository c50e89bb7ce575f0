"""`sparse="auto"` (the default) against the large batch, across drawn lookup
structures.

A drawn model looks up one or two `Embedding` tables with ids built in
several ways, mixed in one model and sharing tables: the batch's ids, the
batch's ids gathered or reshaped, ids mapped through a constant table,
`arange`, `tile`, `broadcast_to`, `zeros_like`, constants, and gathered or
reshaped ranges. `accumulate(Adam, n)` on micro-batches of `B` must end where
plain Adam on batches of `B * n` does (weights, every optimizer variable,
`iterations`), from the same weights on the same data, in `fit`'s
`tf.function` and under XLA (`jit_compile=True`). Adam's second moment sees
each slice's square, so a lookup kept in the other kind than the large
batch's moves the weights by about the learning rate.

A constant spread over a first dimension of the micro-batch's size, but not
over a whole input's shape, may or may not be the batch's (a row of one
constant id as long as the micro-batch, `[1]` with micro-batches of 1; see
docs/guides/sparse.md): there the default must be exact or warn, naming the
variable.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
from hypothesis import example, given
from hypothesis import strategies as st
from keras import ops

from gradaccum import accumulate
from property_tests.harness import scaled
from tests.helpers import assert_states_close, fit, full_state

LENGTH, DIM, VOCAB = 3, 2, 6
# A constant permutation of the positions, and a constant table of ids.
_ORDER = np.array([2, 0, 1], "int32")
_TABLE = np.array([5, 4, 3, 3, 1, 0], "int32")


def _ids(how: str, tokens):
    """Ids for one lookup: `(B, L)`, `(L,)`, `(1, L)`, `(1,)` or `(B * L,)`."""
    batch = ops.shape(tokens)[0]
    positions = ops.arange(LENGTH, dtype="int32")
    return {
        "batch": lambda: tokens,
        "arange": lambda: positions,
        "tile": lambda: ops.tile(ops.expand_dims(positions, 0), [batch, 1]),
        "broadcast_to": lambda: ops.broadcast_to(positions, ops.shape(tokens)),
        "zeros_like": lambda: ops.zeros_like(tokens),
        "constant": lambda: ops.convert_to_tensor(np.array([1], "int32")),
        "constant_row": lambda: ops.full((LENGTH,), 1, dtype="int32"),
        "constant_table": lambda: ops.convert_to_tensor(_ORDER),
        "gathered_batch": lambda: ops.take(tokens, _ORDER, axis=1),
        "gathered_through_table": lambda: ops.take(ops.convert_to_tensor(_TABLE), tokens),
        "gathered_positions": lambda: ops.take(positions, _ORDER),
        "reshaped_batch": lambda: ops.reshape(tokens, (-1,)),
        "reshaped_positions": lambda: ops.reshape(positions, (1, LENGTH)),
    }[how]()


STRUCTURES = ("batch", "arange", "tile", "broadcast_to", "zeros_like", "constant", "constant_row", "constant_table",
              "gathered_batch", "gathered_through_table", "gathered_positions", "reshaped_batch",
              "reshaped_positions")


class Lookups(keras.layers.Layer):
    """The sum of the drawn lookups, each `(structure, table)`, as `(B, L, DIM)`."""

    def __init__(self, lookups, tables, **kwargs):
        super().__init__(**kwargs)
        self.lookups = lookups
        self.tables = [keras.layers.Embedding(VOCAB, DIM, name=f"table{k}") for k in range(tables)]

    def build(self, input_shape):
        for table in self.tables:
            table.build((1,))

    def call(self, tokens):
        h = ops.zeros(ops.shape(tokens) + (DIM,))
        for how, table in self.lookups:
            looked_up = self.tables[table](_ids(how, tokens))
            if how == "reshaped_batch":
                looked_up = ops.reshape(looked_up, ops.shape(h))
            h = h + looked_up
        return h


def _model(lookups, tables):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((LENGTH,), dtype="int32")
    h = Lookups(lookups, tables, name="lookups")(tokens)
    out = keras.layers.Dense(2, name="out")(keras.layers.Flatten()(h))
    return keras.Model(tokens, out, name="lookups_model")


@st.composite
def lookup_models(draw):
    """`(lookups, tables)`: one to four lookups over one or two tables."""
    tables = draw(st.integers(1, 2))
    lookups = draw(st.lists(st.tuples(st.sampled_from(STRUCTURES), st.integers(0, tables - 1)),
                            min_size=1, max_size=4))
    # Every table looked up, so that every variable has a gradient.
    tables = len({table for _, table in lookups})
    names = sorted({table for _, table in lookups})
    return tuple((how, names.index(table)) for how, table in lookups), tables


@scaled(6)
@given(model=lookup_models(), n=st.integers(2, 3), micro_batch=st.integers(1, 3), seed=st.integers(0, 2**16))
# Found by this property: a row of one constant id, as long as the
# micro-batch (3), read as ids spread over the batch and kept apart, silently.
# Its length alone cannot tell it from the batch's: now it warns.
@example(model=((("constant_row", 0), ("batch", 0)), 1), n=2, micro_batch=3, seed=0)
# Segment ids from `zeros_like(tokens)` at a micro-batch of 1 fill the
# tokens' whole shape: the batch's, exact and not warned.
@example(model=((("zeros_like", 0), ("arange", 0)), 1), n=2, micro_batch=1, seed=0)
def test_the_default_equals_the_large_batch_for_any_mix_of_lookups(model, n, micro_batch, seed):
    lookups, tables = model
    rng = np.random.default_rng(seed)
    samples = micro_batch * n * 2
    # Few distinct ids: rows repeat within a sample, a micro-batch, a cycle.
    x = rng.integers(0, 3, size=(samples, LENGTH)).astype("int32")
    y = rng.normal(size=(samples, 2)).astype("float32")
    for jit_compile in (False, True):
        reference = fit(_model(lookups, tables), keras.optimizers.Adam(0.05), x, y, micro_batch * n,
                        jit_compile=jit_compile)
        subject, opt = _model(lookups, tables), accumulate(keras.optimizers.Adam(0.05), n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(subject, opt, x, y, micro_batch, jit_compile=jit_compile)
        warned = [str(w.message) for w in caught if "gradaccum" in str(w.message)]
        expected, got = full_state(reference, reference.optimizer), full_state(subject, opt)
        # Loud rather than exact exactly where one constant value is spread
        # over a first dimension of the micro-batch's size alone: `[1]` with
        # micro-batches of 1, a row as long as the micro-batch. The warning
        # names the table.
        ambiguous = {"constant": 1, "constant_row": LENGTH}
        assert bool(warned) == any(ambiguous.get(how) == micro_batch for how, _ in lookups), (lookups, warned)
        if warned:
            assert all("lookups/table" in m and "micro-batch size" in m for m in warned), warned
            continue
        assert int(got["iterations"]) == 2
        assert_states_close(expected, got)
