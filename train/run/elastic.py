"""`--train.elastic true`: the layout of each attempt of an elastic job, and what its children
record for it.

The job's first attempt runs the command as given; its process 0 records the layout it ran on
(`<run-dir>/elastic/origin.json`: processes, devices, the resolved --mesh and --mesh-dcn, the
micro-batch count). Every later attempt runs on the processes the rendezvous fixed
(train/run/rendezvous.py), on a layout re-planned from that origin for the devices they hold:

- the same processes: the origin's layout (a restart, or a grow back to the full job);
- fewer: the --mesh axes shrunk on `data`, then `fsdp` (the other axes keep their sizes, so
  the parameters keep their split; --mesh-dcn likewise over the hosts that remain), or with
  --train.elastic_hardware NAME the mesh `plan --search` ranks first on that hardware;
- always the same global batch: the micro-batch count grows by the factor the data-parallel
  split shrank, so each micro-batch is as large per device as before and the optimisation is
  the same (the data order is a function of the step and the global batch).

Nothing here imports JAX but what runs in the child: the supervisor uses the rest
(train/run/elastic_supervisor.py).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import NamedTuple

from checkpoint import storage
from errors import UserError
from mesh.spec import AXES, mesh_text
from train.run.rundir import ELASTIC

ORIGIN = "origin.json"
EVENTS = (
    "events.jsonl"  # one line per shrink, grow or restart (the supervisor of the lowest member)
)
GENERATION_ENV = "BRIGADE_ELASTIC_GENERATION"  # set in each child: the attempt it belongs to
BATCH_AXES = ("data", "fsdp")  # shrunk in this order


class Layout(NamedTuple):
    """What one attempt runs on: its --mesh, --mesh-dcn and --micro-batches, and any other flag
    the planner chose (a pipeline schedule)."""

    mesh: str
    mesh_dcn: str
    micro_batches: int
    extra: tuple[str, ...] = ()

    def flags(self) -> list[str]:
        return [
            "--mesh",
            self.mesh,
            "--mesh-dcn",
            self.mesh_dcn,
            "--micro-batches",
            str(self.micro_batches),
            *self.extra,
        ]


def elastic_dir(run_dir: str) -> str:
    return storage.join(run_dir, ELASTIC)


def read_origin(run_dir: str) -> dict | None:
    try:
        return json.loads(storage.read_text(storage.join(elastic_dir(run_dir), ORIGIN)))
    except (FileNotFoundError, ValueError):
        return None


def _text(sizes: dict[str, int]) -> str:
    text = mesh_text({a: sizes.get(a, 1) for a in AXES})
    return "data=1" if text == "1 device" else text


def shrink(origin: dict, processes: int) -> Layout:
    """The origin's layout on `processes` of its processes (each holding as many devices as
    before): the batch axes shrunk (`data` first), the micro-batches grown to keep the global
    batch. UserError when the devices that remain cannot carry the layout that way."""
    n0, sizes, dcn = origin["processes"], dict(origin["mesh"]), dict(origin["dcn"])
    if processes == n0:
        return Layout(
            _text(sizes), _text(dcn) if math.prod(dcn.values()) > 1 else "", origin["micro_batches"]
        )
    batch_split = math.prod(sizes.get(a, 1) for a in BATCH_AXES)
    if (batch_split * processes) % n0:
        raise UserError(
            f"elastic: {processes} of {n0} processes cannot carry --mesh {_text(sizes)}: its"
            f" data x fsdp split of {batch_split} does not shrink by {processes}/{n0}; use"
            f" --train.elastic_hardware NAME to let the planner choose, or a mesh whose"
            f" data x fsdp is a multiple of the process count"
        )
    new_split = batch_split * processes // n0
    new = dict(sizes)
    new["data"], new["fsdp"] = _split(new_split, sizes.get("data", 1), sizes.get("fsdp", 1))
    grown = origin["micro_batches"] * batch_split // new_split
    new_dcn = {}
    if math.prod(dcn.values()) > 1 and processes > 1:
        dcn_split = math.prod(dcn.get(a, 1) for a in BATCH_AXES) * processes // n0
        new_dcn = dict(dcn)
        new_dcn["data"], new_dcn["fsdp"] = _split(dcn_split, dcn.get("data", 1), dcn.get("fsdp", 1))
    return Layout(_text(new), _text(new_dcn) if new_dcn else "", grown)


def _split(total: int, data: int, fsdp: int) -> tuple[int, int]:
    """(data', fsdp') with data' x fsdp' = total, data' as small as it can be (data shrinks
    first), fsdp' at most fsdp and dividing it (the parameters' split stays a coarsening)."""
    for d in range(1, data + 1):
        if total % d == 0 and total // d <= fsdp and fsdp % (total // d) == 0 and data % d == 0:
            return d, total // d
    raise UserError(
        f"elastic: data={data}, fsdp={fsdp} cannot be shrunk to {total} devices on those axes"
    )


def planned(argv: list[str], devices: int, hardware: str, micro_batches: int) -> Layout:
    """The mesh `plan --search DEVICES --hardware HARDWARE` ranks first for the run of `argv` at
    `micro_batches` (run as a subprocess: the supervisor must not start JAX's backends)."""
    code = (
        "import json, sys\n"
        "from plan.cli import analytic, make_plan_parser\n"
        "from plan.render import run_flags\n"
        "from train.core.config import build\n"
        "ns = make_plan_parser().parse_args(sys.argv[1:])\n"
        "over = {k: v for k, v in vars(ns).items() if '.' in k}\n"
        "cfg = build(over, getattr(ns, 'config', None))\n"
        "report, _ = analytic(ns, cfg)\n"
        "print(json.dumps(run_flags(report['top'][0]) if report['top'] else ''))\n"
    )
    args = [*argv, "--micro-batches", str(micro_batches), "--search", str(devices)]
    done = subprocess.run(
        [sys.executable, "-c", code, *args, "--hardware", hardware, "--top", "1"],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    lines = done.stdout.strip().splitlines()
    flags = json.loads(lines[-1]) if done.returncode == 0 and lines else ""
    if not flags:
        why = done.stderr.strip().splitlines()[-1:] or ["no mesh of them fits"]
        raise UserError(f"elastic: plan --search {devices} --hardware {hardware}: {why[0]}")
    words = flags.split()
    mesh, mb = words[words.index("--mesh") + 1], int(words[words.index("--micro-batches") + 1])
    rest = [w for i, w in enumerate(words) if i not in _flag_positions(words)]
    return Layout(mesh, "", mb, tuple(rest))


def _flag_positions(words: list[str]) -> set[int]:
    out = set()
    for flag in ("--mesh", "--micro-batches"):
        i = words.index(flag)
        out |= {i, i + 1}
    return out


def layout(origin: dict, processes: int, argv: list[str], hardware: str) -> Layout:
    """The layout of an attempt on `processes` of the origin's processes."""
    if processes == origin["processes"] or not hardware:
        return shrink(origin, processes)
    devices = origin["devices"] // origin["processes"] * processes
    # the global batch kept: micro-batches as many times more as there are fewer devices
    grown = math.ceil(origin["micro_batches"] * origin["processes"] / processes)
    return planned(argv, devices, hardware, grown)


# -- in the child -----------------------------------------------------------------------------
def record_origin(cfg, mesh) -> None:
    """The first attempt's process 0 records the layout the job started on (later attempts
    re-plan from it); a later attempt, or a file already there, leaves it alone."""
    if not cfg.train.elastic or os.environ.get(GENERATION_ENV, "0") != "0":
        return
    import jax

    if jax.process_index() != 0:
        return
    if read_origin(cfg.logging.run_dir) is not None:
        return
    from mesh.spec import resolve

    shape = resolve(cfg.parallelism.mesh, mesh.size, cfg.parallelism.mesh_dcn)
    storage.makedirs(elastic_dir(cfg.logging.run_dir))
    storage.write_text(
        storage.join(elastic_dir(cfg.logging.run_dir), ORIGIN),
        json.dumps(
            {
                "processes": jax.process_count(),
                "devices": mesh.size,
                "mesh": dict(zip(AXES, shape.sizes)),
                "dcn": dict(zip(AXES, shape.dcn)),
                "micro_batches": cfg.train.micro_batches,
                "batch_size": cfg.train.batch_size,
            }
        ),
    )


def read_events(run_dir: str) -> list[dict]:
    try:
        text = storage.read_text(storage.join(elastic_dir(run_dir), EVENTS))
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # cut short by a kill
    return out


def record_fields(cfg, mesh) -> dict:
    """The fields every metrics record of this attempt carries: the mesh it ran on and, for an
    elastic job, how often it shrank and grew before this attempt and the seconds those cost
    (from a child's exit to the next child's start: the rendezvous and the re-plan; the steps
    redone are the goodput's `lost`)."""
    out = {"mesh": _text(dict(mesh.shape)), "devices": int(mesh.size)}
    if cfg.train.elastic:
        events = read_events(cfg.logging.run_dir)
        out["elastic_shrinks"] = sum(e.get("event") == "shrink" for e in events)
        out["elastic_grows"] = sum(e.get("event") == "grow" for e in events)
        out["elastic_resize_s"] = round(
            sum(e.get("cost_s", 0.0) for e in events if e.get("event") in ("shrink", "grow")), 3
        )
    return out
