"""Hangs and lost peers: a step watchdog, and a heartbeat that ends a multi-process job's
processes when one of them is gone.

A hung collective, a stuck data loader or a dead peer leaves the main thread blocked in native
code, where no Python exception will ever reach it. The watchdog thread notices that the loop
stopped making progress, writes every thread's stack to the run dir, says so in one line and
ends the process with WATCHDOG_EXIT, so that a supervisor (or the cluster) can restart the job
from its last checkpoint instead of burning GPU-hours on a hang. Waits that are progress of
their own kind (a checkpoint commit, a restore) run under `Watchdog.waiting`, with their own
limit or none, so a long save never reads as a hung step.

Peers: every process bumps a counter in JAX's coordination service (key-value store) once a
second and reads everyone's counters back (one request). A peer whose counter has not moved for
--parallelism.peer_timeout seconds is gone: the heartbeat thread itself prints the one line
naming it and ends the process with PEER_LOST_EXIT, whatever the main thread is blocked in (a
collective, Orbax's commit barrier, jax.distributed's shutdown barrier), before the
coordination service's own, longer, heartbeat timeout aborts the process from C++. A process
that ends with a configuration error (exit 2) or a divergence (exit 3) publishes it, and its
peers end with the same status, so no supervisor restarts a job that cannot succeed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time

WATCHDOG_EXIT = 4  # no progress for --train.step_timeout seconds
PEER_LOST_EXIT = 5  # a collective failed because another process is gone
_ALIVE = "brigade/alive/"  # + process index: that process's heartbeat counter
_FINAL = "brigade/final/"  # + process index: "<exit status> <one line>" of a final error
_ACK = "brigade/ack/"  # + process index: it saw a peer's final error and is leaving too

# Exactly one line ends a process: the watchdog, the heartbeat and the main thread may reach
# their verdicts at the same moment; the first to take this lock speaks and exits.
_ending = threading.Lock()
# What the main thread is doing, for the line that ends the process ("step 12", "waiting for ...").
_doing = ["start-up"]


def end_process(line: str, code: int, before_exit=None) -> None:
    """Print `line` to stderr and leave with `code` at once (os._exit: the main thread may be
    stuck in native code, and a normal exit would block in jax.distributed's shutdown barrier).
    `before_exit()` runs after the line (e.g. telling the peers). A later caller never returns."""
    if not _ending.acquire(blocking=False):
        threading.Event().wait()  # another thread is ending the process right now
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os.write(2, (line + "\n").encode())  # straight to the descriptor: no wrapper may hold it back
    if before_exit is not None:
        try:
            before_exit()
        except Exception:  # noqa: BLE001  (the line is out; leaving matters more)
            pass
    os._exit(code)


def set_doing(what: str) -> None:
    _doing[0] = what


def doing() -> str:
    """What the main thread was last doing (set_doing, Watchdog.beat): for the line a failure ends
    with."""
    return _doing[0]


class Watchdog:
    """`beat(what)` after every unit of progress; if none comes for `timeout_s`, dump the stacks
    to `stacks_path` (stderr only gets the line naming it) and exit. `describe_peers()` (if
    given) names lost processes."""

    def __init__(self, timeout_s: float, stacks_path: str, describe_peers=None):
        self.timeout_s, self.stacks_path, self.describe_peers = (
            timeout_s,
            stacks_path,
            describe_peers,
        )
        self._last, self._what = time.monotonic(), "start"
        self._wait: tuple[str, float | None] | None = None  # inside waiting(): (what, its limit)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="brigade-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self, what: str) -> None:
        self._last, self._what = time.monotonic(), what
        set_doing(what)

    @contextlib.contextmanager
    def waiting(self, what: str, limit_s: float | None = None):
        """A blocking wait that is not a hung step, e.g. `waiting("the commit of checkpoint step
        8")`: --train.step_timeout does not apply inside; `limit_s` does (None: no limit; a lost
        peer still ends the process through the heartbeat). Leaving counts as progress."""
        outer = self._wait
        self._wait, self._last = (what, limit_s), time.monotonic()
        set_doing(f"waiting for {what}")
        try:
            yield self
        finally:
            self._wait = outer
            self.beat(f"waiting for {what}")

    def _limit(self) -> float | None:
        return self._wait[1] if self._wait is not None else self.timeout_s

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle, limit = time.monotonic() - self._last, self._limit()
            if limit and idle >= limit:
                self._fire(idle, limit)

    def _fire(self, idle: float, limit: float) -> None:
        if self._wait is not None:
            head = f"still waiting for {self._wait[0]} after {idle:.0f}s (limit {limit:g}s)"
        else:
            head = (
                f"no progress for {idle:.0f}s (--train.step_timeout {limit:g}) after {self._what}"
            )
        peers = self.describe_peers() if self.describe_peers else ""
        # the stacks go to the file alone: the screen (and a scheduler's log) gets the one line
        # naming it; only when the file cannot be written do they go to stderr instead
        try:
            with open(self.stacks_path, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f"stacks of all threads in {self.stacks_path}"
        except OSError as e:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            where = f"stacks of all threads above ({self.stacks_path}: {e.strerror or e})"
        end_process(
            f"error: watchdog: {head}{'; ' + peers if peers else ''}; {where}; exiting with status"
            f" {WATCHDOG_EXIT} so the job can restart from its last checkpoint",
            WATCHDOG_EXIT,
        )


def coordination_client():
    """The coordination-service client jax.distributed started, or None (single process)."""
    from jax._src import distributed

    return distributed.global_state.client


class PeerHeartbeat:
    """Each process publishes a counter every `period_s`. With `timeout_s` > 0 the same thread
    watches the peers' counters and ends the process (PEER_LOST_EXIT) once one has not moved for
    `timeout_s` seconds, or with a peer's final error status once one publishes it. `lost()`
    lists the processes whose counter stopped moving (or says the coordinator is unreachable).

    One heartbeat runs per process: entering a second one while one runs reuses the running one."""

    _running: PeerHeartbeat | None = None

    def __init__(self, period_s: float = 1.0, timeout_s: float = 0.0):
        import jax

        self.client = coordination_client()
        self.me, self.n, self.period_s, self.timeout_s = (
            jax.process_index(),
            jax.process_count(),
            period_s,
            timeout_s,
        )
        self._owner = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="brigade-heartbeat", daemon=True)

    def __enter__(self) -> PeerHeartbeat:
        if self.client is not None and self.n > 1 and PeerHeartbeat._running is None:
            PeerHeartbeat._running, self._owner = self, True
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            self._stop.set()
            PeerHeartbeat._running, self._owner = None, False

    def _read(self) -> dict[str, str] | None:
        """Every brigade key in the coordination service (one request), or None if it does not
        answer."""
        try:
            return dict(self.client.key_value_dir_get("brigade/"))
        except Exception:  # noqa: BLE001  (the service is gone, or shutting down)
            return None

    def _run(self) -> None:
        count, started = 0, time.monotonic()
        changed: dict[int, tuple[str | None, float]] = {
            p: (None, started) for p in range(self.n) if p != self.me
        }
        answered = started
        while not self._stop.is_set():
            try:
                self.client.key_value_set(f"{_ALIVE}{self.me}", str(count), allow_overwrite=True)
            except Exception:  # noqa: BLE001  (coordinator unreachable: counted below)
                pass
            count += 1
            now, keys = time.monotonic(), self._read()
            if keys is not None:
                answered = now
                for p, (value, _) in changed.items():
                    if keys.get(f"{_ALIVE}{p}") != value:
                        changed[p] = (keys.get(f"{_ALIVE}{p}"), now)
                self._follow_final_error(keys)
            if self.timeout_s > 0 and not self._stop.is_set():
                self._check(now, answered, changed)
            self._stop.wait(self.period_s)

    def _check(
        self, now: float, answered: float, changed: dict[int, tuple[str | None, float]]
    ) -> None:
        gone = [p for p, (_, since) in changed.items() if now - since >= self.timeout_s]
        if now - answered >= self.timeout_s:
            what = "lost the coordinator (process 0): the coordination service has not answered"
        elif gone:
            what = f"lost peer process(es) {', '.join(map(str, gone))}: no heartbeat"
        else:
            return
        end_process(
            f"error: process {self.me}: {what} for {self.timeout_s:g}s"
            f" (--parallelism.peer_timeout); last activity here: {_doing[0]}; exiting with status"
            f" {PEER_LOST_EXIT}: restart every process to resume from the last checkpoint",
            PEER_LOST_EXIT,
        )

    def _follow_final_error(self, keys: dict[str, str]) -> None:
        """A peer ended with a final status (2: configuration or input error, 3: diverged): end this
        process with the same status, so that no supervisor restarts a job that cannot succeed."""
        for key, value in sorted(keys.items()):
            if key.startswith(_FINAL) and key != f"{_FINAL}{self.me}":
                code, _, line = value.partition(" ")

                def ack():
                    self.client.key_value_set(f"{_ACK}{self.me}", "1", allow_overwrite=True)
                    _wait_for_peers(self.client, self.me, self.n)

                end_process(
                    f"error: process {self.me}: stopping because process {key[len(_FINAL) :]}"
                    f" ended with status {code}: {line.removeprefix('error: ')}",
                    int(code),
                    ack,
                )

    def lost(self) -> str:
        """'' if every peer is alive, else one phrase naming the lost ones (takes ~3 periods)."""
        if self.client is None or self.n == 1:
            return ""
        before = self._read()
        if before is None:
            return "lost the coordinator (process 0): the coordination service does not answer"
        time.sleep(3 * self.period_s)
        after = self._read() or {}
        gone = [
            p
            for p in range(self.n)
            if p != self.me and before.get(f"{_ALIVE}{p}") == after.get(f"{_ALIVE}{p}")
        ]
        return (
            f"lost peer process(es) {', '.join(map(str, gone))} (no heartbeat for"
            f" {3 * self.period_s:.0f}s)"
            if gone
            else ""
        )


def end_job(line: str, code: int) -> None:
    """A final error (configuration or input: 2; diverged: 3) in this process: print `line`, tell
    the peers (their heartbeats end them with the same status) and leave."""
    client = coordination_client()
    if client is None:
        end_process(line, code)

    def tell_peers():
        import jax

        client.key_value_set(
            f"{_FINAL}{jax.process_index()}", f"{code} {line}", allow_overwrite=True
        )
        _wait_for_peers(client, jax.process_index(), jax.process_count())

    end_process(line, code, tell_peers)


def _wait_for_peers(client, me: int, n: int, wait_s: float = 5.0) -> None:
    """Process 0 hosts the coordination service, whose end aborts every peer still connected
    (from C++, exit 134, which a supervisor restarts): before leaving with a final status it waits
    up to `wait_s` for each peer to acknowledge it or to report a final error of its own."""
    deadline = time.monotonic() + wait_s
    while me == 0 and n > 1 and time.monotonic() < deadline:
        keys = dict(client.key_value_dir_get("brigade/"))
        if all(f"{_ACK}{p}" in keys or f"{_FINAL}{p}" in keys for p in range(1, n)):
            time.sleep(0.5)  # an acknowledging peer leaves right after it wrote its key
            return
        time.sleep(0.1)
