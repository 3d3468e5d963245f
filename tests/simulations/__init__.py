"""Tests of the simulator: its models against closed forms, the CI scenario."""
