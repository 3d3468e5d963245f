"""Tests of the p2psync application: commands, config, node HTTP, the docs and examples as a user
runs them."""
