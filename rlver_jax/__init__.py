"""Wiring: meshes and sharding, CLIs, the trainer loop, checkpoints, metrics."""
