"""Build the device mesh (ICI inside a host/slice, DCN across them) and start multi-process JAX."""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from errors import UserError, expect
from mesh.spec import AXES, MeshShape, resolve

log = logging.getLogger(__name__)


def init_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    peer_timeout_s: float = 45.0,
) -> None:
    """Join a multi-process JAX job. Explicit flags win; otherwise JAX auto-detects the cluster
    (SLURM, Open MPI, Kubernetes/GKE, TPU pods) when one of their environments is present.
    On CPU the cross-process collectives go through gloo.

    `peer_timeout_s` bounds how long a process waits for a peer that is gone: the trainer's
    heartbeat ends the process after it, gloo collectives time out after it (a Python error the
    trainer turns into a message naming the lost peer), and the coordination service's own
    heartbeat and shutdown timeouts are longer, so that they never abort a process (from C++,
    without naming anyone) before the trainer's detection has spoken (NCCL on GPUs has its own
    timeouts). A second call, once the job is joined, does nothing."""
    if jax.distributed.is_initialized():
        return
    explicit = coordinator is not None or num_processes not in (None, 1)
    if explicit:
        if coordinator is None or num_processes is None or process_id is None:
            raise UserError(
                "multi-process start needs all of --coordinator HOST:PORT, --num-processes N,"
                " --process-id I"
            )
        if not 0 <= process_id < num_processes:
            raise UserError(
                f"--process-id {process_id} must be in [0, {num_processes - 1}]"
                f" for --num-processes {num_processes}"
            )
    elif not _cluster_detected():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _set_cpu_collective_timeout(peer_timeout_s)
    kwargs = service_timeouts(peer_timeout_s)
    if explicit:
        kwargs.update(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        )
        if coordinator.startswith(("127.", "localhost")):
            kwargs["coordinator_bind_address"] = coordinator  # stay on loopback in local tests
    jax.distributed.initialize(**kwargs)
    log.info(
        "process %d/%d: %d local of %d devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def service_timeouts(peer_timeout_s: float) -> dict[str, int]:
    """jax.distributed's heartbeat and shutdown-barrier timeouts for a job whose lost peers are
    declared after `peer_timeout_s`: twice that, and at least 10 s more (the heartbeat samples
    once a second on a possibly busy host), so the trainer's one-line exit always comes first."""
    backstop = int(max(2 * peer_timeout_s, peer_timeout_s + 10))
    return dict(heartbeat_timeout_seconds=backstop, shutdown_timeout_seconds=max(300, backstop))


def _set_cpu_collective_timeout(seconds: float) -> None:
    """XLA:CPU's collective timeout, unless the user set one or the backend is already up (the
    flag is read when the CPU client is created) or will not be CPU."""
    import os

    from jax._src import xla_bridge

    flags = os.environ.get("XLA_FLAGS", "")
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if (
        "xla_cpu_collective_timeout_seconds" in flags
        or xla_bridge.backends_are_initialized()
        or (platforms and not platforms.startswith("cpu"))
    ):
        return
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_cpu_collective_timeout_seconds={max(1, int(seconds))}".strip()
    )


def _cluster_detected() -> bool:
    import os

    return any(
        k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")
    )


def make_mesh(
    spec: str | dict | None = None, dcn_spec: str | dict | None = None, devices: list | None = None
) -> Mesh:
    """A Mesh over AXES (all six always present, unused ones size 1), Auto axis types.

    With `dcn_spec` the mesh is hybrid: each axis = dcn part (across hosts/slices) x ici part,
    built so that ici neighbours share a host/slice.
    """
    for name, value in (("spec", spec), ("dcn_spec", dcn_spec)):
        expect(
            "make_mesh", name, value, (str, dict, type(None)), "--mesh text, e.g. 'data=2,model=4'"
        )
    expect("make_mesh", "devices", devices, (list, tuple, type(None)), "a list of devices or None")
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve(spec, len(devices), dcn_spec)
    return mesh_from_shape(shape, devices)


def mesh_from_shape(shape: MeshShape, devices: list) -> Mesh:
    types = (AxisType.Auto,) * len(AXES)
    if any(d > 1 for d in shape.dcn):
        granules, by_process = _granules(devices)
        dcn_total = int(np.prod(shape.dcn))
        if dcn_total != granules:
            raise UserError(
                f"--mesh-dcn multiplies to {dcn_total} but the devices span {granules}"
                " host(s)/slice(s); the --mesh-dcn product must equal that number"
            )
        arr = mesh_utils.create_hybrid_device_mesh(
            shape.ici, shape.dcn, devices, process_is_granule=by_process
        )
    elif len(devices) == jax.device_count() and devices == list(jax.devices()):
        arr = mesh_utils.create_device_mesh(shape.sizes, devices, allow_split_physical_axes=True)
    else:
        arr = np.asarray(devices).reshape(shape.sizes)
    return Mesh(arr, AXES, axis_types=types)


def _granules(devices) -> tuple[int, bool]:
    """-> (number of DCN granules, whether they are processes rather than slices).

    Multi-slice devices are grouped by slice_index. Multi-process CPU (gloo) devices do carry a
    slice_index, but it is 0 on every process (one "slice"), so when slice_index does not tell
    the devices apart the processes are the granules (hosts); without this, `--mesh-dcn data=2`
    over 2 CPU processes was rejected as spanning 1 host."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    if None not in slices and len(slices) > 1:
        return len(slices), False
    return len({d.process_index for d in devices}), True


def start_mesh(parallelism, devices: list | None = None) -> Mesh:
    """The entry point's mesh: start the distributed runtime the --parallelism settings ask for
    (coordinator, process count and id, peer timeout), then lay --mesh/--mesh-dcn over `devices`
    (default: every device of every process)."""
    p = parallelism
    if p.coordinator or p.num_processes > 1:
        init_distributed(
            p.coordinator or None, p.num_processes, p.process_id, peer_timeout_s=p.peer_timeout
        )
    else:
        init_distributed(peer_timeout_s=p.peer_timeout)
    return make_mesh(p.mesh, p.mesh_dcn, devices)
