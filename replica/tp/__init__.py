"""Tensor parallelism applied from outside the plain model (see README.md)."""
