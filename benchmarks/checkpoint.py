"""Checkpoint benchmark: how long an Orbax save blocks the train loop (async vs sync), the save
throughput next to this disk's raw write speed, and restore time on the same and another mesh.

    python benchmarks/checkpoint.py [--d-model 512 --layers 8 --repeats 3]
        [--dir /tmp/brigade_ckpt_bench]

The train state (params + AdamW moments, float32) of the model below is ~300 MB, sharded over
fsdp=8 fake CPU devices; every figure is the median of --repeats runs in the same process.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import common  # noqa: F401  (8 fake devices)
import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoint.layout import make_meta
from checkpoint.manager import Checkpointer
from mesh.build import make_mesh
from mesh.rules import DEFAULT_RULES
from models.config import ModelConfig
from train.core import optim
from train.core import state as train_state
from train.core.config import TrainConfig


def state_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def raw_write_mb_s(directory: str, n_bytes: int) -> float:
    """Plain sequential write of n_bytes (64 MiB chunks) + fsync: the disk's ceiling here."""
    buf = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    path = os.path.join(directory, "raw.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, n_bytes // buf.nbytes)):
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return max(1, n_bytes // buf.nbytes) * buf.nbytes / dt / 1e6


def timed_saves(
    directory: str, state, meta, async_save: bool, repeats: int
) -> tuple[list[float], list[float]]:
    """-> (seconds the caller was blocked per save, seconds until committed per save)."""
    shutil.rmtree(directory, ignore_errors=True)
    ck = Checkpointer(directory, keep=2, async_save=async_save)
    ck.save(0, state, meta)  # warm-up: Orbax's first save sets up its thread pools and metadata
    ck.wait()
    blocked, total = [], []
    for step in range(1, repeats + 1):
        t0 = time.perf_counter()
        ck.save(step, state, meta)
        blocked.append(time.perf_counter() - t0)
        ck.wait()
        total.append(time.perf_counter() - t0)
    ck.close()
    return blocked, total


def timed_restores(directory: str, step: int, abstract, repeats: int, verify: bool) -> list[float]:
    ck = Checkpointer(directory, create=False)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if verify:
            # reads every chunk once to verify, then restores
            restored, _ = ck.restore(step, abstract)
        else:
            restored = ck._mngr.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        item=abstract,
                        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                    )
                ),
            )["state"]
        jax.block_until_ready(restored)
        out.append(time.perf_counter() - t0)
        del restored
    return out


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "brigade_ckpt_bench"))
    return ap.parse_args()


def model_config(d_model: int, layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=264,
        d_model=d_model,
        n_layers=layers,
        n_heads=8,
        n_kv_heads=8,
        d_ff=4 * d_model,
        max_seq_len=256,
        dtype="float32",
    )


def bench_saves(args, state, meta, mb: float, n_bytes: int) -> None:
    """Sync and async saves against the disk's raw write speed."""
    raw = statistics.median(
        raw_write_mb_s(os.path.dirname(args.dir) or ".", n_bytes) for _ in range(args.repeats)
    )
    a_block, a_total = timed_saves(args.dir + "_async", state, meta, True, args.repeats)
    s_block, s_total = timed_saves(args.dir + "_sync", state, meta, False, args.repeats)
    med = statistics.median
    print(f"raw disk write (numpy + fsync):   {raw:8.0f} MB/s")
    print(
        f"sync save:  blocked {med(s_block):6.2f} s, committed {med(s_total):6.2f} s"
        f" -> {mb / med(s_total):6.0f} MB/s"
    )
    print(
        f"async save: blocked {med(a_block):6.2f} s, committed {med(a_total):6.2f} s"
        f" -> {mb / med(a_total):6.0f} MB/s"
    )
    print(
        f"async blocks {100 * med(a_block) / med(s_block):.1f}% of sync (target < 10%);"
        f" save throughput {100 * mb / med(a_total) / raw:.0f}% of raw disk"
    )


def bench_restores(args, cfg, tx, mesh, mb: float) -> None:
    """The async save restored onto the same mesh, another layout and one device, with and
    without the pre-restore verification."""
    abstract_same = train_state.abstract(cfg, tx, mesh, DEFAULT_RULES)
    other = make_mesh("data=2,model=4")
    abstract_other = train_state.abstract(cfg, tx, other, DEFAULT_RULES)
    one = make_mesh("", devices=jax.devices()[:1])
    abstract_one = train_state.abstract(cfg, tx, one, DEFAULT_RULES)
    step = args.repeats
    d = args.dir + "_async"
    med = statistics.median
    for name, ab in (
        ("same mesh fsdp=8", abstract_same),
        ("resharded to data=2,model=4", abstract_other),
        ("resharded to 1 device", abstract_one),
    ):
        plain = med(timed_restores(d, step, ab, args.repeats, verify=False))
        checked = med(timed_restores(d, step, ab, args.repeats, verify=True))
        print(
            f"restore {name:28s} {plain:6.2f} s ({mb / plain:5.0f} MB/s);"
            f" with Brigade's pre-restore verification {checked:6.2f} s"
        )


def main() -> None:
    args = parse_args()
    cfg = model_config(args.d_model, args.layers)
    tx = optim.make(TrainConfig())
    mesh = make_mesh("fsdp=8")
    state = train_state.create(cfg, tx, mesh, DEFAULT_RULES, 0)
    jax.block_until_ready(state)
    n_bytes = state_bytes(state)
    meta = make_meta(0, {}, mesh, 0)
    mb = n_bytes / 1e6
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    print(
        f"state: {mb:.0f} MB ({n_params / 1e6:.1f}M params + AdamW),"
        f" mesh fsdp=8, {args.repeats} repeats, dir {args.dir}"
    )
    bench_saves(args, state, meta, mb, n_bytes)
    bench_restores(args, cfg, tx, mesh, mb)
    for suffix in ("_async", "_sync"):
        shutil.rmtree(args.dir + suffix, ignore_errors=True)


if __name__ == "__main__":
    main()
