"""Tests of real node processes: loopback swarms, hostile peers, network namespaces (emulated tier,
NAT)."""
