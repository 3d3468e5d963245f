"""Runnable examples of the Python API: tests/app/test_examples.py runs each of them."""
