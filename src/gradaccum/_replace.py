"""A copy of a model with its `BatchNormalization` layers made cycle-aware."""

from __future__ import annotations

from typing import Any

import keras

from gradaccum._batch_norm import BatchNormalization


def _replaceable(layer: Any) -> bool:
    # Exactly Keras's layer: a subclass may change what it computes, and
    # batch renormalization is not supported (see `BatchNormalization`).
    return type(layer) is keras.layers.BatchNormalization and not layer.renorm


def replace_batch_normalization(model: keras.Model) -> keras.Model:
    """A copy of `model` with every `keras.layers.BatchNormalization` replaced.

    Each one becomes a `gradaccum.layers.BatchNormalization` with the same
    config, and every layer of the copy gets the weights of its original
    (the moving statistics included). Nested models are copied too. The copy
    is not compiled. Subclasses of Keras's layer, and layers with
    `renorm=True`, are copied as they are.

    Args:
        model: A Sequential or functional Keras model.

    Returns:
        The new model.

    Raises:
        ValueError: If `model` is a subclassed model (Keras cannot clone it;
            build it with `gradaccum.layers.BatchNormalization` instead).
        TypeError: If `model` is not a Keras model.
    """
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`model` must be a Keras model. Received: {model!r} of type {type(model).__name__}."
        )

    def clone(layer: Any) -> Any:
        if _replaceable(layer):
            return BatchNormalization.from_config(layer.get_config())
        return layer.__class__.from_config(layer.get_config())

    try:
        copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    except ValueError as error:
        raise ValueError(
            "replace_batch_normalization() copies Sequential and functional "
            "models; a subclassed model cannot be cloned. Use "
            "gradaccum.layers.BatchNormalization in its code instead. "
            f"Keras said: {error}"
        ) from error
    old_layers = list(model._flatten_layers(include_self=False))
    new_layers = list(copy._flatten_layers(include_self=False))
    if len(old_layers) != len(new_layers):
        raise ValueError("The copy's layers do not match the model's; it cannot take its weights.")
    for old, new in zip(old_layers, new_layers):
        if isinstance(old, keras.Model):
            continue  # its layers are in the lists themselves
        # A replaced layer has its pooled statistics after Keras's weights.
        for source, target in zip(old.weights, new.weights[: len(old.weights)]):
            target.assign(source)
    return copy
