"""Swarm simulations: the discrete-event simulator and the emulated (netns) tier."""
