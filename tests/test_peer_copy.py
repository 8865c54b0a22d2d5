"""checkpoint/peer_copy.py on 2 processes x 4 CPU devices: each process keeps the previous one's
local copy; a process that lost its own gets back every shard it held, replicated ones too (a
reshard of replicated data may read any replica, and the lost process holds only placeholders),
with the metadata of a process that read its own."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_multiprocess import REPO, TIMEOUT_S, child_env, free_port

PROCESS = """if True:
    import os, sys
    import numpy as np
    pid, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    from mesh.build import init_distributed
    init_distributed(f"127.0.0.1:{port}", 2, pid, peer_timeout_s=60)
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from checkpoint import peer_copy
    from checkpoint.layout import make_meta
    from checkpoint.manager import Checkpointer
    from checkpoint.tiers import layout
    from mesh.build import make_mesh

    mesh = make_mesh("data=2,fsdp=2,model=2", "data=2")

    def array(spec, shape, base):
        values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + base
        return jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda i: values[i])

    # a replicated scalar, one array replicated over the axis that spans the processes, one not
    state = {"step": array(P(), (), 6.0), "w": array(P("fsdp", "model"), (8, 8), 100.0),
             "b": array(P(("data", "fsdp")), (8,), 1000.0)}
    own = Checkpointer(os.path.join(root, f"process-{pid}"), keep=2, async_save=False,
                       process_local=True)
    peer = Checkpointer(peer_copy.peer_dir(root, pid), keep=2, async_save=False, process_local=True)
    meta = make_meta(6, {}, mesh, 0)
    meta["local"] = layout(mesh)
    own.save(6, state, meta)
    with jax.set_mesh(mesh):  # as the run saves: under its mesh
        peer_copy.save_copy(peer, 6, state, meta, mesh)
    own.wait(); peer.wait()
    assert peer_copy.recoverable_steps(own, peer) == [6]
    abstract = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    if pid == 1:  # its disk is lost: its own copy, and the copy it kept of process 0
        restored = None
        own.delete(6); peer.delete(6)
    else:
        restored = own.restore(6, abstract)
    assert peer_copy.recoverable_steps(own, peer) == [6]
    with jax.set_mesh(mesh):
        out, got_meta = peer_copy.complete(peer, 6, abstract, mesh, restored)
    for name in state:
        for new, old in zip(out[name].addressable_shards, state[name].addressable_shards):
            assert new.index == old.index and new.device == old.device
            assert np.array_equal(np.asarray(new.data), np.asarray(old.data)), (name, new.index)
    assert got_meta["step"] == 6 and got_meta["local"]["process"] == 0  # process 0 read its own
    print("ok", pid, flush=True)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_process_that_lost_its_disk_gets_every_shard_back_from_its_neighbour(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(i), str(port), str(tmp_path)],
            cwd=REPO,
            env=child_env(4),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    assert [out.split()[-2:] for out, _ in outs] == [["ok", "0"], ["ok", "1"]], outs
