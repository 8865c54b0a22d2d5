"""`--max-restarts N --train.elastic true`: the supervisor of an elastic job.

Like train/run/supervisor.py it runs training as a child and restarts it after a crash, and it never
imports JAX. Between two children it meets the job's other supervisors (train/run/rendezvous.py), so
that each attempt runs on the processes that are there:

- a child that ends as a crash (a lost peer's 5, a watchdog's 4, a signal, a Python error): its
  supervisor joins the next generation; if a process does not come back within
  --train.elastic_wait seconds, the others continue without it, on the layout train/run/elastic.py
  re-plans for the devices that remain, resumed from the newest checkpoint (a shrink);
- while a child runs, its supervisor watches for a process that comes back (announced in the next
  generation): once the child has committed a checkpoint of its own (it trained on the layout
  it was started on), the supervisor sends it SIGTERM, the child commits a checkpoint at its
  step and exits 143, and the next generation runs with that process again (a grow). A grow is
  no failure: it does not count against --max-restarts.

Each attempt's children get `--coordinator`, `--num-processes`, `--process-id`, `--mesh`,
`--mesh-dcn` and `--micro-batches` of that attempt (the last flag wins over the user's); the
coordinator is the lowest member's host at the port of the job's --coordinator. The lowest
member's supervisor appends each shrink, grow and restart to `<run-dir>/elastic/events.jsonl`
(the goodput's elastic counts read it) and to restarts.jsonl.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from checkpoint import storage
from errors import UserError
from train.run import elastic
from train.run.rendezvous import Generation, Rendezvous
from train.run.supervisor import (
    CHILD_ENV,
    FINAL,
    Fresh,
    checkpoint_step,
    child_argv,
    describe,
    last_logged_step,
    record_restart,
)

JOIN_TIMEOUT_S = 3600.0  # a supervisor waits this long for a generation that holds it
HOST_ENV = "BRIGADE_ELASTIC_HOST"  # the address other hosts reach this one at (default: its name)
CLUSTER_VARS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")
GROW_STOP = (143, -signal.SIGTERM)  # how a child stopped for a grow ends


def _own_host(coordinator: str, slot: int) -> str:
    host = coordinator.rpartition(":")[0]
    if slot == 0 or host.startswith(("127.", "localhost")):
        return host  # process 0 is where the job's coordinator was; loopback: one machine
    return os.environ.get(HOST_ENV) or socket.gethostname()


def generation_flags(gen: Generation, slot: int, port: str) -> tuple[list[str], bool]:
    """The flags that put this slot's child in generation `gen`, and whether it runs alone (then
    the cluster variables that would make JAX join a job by itself are taken from its
    environment)."""
    n = len(gen.members)
    coordinator = f"{gen.hosts[gen.members[0]]}:{port}" if n > 1 else ""
    flags = ["--coordinator", coordinator, "--num-processes", str(n)]
    return [*flags, "--process-id", str(gen.process_id(slot))], n == 1


class ElasticSupervisor:
    """One slot's supervisor; `run()` -> the job's final exit status."""

    def __init__(self, argv, cfg, run_dir, ckpt_dir, fresh: Fresh | None, program=None):
        p, t = cfg.parallelism, cfg.train
        if p.num_processes > 1 and not p.coordinator:
            raise UserError(
                "--train.elastic true with --num-processes > 1: give the job's --coordinator"
                " HOST:PORT (each attempt's coordinator is its lowest process's host at that port)"
            )
        self.argv, self.cfg, self.run_dir, self.ckpt_dir, self.fresh = (
            argv,
            cfg,
            run_dir,
            ckpt_dir,
            fresh,
        )
        self.program = program or [sys.executable, "-m", "train"]
        self.slot, self.port = p.process_id, p.coordinator.rpartition(":")[2]
        self.rdv = Rendezvous(
            elastic.elastic_dir(run_dir),
            self.slot,
            p.num_processes,
            _own_host(p.coordinator, self.slot),
            t.elastic_wait,
        )
        self.max_restarts, self.restarts = t.max_restarts, 0
        self.child: subprocess.Popen | None = None
        self.stop_signal: int | None = None

    def _forward(self, signum, frame) -> None:
        self.stop_signal = signum
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def run(self) -> int:
        previous = {s: signal.signal(s, self._forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._attempts()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def _attempts(self) -> int:
        gen, before, started_any = self.rdv.join(JOIN_TIMEOUT_S), None, False
        while True:
            if isinstance(gen, int):  # the job ended while this process waited to rejoin it
                print(
                    f"supervisor: elastic: the job ended (status {gen}) before this process"
                    f" rejoined it",
                    flush=True,
                )
                return gen
            lay = self._layout(gen)
            if before is not None:
                self._announce(before, gen, lay)
            code, asked = self._run_child(gen, lay, started_any)
            started_any = True
            grow = asked and code in GROW_STOP
            if self.stop_signal is not None or (not grow and code in FINAL):
                if code in (0, 2, 3):  # the job is over: a process waiting to rejoin leaves too
                    self.rdv.finish(code)
                return code
            if not grow:
                self.restarts += 1
                if self.restarts > self.max_restarts:
                    print(
                        f"supervisor: training {describe(code)}; giving up after"
                        f" {self.restarts - 1} restart(s) (--max-restarts {self.max_restarts})",
                        file=sys.stderr,
                        flush=True,
                    )
                    return code
            before = (gen, code, time.time())
            gen = self.rdv.join(JOIN_TIMEOUT_S)

    def _layout(self, gen: Generation) -> elastic.Layout | None:
        origin = elastic.read_origin(self.run_dir)
        if origin is None:  # the first attempt records it; until then, the user's flags
            if len(gen.members) != self.rdv.slots:
                raise UserError(
                    f"elastic: {len(gen.members)} of {self.rdv.slots} processes, but the job's"
                    f" first attempt recorded no layout to re-plan from"
                    f" ({elastic.elastic_dir(self.run_dir)}/{elastic.ORIGIN})"
                )
            return None
        return elastic.layout(origin, len(gen.members), self.argv, self.cfg.train.elastic_hardware)

    def _run_child(self, gen: Generation, lay, started_any: bool) -> tuple[int, bool]:
        """Start this slot's child of `gen` and wait for it, stopping it (SIGTERM: a checkpoint,
        then exit) when a process comes back -> (its exit status, whether it was stopped so)."""
        saved = checkpoint_step(self.ckpt_dir) if started_any else None
        flags, alone = generation_flags(gen, self.slot, self.port)
        argv = child_argv(self.argv, self.fresh, saved)
        if saved is not None and self.fresh is None:
            argv = [*argv, "--resume", "auto"]  # the job's own newest checkpoint from now on
        env = {k: v for k, v in os.environ.items() if not (alone and k in CLUSTER_VARS)}
        env.update({CHILD_ENV: "1", elastic.GENERATION_ENV: str(gen.number)})
        self.child = subprocess.Popen(
            [*self.program, *argv, *flags, *(lay.flags() if lay else [])], env=env
        )
        print(
            f"supervisor: training started (pid {self.child.pid}, generation {gen.number}:"
            f" process {gen.process_id(self.slot)} of {len(gen.members)}, restart"
            f" {self.restarts}/{self.max_restarts})",
            flush=True,
        )
        grow, resumed_at, beats = False, checkpoint_step(self.ckpt_dir), 0
        while True:
            self.rdv.beat(beats := beats + 1)
            try:
                return self.child.wait(timeout=1.0), grow
            except subprocess.TimeoutExpired:
                pass
            # grow at the first checkpoint this attempt commits: it trains on before it stops
            if not grow and self.rdv.newcomers(gen) and _newer(self.ckpt_dir, resumed_at):
                grow = True
                print(
                    f"supervisor: elastic: process(es) {self.rdv.newcomers(gen)} came back;"
                    f" stopping at a checkpoint to grow",
                    flush=True,
                )
                self.child.send_signal(signal.SIGTERM)

    def _announce(self, before: tuple, gen: Generation, lay) -> None:
        """Say what the new generation is; the lowest member records it."""
        was, code, exited_at = before
        origin = elastic.read_origin(self.run_dir) or {}
        per = origin.get("devices", 0) // max(origin.get("processes", 1), 1)
        kind = (
            "shrink"
            if len(gen.members) < len(was.members)
            else "grow"
            if len(gen.members) > len(was.members)
            else "restart"
        )
        logged, saved = last_logged_step(self.run_dir), checkpoint_step(self.ckpt_dir)
        lost = sorted(set(was.members) - set(gen.members))
        joined = sorted(set(gen.members) - set(was.members))
        print(
            f"supervisor: elastic {kind}: generation {gen.number} on {len(gen.members)}"
            f" process(es) ({per * len(gen.members)} devices"
            + (f", --mesh {lay.mesh} --micro-batches {lay.micro_batches}" if lay else "")
            + ")"
            + (f", without process(es) {lost}" if lost else "")
            + (f", with process(es) {joined} back" if joined else "")
            + f", from {'step ' + str(saved) if saved is not None else 'scratch'}"
            f" ({time.time() - exited_at:.1f}s after the last attempt ended: {describe(code)})",
            file=sys.stderr,
            flush=True,
        )
        if self.slot != gen.members[0]:
            return
        event = {
            "event": kind,
            "generation": gen.number,
            "members": list(gen.members),
            "lost": lost,
            "joined": joined,
            "devices_from": per * len(was.members),
            "devices_to": per * len(gen.members),
            "mesh": lay.mesh if lay else None,
            "micro_batches": lay.micro_batches if lay else None,
            "exit_code": code,
            "reason": describe(code),
            "exited_at": exited_at,
            "started_at": time.time(),
            "cost_s": round(time.time() - exited_at, 3),
            "last_logged_step": logged,
            "checkpoint_step": saved,
            "lost_steps": max(0, (logged or 0) - (saved or 0)),
        }
        storage.append_text(
            storage.join(elastic.elastic_dir(self.run_dir), elastic.EVENTS),
            json.dumps(event) + "\n",
        )
        if kind != "grow":
            record_restart(self.run_dir, {"restart": self.restarts, **event})


def _newer(ckpt_dir: str, than: int | None) -> bool:
    saved = checkpoint_step(ckpt_dir)
    return saved is not None and (than is None or saved > than)


def supervise_elastic(
    argv, cfg, run_dir, ckpt_dir, fresh: Fresh | None = None, program=None
) -> int:
    return ElasticSupervisor(argv, cfg, run_dir, ckpt_dir, fresh, program).run()
