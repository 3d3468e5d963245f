"""Swarm simulations of issue 6: the discrete-event simulator and the emulated (netns) tier."""
