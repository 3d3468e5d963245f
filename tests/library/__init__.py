"""Tests of the library's edges: errors, bounded parsers, the layering, the embedding API."""
