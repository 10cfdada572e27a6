"""jaxlm: train decoder language models with JAX and Flax NNX."""
