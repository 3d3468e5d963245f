"""Tests of the sans-I/O protocol: scheduler, peers, stalls, seeding, uploads; the in-memory N-node
swarm."""
