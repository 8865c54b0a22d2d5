"""Stragglers: which process holds a multi-process job back, and which part of its step does.

Every log interval each process splits its own step time into compute (the host blocked on its
devices: inside the step call and fetching the metrics), data wait and host overhead (the rest:
Python, the loop, anything else on that host), and publishes the split in the coordination
service's key-value store; process 0 reads everyone's latest (one request, no collective: a hung
peer cannot block it) and logs `step_time_max_over_median` and `slowest_process`.

In a synchronous step every process waits for the slowest in the step's collectives, so each
one's compute time includes that wait and only the time spent off the devices tells the
processes apart. A process's own step time is therefore taken as the least compute time of any
process (the one that waited least, the slowest, waits for nobody) plus its own data wait and
host overhead. A slow device delays every process alike and shows here as compute time on all
of them (docs/troubleshooting.md says how to find it).
"""

from __future__ import annotations

import json
import socket
import statistics

from train.run.watchdog import coordination_client

_STEP_TIME = "brigade/steptime/"  # + process index: that process's latest per-step split (JSON)
PARTS = {"compute_s": "compute", "data_wait_s": "data wait", "host_s": "host overhead"}
STREAK = 3  # log intervals in a row above the threshold before the warning line
_HINTS = {
    "data_wait_s": "its input pipeline is slow (its disk or network; --data.prefetch)",
    "host_s": "something else runs on that host (CPU contention, swapping, a noisy neighbour)",
}


def compare(reports: dict[int, dict]) -> dict:
    """Process index -> its per-step split ({compute_s, data_wait_s, host_s} and `host`) -> the
    slowest process by its own step time (the least compute time of any process plus its own
    data wait and host overhead), that time over the median of the other processes' (1.0 for a
    single process), and the part of its step that exceeds the others' median the most."""
    floor = min(r["compute_s"] for r in reports.values())
    own = {p: floor + r["data_wait_s"] + r["host_s"] for p, r in reports.items()}
    slowest = max(sorted(own), key=own.get)
    others = [p for p in own if p != slowest]
    if not others:
        return {
            "step_time_max_over_median": 1.0,
            "slowest_process": slowest,
            "slow_part": "compute_s",
            "excess_s": 0.0,
        }
    median = statistics.median(own[p] for p in others)
    excess = {
        k: reports[slowest][k] - statistics.median(reports[p][k] for p in others)
        for k in ("data_wait_s", "host_s")
    }
    part = max(excess, key=excess.get)
    return {
        "step_time_max_over_median": own[slowest] / max(median, 1e-9),
        "slowest_process": slowest,
        "slow_part": part,
        "excess_s": excess[part],
    }


class Stragglers:
    """`observe(step, split)` at every logged step, on every process: publishes this process's
    split; on process 0 -> (the fields for the metrics record, the warning line or '')."""

    def __init__(self, threshold: float, process: int, n_processes: int):
        self.threshold, self.me, self.n = threshold, process, n_processes
        self.client = coordination_client() if n_processes > 1 else None
        self.host = socket.gethostname()
        self.streak: list[int] = []  # the logged steps in a row above the threshold

    def observe(self, step: int, split: dict) -> tuple[dict, str]:
        mine = {**{k: float(split[k]) for k in PARTS}, "host": self.host, "step": step}
        reports = {self.me: mine}
        if self.client is not None:
            try:
                self.client.key_value_set(
                    f"{_STEP_TIME}{self.me}", json.dumps(mine), allow_overwrite=True
                )
                # each peer's latest (its split for this step, or the interval before)
                if self.me == 0:
                    reports.update(
                        {
                            int(k.rsplit("/", 1)[1]): json.loads(v)
                            for k, v in self.client.key_value_dir_get(_STEP_TIME)
                        }
                    )
                    reports[0] = mine
            except Exception:  # noqa: BLE001  (the coordinator is gone: the peer heartbeat says so)
                pass
        if self.me != 0:
            return {}, ""
        found = compare(reports)
        fields = {k: found[k] for k in ("step_time_max_over_median", "slowest_process")}
        self.streak = (
            self.streak + [step] if found["step_time_max_over_median"] > self.threshold else []
        )
        if len(self.streak) != STREAK:  # once per episode: at the third interval in a row
            return fields, ""
        return fields, self._line(found, reports[found["slowest_process"]])

    def _line(self, found: dict, slow: dict) -> str:
        p, part = found["slowest_process"], found["slow_part"]
        parts = ", ".join(f"{name} {slow[k]:.3f}s" for k, name in PARTS.items())
        return (
            f"warning: straggler: process {p} on host {slow['host']} has been"
            f" {found['step_time_max_over_median']:.1f}x slower than the median of the other"
            f" processes for {STREAK} log intervals (steps {self.streak[0]}-{self.streak[-1]},"
            f" --logging.straggler_threshold {self.threshold:g}); its {PARTS[part]} is"
            f" {found['excess_s']:.3f}s per step above theirs ({parts} per step): {_HINTS[part]}"
        )
