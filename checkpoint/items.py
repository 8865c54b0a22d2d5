"""What a checkpoint holds besides the arrays: the `meta` JSON, readable without JAX.

The arrays (`state`: step, params, optimizer state with the schedule's count) need nothing else to
continue exactly: there is no RNG state in the step, and batch `s` depends only on (seed, s), so
the data position is the step itself.
"""
from __future__ import annotations

import datetime
import importlib.metadata

import jax


def versions() -> dict[str, str]:
    out = {}
    for name in ("brigade", "jax", "orbax-checkpoint", "flax", "optax"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def make_meta(step: int, config: dict, mesh: jax.sharding.Mesh, seed: int) -> dict:
    """config: the full resolved config (Config.to_dict()); its `model` section is the model config."""
    return {
        "step": step,
        "data": {"next_step": step, "seed": seed, "source": config.get("data", {}).get("source")},
        "seed": seed,
        "mesh": {name: int(size) for name, size in mesh.shape.items()},
        "devices": int(mesh.size), "processes": jax.process_count(),
        "model": config.get("model", {}),
        "config": config,
        "versions": versions(),
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def mesh_text(shape: dict) -> str:
    """{'data': 4, 'fsdp': 1, 'model': 2} -> 'data=4,model=2' (axes of size 1 left out)."""
    return ",".join(f"{k}={v}" for k, v in shape.items() if v > 1) or "1 device"
