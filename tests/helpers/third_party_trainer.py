"""Stands in for training code gradaccum's users do not own.

It builds, compiles and fits its own model; the tests call it as it is.
"""

import keras


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="hidden0"),
         keras.layers.Dense(3, name="out")],
        name="mlp",
    )


def train(x, y, batch_size, optimizer="adam", epochs=1, callbacks=None):
    model = build()
    model.compile(optimizer=optimizer, loss="mse")
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
        callbacks=callbacks,
    )
    return model, history


class Task(keras.Sequential):
    """A model that compiles itself when it is created, as keras-hub's tasks do."""

    def __init__(self, optimizer="adam", loss="mse"):
        keras.utils.set_random_seed(0)
        super().__init__(
            [keras.Input((5,)), keras.layers.Dense(8, activation="tanh", name="hidden0"),
             keras.layers.Dense(3, name="out")],
            name="mlp",
        )
        self.compile(optimizer=optimizer, loss=loss)
