"""Checkpointing (Orbax async, sharded, restore onto any mesh) lands with the checkpoint issue.

Nothing here yet: the package exists so the top-level layout is fixed from the start.
"""
