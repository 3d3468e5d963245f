"""Tests of the durable store: checkpoint + log, packs, crash safety."""
