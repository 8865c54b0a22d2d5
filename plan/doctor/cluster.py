"""The doctor's checks of the cluster: the coordinator reachable within a timeout, every process
joined, and the union of every process's checklist on process 0.

jax.distributed never reports a coordinator that does not answer or a process that never comes:
its C++ aborts the process after its own timeout, without a word a person can act on. So a
process other than 0 first knocks on the coordinator's port itself (a TCP connection, retried
until the timeout), and the join runs under a timer that, when it expires, prints the checklist
so far with the FAIL line naming the host and port, and ends the process before JAX aborts it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import threading
import time

from plan.doctor.report import Check, fail, ok

KEY = "brigade/doctor/"  # + process index: that process's checklist and facts


def split_address(coordinator: str) -> tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    return host, int(port)


def knock(coordinator: str, timeout_s: float) -> Check:
    """A TCP connection to the coordinator, retried until `timeout_s`: process 0 listens there."""
    host, port = split_address(coordinator)
    deadline, why = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(
                (host, port), timeout=max(0.1, deadline - time.monotonic())
            ):
                return ok("coordinator", f"{host}:{port} answers")
        except OSError as e:
            why = e.strerror or str(e)
        time.sleep(0.2)
    return fail(
        "coordinator",
        f"{host}:{port} did not answer within {timeout_s:g}s ({why})",
        f"start process 0 with --coordinator {host}:{port} (it listens there), and open port"
        f" {port} between the hosts; --doctor-timeout S waits longer",
    )


def bindable(coordinator: str) -> Check:
    """Process 0 hosts the coordination service: its port must be free on this host."""
    host, port = split_address(coordinator)
    bind_host = host if host.startswith(("127.", "localhost")) else ""
    with socket.socket() as s:
        try:
            s.bind((bind_host, port))
        except OSError as e:
            busy = e.errno == errno.EADDRINUSE
            return fail(
                "coordinator",
                f"process 0 cannot listen on port {port} ({e.strerror or e})",
                "stop what holds the port (`ss -ltnp`) or choose another --coordinator port"
                if busy
                else "choose a --coordinator host:port this host can listen on",
            )
    return ok("coordinator", f"process 0 can listen on {host}:{port}")


class JoinTimer:
    """While the job is joined: if `timeout_s` passes first, `on_expiry()` speaks and the process
    ends (status 1), before jax.distributed's own, longer, timeout aborts it from C++."""

    def __init__(self, timeout_s: float, on_expiry):
        self._done = threading.Event()
        self._timeout_s, self._on_expiry = timeout_s, on_expiry

    def __enter__(self) -> JoinTimer:
        threading.Thread(target=self._watch, name="brigade-doctor-join", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def _watch(self) -> None:
        if not self._done.wait(self._timeout_s):
            self._on_expiry()
            sys.stdout.flush()
            os._exit(1)


def not_joined(coordinator: str, processes: int, me: int, timeout_s: float) -> Check:
    host, port = split_address(coordinator)
    return fail(
        "processes joined",
        f"not every one of the {processes} processes joined the coordinator {host}:{port} within"
        f" {timeout_s:g}s (this is process {me}); JAX cannot say which are missing",
        "start every process with the same --coordinator and --num-processes and its own"
        " --process-id; a process that cannot reach the coordinator names it in its own FAIL line",
    )


def exchange(me: int, n: int, mine: dict, timeout_s: float) -> dict[int, dict] | None:
    """Every process publishes its checklist and facts; process 0 reads them all -> by process
    (process 0), or None (the others, which print nothing more)."""
    from train.run.watchdog import coordination_client

    client = coordination_client()
    if client is None or n == 1:
        return {0: mine}
    client.key_value_set(f"{KEY}{me}", json.dumps(mine), allow_overwrite=True)
    if me != 0:
        return None
    out = {}
    for p in range(n):
        raw = client.blocking_key_value_get(f"{KEY}{p}", int(timeout_s * 1000))
        out[p] = json.loads(raw)
    return out
