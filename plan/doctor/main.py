"""`brigade doctor [run flags] [--json] [--hardware NAME] [--timeout S]` (`python -m train
doctor`): the checklist of the run those flags describe, before it runs. Every process of a job
runs it with its own flags, as it would run training; process 0 prints the union. Exit status 0
when no line is FAIL, 1 when one is, 2 for flags the run itself would refuse."""

from __future__ import annotations

import socket

from errors import UserError, number
from mesh.build import init_distributed
from plan.doctor import cluster, environment, inputs, layout
from plan.doctor.report import Check, as_json, fail, ok, passed, render, union
from train.core.config import build, make_parser


def make_doctor_parser():
    parser = make_parser(
        "python -m train doctor",
        "Check the environment, the cluster, the layout and the inputs of the run these flags"
        " describe, before it runs: OK / WARN / FAIL with one line of fix each.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--hardware",
        metavar="NAME",
        default="",
        help="the profile memory and communication are predicted on (h100, h200, a100,"
        " tpu-v5p, cpu); default: the one of the device kind found",
    )
    parser.add_argument(
        "--timeout",
        type=number(float, ">0"),
        default=60.0,
        metavar="S",
        help="seconds to wait for the coordinator and for every process to join",
    )
    return parser


class Doctor:
    """The checklist of this process, and how it is said."""

    def __init__(self, cfg, as_json_out: bool):
        self.cfg, self.json = cfg, as_json_out
        self.checks: list[Check] = []
        self.facts: dict = {"host": socket.gethostname()}

    def emit_alone(self) -> int:
        """This process's checklist alone (the job could not be joined)."""
        lines = union({self.cfg.parallelism.process_id: self.checks})
        p = self.cfg.parallelism
        head = f"brigade doctor: process {p.process_id} of {p.num_processes} (not joined)"
        print(as_json(lines, {"processes": p.num_processes}) if self.json else render(lines, head))
        return 0 if passed(lines) else 1

    def join(self, timeout_s: float) -> bool:
        """Join the job (when there is one) with a deadline -> whether it was joined."""
        p = self.cfg.parallelism
        if not (p.coordinator or p.num_processes > 1):
            # a cluster's own variables, if any (SLURM, Open MPI, JAX_COORDINATOR_ADDRESS): the
            # job is joined as JAX detects it, under the same deadline
            missing = fail(
                "processes joined",
                f"the job JAX detected from the scheduler's variables was not joined within"
                f" {timeout_s:g}s",
                "start every process of the job, or give --coordinator, --num-processes and"
                " --process-id to have the coordinator checked first",
            )
            with cluster.JoinTimer(timeout_s, lambda: self._expire(missing)):
                init_distributed(peer_timeout_s=p.peer_timeout)
            return True
        if not p.coordinator:
            self.checks.append(
                fail(
                    "coordinator",
                    f"--num-processes {p.num_processes} without --coordinator HOST:PORT",
                    "give every process --coordinator HOST:PORT (process 0's host)",
                )
            )
            return False
        first = (
            cluster.bindable(p.coordinator)
            if p.process_id == 0
            else cluster.knock(p.coordinator, timeout_s)
        )
        self.checks.append(first)
        if first.status == "FAIL":
            return False
        missing = cluster.not_joined(p.coordinator, p.num_processes, p.process_id, timeout_s)
        with cluster.JoinTimer(timeout_s, lambda: self._expire(missing)):
            init_distributed(
                p.coordinator, p.num_processes, p.process_id, peer_timeout_s=p.peer_timeout
            )
        self.checks.append(ok("processes joined", f"all {p.num_processes} at {p.coordinator}"))
        return True

    def _expire(self, line: Check) -> None:
        self.checks.append(line)
        self.emit_alone()

    def examine(self, hardware_name: str) -> None:
        """Everything checked once the job is joined (devices, the run, its inputs)."""
        import jax

        local = jax.local_devices()
        d = local[0]
        self.facts.update(
            platform=d.platform,
            device_kind=d.device_kind,
            local_devices=len(local),
            local_device_ids=[int(x.id) for x in local],
        )
        self.checks.append(
            environment.platform(local, self.facts["versions"], hardware_name, layout.profile_name)
        )
        self.checks.append(
            ok("local devices", f"ids {', '.join(map(str, self.facts['local_device_ids']))}")
        )
        profile = hardware_name or layout.profile_name(d.device_kind, d.platform)
        run_checks, run_setup = layout.run_checks(self.cfg, jax.devices(), profile, len(local))
        self.checks += run_checks
        self.checks += inputs.directories(self.cfg)
        self.checks += inputs.checkpoints(self.cfg)
        if run_setup is not None:
            self.checks += inputs.data(self.cfg, run_setup)

    def report(self, timeout_s: float) -> int:
        """Process 0: the union of every process's checklist (and what only the union shows:
        versions and device counts across processes) -> the exit status; the others: theirs."""
        import jax

        me, n = jax.process_index(), jax.process_count()
        mine = {"checks": [c.to_dict() for c in self.checks], "facts": self.facts}
        everyone = cluster.exchange(me, n, mine, timeout_s)
        if everyone is None:
            print(f"doctor: process {me}: checklist sent to process 0, which prints the job's")
            return 0 if all(c.status != "FAIL" for c in self.checks) else 1
        by_process = {p: [Check(**c) for c in got["checks"]] for p, got in everyone.items()}
        facts = {p: got["facts"] for p, got in everyone.items()}
        by_process[0] += environment.agreement(facts)
        lines = union(by_process)
        m, p = self.cfg, self.cfg.parallelism
        head = (
            f"brigade doctor: {n} process(es), {jax.device_count()} devices"
            f" ({self.facts['platform']}, {self.facts['device_kind']}), --model"
            f" {m.model_preset}, --mesh {p.mesh or 'data=-1'}"
        )
        extra = {"processes": n, "devices": jax.device_count(), "facts": facts}
        print(as_json(lines, extra) if self.json else render(lines, head))
        return 0 if passed(lines) else 1


def main(argv: list[str]) -> int:
    ns = make_doctor_parser().parse_args(argv)
    cfg = build({k: v for k, v in vars(ns).items() if "." in k}, getattr(ns, "config", None))
    doctor = Doctor(cfg, ns.json)
    doctor.facts["versions"] = environment.versions()
    doctor.checks += [
        environment.version_checks(doctor.facts["versions"]),
        environment.xla_flags(),
    ]
    try:
        joined = doctor.join(ns.timeout)
    except UserError as e:
        doctor.checks.append(fail("cluster", str(e), "the line names the flag to change"))
        joined = False
    if not joined:
        return doctor.emit_alone()
    doctor.examine(ns.hardware)
    code = doctor.report(ns.timeout)
    import jax

    if jax.process_count() > 1:
        jax.distributed.shutdown()
    return code
