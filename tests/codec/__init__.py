"""Tests of the patch codec: round trips, canonical bytes, hostile and corrupt input, kernels."""
