"""Compile time of the train step vs depth with scan_layers on and off (2 vs 16 layers).

python benchmarks/compile_depth.py
"""

import time

import common  # sets XLA_FLAGS first; the peer shape (common.PEER)

from train.core import state as train_state
from train.core.config import build
from train.core.setup import abstract_batch, compile_step
from train.run.loop import Trainer


def compile_seconds(layers: int, scan: bool) -> float:
    tr = Trainer(build({**common.PEER, "model.n_layers": layers, "model.scan_layers": scan}))
    abstract = train_state.abstract(tr.setup.model_cfg, tr.setup.tx, tr.setup.mesh, tr.setup.rules)
    batch = abstract_batch(tr.setup)
    t0 = time.perf_counter()
    compile_step(tr.setup, abstract, batch)
    return time.perf_counter() - t0


def main():
    for scan in (True, False):
        a, b = compile_seconds(2, scan), compile_seconds(16, scan)
        print(f"scan_layers={scan}: 2 layers {a:.1f}s, 16 layers {b:.1f}s, ratio {b / a:.2f}x")


if __name__ == "__main__":
    main()
