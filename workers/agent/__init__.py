"""The node agent, copied to every node: standard library only."""
