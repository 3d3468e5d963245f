"""The p2psync application: CLI, configuration and the processes that wire library parts."""
