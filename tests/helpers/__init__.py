"""What every test suite shares: models and data, state capture and
comparison, gradients on every backend, the large-batch reference runs and
the tolerances.

The names below import on every backend. The other modules are imported by
name: `distribute` (`tf.distribute`: replicas, custom loops) and `growing`
(an OptimizerV2 that meets variables late) need TensorFlow; `agc` is the
NumPy reference of adaptive gradient clipping, `processes` runs code in a
fresh interpreter, `legacy` says whether this process runs tf_keras and
`collection` which test files it collects;
`third_party_trainer` stands in for training code users do not own and
`mwms_worker` is one worker of a multi-worker run.
"""

from tests.helpers.models import (
    dtype_policy,
    embedding_data,
    library_of,
    make_data,
    make_embedding_model,
    make_float8_model,
    make_mlp,
)
from tests.helpers.optimizers import OPTIMIZERS, shipped_optimizers
from tests.helpers.state import (
    accumulation_arrays,
    assert_finite,
    assert_same,
    assert_states_close,
    assert_states_equal,
    full_state,
    max_difference,
    model_state,
    named_variables,
    optimizer_state,
    optimizer_variables,
    rounding_floor,
    values,
    whole_state,
    without_keras_accumulation,
)
from tests.helpers.tolerances import ATOL, FLOOR_FACTOR, RTOL
from tests.helpers.training import (
    BACKEND,
    JIT,
    as_int,
    concat,
    core_of,
    fit,
    fit_pair,
    gradients,
    gradients_of,
    internal_core,
    internal_state,
    settings_of,
    split,
    train_steps,
)

# Every `mode` of `accumulate`, for the TensorFlow tests where the mode
# changes what runs (on JAX and PyTorch it changes nothing).
MODES = ("masked", "skip")

__all__ = [
    "ATOL",
    "BACKEND",
    "FLOOR_FACTOR",
    "JIT",
    "MODES",
    "OPTIMIZERS",
    "RTOL",
    "accumulation_arrays",
    "as_int",
    "assert_finite",
    "assert_same",
    "assert_states_close",
    "assert_states_equal",
    "concat",
    "core_of",
    "dtype_policy",
    "embedding_data",
    "fit",
    "fit_pair",
    "full_state",
    "gradients",
    "gradients_of",
    "internal_core",
    "internal_state",
    "library_of",
    "make_data",
    "make_embedding_model",
    "make_float8_model",
    "make_mlp",
    "max_difference",
    "model_state",
    "named_variables",
    "optimizer_state",
    "optimizer_variables",
    "rounding_floor",
    "settings_of",
    "shipped_optimizers",
    "split",
    "train_steps",
    "values",
    "whole_state",
    "without_keras_accumulation",
]
