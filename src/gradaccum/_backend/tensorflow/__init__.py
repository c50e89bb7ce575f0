"""The TensorFlow backend: `distribution`, `tensors` and `updates`."""
