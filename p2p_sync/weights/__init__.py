"""Weights: named tensor sets, state hashes, sparse patches (diff, apply, merge), files."""
