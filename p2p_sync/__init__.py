"""p2psync: lossless sparse weight patches and a peer-to-peer swarm that distributes them.

The library half: everything a trainer or a rollout engine imports. Modules hold one concept
each: ``tensors`` (named tensor sets, layout fingerprints, state hashes), ``patch`` (diff, apply,
merge), ``codec`` (the wire format), ``workloads`` (the built-in model that produces versions).
"""

__version__ = "0.1.0"
