"""Tests of trust: keys, manifests, the trusted gate, announcements, chunk checks."""
