"""Test-wide TensorFlow set-up; runs before TensorFlow initialises.

The test files in this directory are TensorFlow's (`tox -e keras3`);
`backends/` holds what every backend offers (run on TensorFlow, JAX and
PyTorch), `tf_keras/` and `integrations/` run in their own environments,
and `helpers/` is what all of them share. On JAX and PyTorch TensorFlow is
not installed and nothing is set up here.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

if os.environ.get("KERAS_BACKEND", "tensorflow") == "tensorflow":
    import tensorflow as tf

    # Two logical CPUs, so MirroredStrategy with two replicas runs
    # in-process. Single-device tests are unaffected: they run on /cpu:0.
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
