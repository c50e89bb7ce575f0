"""JAX devices for the data-parallel tests (`keras.distribution`)."""

from __future__ import annotations

from typing import Any


def two_devices() -> list[Any]:
    """Two JAX devices, or a failed assertion saying how to get them."""
    import jax

    devices = jax.devices()
    assert len(devices) >= 2, (
        "these tests need two JAX devices: set "
        "XLA_FLAGS=--xla_force_host_platform_device_count=2 before JAX starts "
        "(the keras3-jax tox environment does)"
    )
    return devices[:2]
