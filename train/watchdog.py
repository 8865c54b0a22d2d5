"""Hangs and lost peers: a step watchdog, and naming the process a multi-process job lost.

A hung collective, a stuck data loader or a dead peer leaves the main thread blocked in native
code, where no Python exception will ever reach it. The watchdog thread notices that the loop
stopped making progress, writes every thread's stack to the run dir, says so in one line and
ends the process with WATCHDOG_EXIT, so that a supervisor (or the cluster) can restart the job
from its last checkpoint instead of burning GPU-hours on a hang.

Peers: every process bumps a counter in JAX's coordination service (key-value store) once a
second. When a collective fails or the watchdog fires in a multi-process job, the counters that
stopped moving name the lost processes.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

WATCHDOG_EXIT = 4    # no progress for --train.step_timeout seconds
PEER_LOST_EXIT = 5   # a collective failed because another process is gone
_KEY = "brigade/alive/{}"


class Watchdog:
    """`beat(what)` after every unit of progress; if none comes for `timeout_s`, dump the stacks
    to `stacks_path` (and stderr) and exit. `describe_peers()` (if given) names lost processes."""

    def __init__(self, timeout_s: float, stacks_path: str, describe_peers=None):
        self.timeout_s, self.stacks_path, self.describe_peers = timeout_s, stacks_path, describe_peers
        self._last, self._what = time.monotonic(), "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="brigade-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self, what: str) -> None:
        self._last, self._what = time.monotonic(), what

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            idle = time.monotonic() - self._last
            if idle >= self.timeout_s:
                self._fire(idle)

    def _fire(self, idle: float) -> None:
        with open(self.stacks_path, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        peers = self.describe_peers() if self.describe_peers else ""
        print(f"error: watchdog: no progress for {idle:.0f}s (--train.step_timeout {self.timeout_s:g}) after"
              f" {self._what}{'; ' + peers if peers else ''}; stacks of all threads in {self.stacks_path};"
              f" exiting with status {WATCHDOG_EXIT} so the job can restart from its last checkpoint",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(WATCHDOG_EXIT)  # the main thread is stuck in native code: nothing else gets it out


class PeerHeartbeat:
    """Each process publishes a counter every `period_s`; `lost()` lists the processes whose
    counter stopped moving (or says the coordinator itself is unreachable)."""

    def __init__(self, period_s: float = 1.0):
        import jax
        from jax._src import distributed  # the coordination-service client jax.distributed started
        self.client = distributed.global_state.client
        self.me, self.n, self.period_s = jax.process_index(), jax.process_count(), period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="brigade-heartbeat", daemon=True)

    def __enter__(self) -> "PeerHeartbeat":
        if self.client is not None and self.n > 1:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _run(self) -> None:
        count = 0
        while not self._stop.is_set():
            try:
                self.client.key_value_set(_KEY.format(self.me), str(count), allow_overwrite=True)
            except Exception:  # noqa: BLE001  (coordinator gone: lost() reports it)
                return
            count += 1
            self._stop.wait(self.period_s)

    def _counters(self) -> dict[int, str | None]:
        out = {}
        for p in range(self.n):
            if p != self.me:
                try:
                    out[p] = self.client.key_value_try_get(_KEY.format(p))
                except Exception:  # noqa: BLE001  (not found yet, or the service is gone)
                    out[p] = None
        return out

    def lost(self) -> str:
        """'' if every peer is alive, else one phrase naming the lost ones (takes ~3 periods)."""
        if self.client is None or self.n == 1:
            return ""
        try:
            self.client.key_value_try_get(_KEY.format(self.me))
        except Exception:  # noqa: BLE001
            return "lost the coordinator (process 0): the coordination service does not answer"
        before = self._counters()
        time.sleep(3 * self.period_s)
        after = self._counters()
        gone = [p for p in before if before[p] == after[p]]
        return f"lost peer process(es) {', '.join(map(str, gone))} (no heartbeat for {3 * self.period_s:.0f}s)" \
            if gone else ""
