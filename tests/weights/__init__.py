"""Tests of weights: diff, apply, merge, catch-up, state hash, export, engines."""
