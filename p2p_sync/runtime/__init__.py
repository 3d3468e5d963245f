"""A running node: the parts a trainer or a rollout wires together, and their asyncio drivers."""
