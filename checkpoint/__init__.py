"""Checkpoints: Orbax, asynchronous and sharded, restorable onto any mesh; `python -m checkpoint`
inspects and exports them."""
