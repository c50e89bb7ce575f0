"""The accumulating core on Keras's JAX and PyTorch backends, written with
Keras ops (see `accumulation`); its state is in `state`."""
