"""Runnable examples of the Python API: tests/test_examples.py runs each of them."""
