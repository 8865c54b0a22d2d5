"""Preemption: SIGTERM and SIGINT ask the loop to finish its step, checkpoint and stop.

The exit status follows the shell convention, 128 + the signal number: 143 after SIGTERM, 130
after SIGINT. A second SIGINT raises KeyboardInterrupt at once (a committed checkpoint is never
damaged by that: Orbax renames a step into place only when it is complete).

With several processes, SIGTERM is left to JAX's preemption service (started by
jax.distributed.initialize; its C++ handler owns SIGTERM), and `reached_preemption_sync_point`
makes every process stop at the same step. SIGINT keeps Python's default there: a flag set in
one process alone would make it save while its peers wait in the next step's collectives.
"""

from __future__ import annotations

import signal
import threading


class StopSignals:
    """Context manager: while active, `requested(step)` returns the signal that asked to stop
    (signal.SIGTERM or signal.SIGINT) once it is time to stop, else None. Call it after every
    step."""

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, object] = {}
        self._multi = False

    def __enter__(self) -> StopSignals:
        import jax

        self._multi = jax.process_count() > 1
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may install handlers (e.g. fit() in a worker thread)
        for sig in () if self._multi else (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: stop now, without waiting for the save
        self.received = self.received or signum

    def requested(self, step: int) -> int | None:
        if self._multi:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                self.received = signal.SIGTERM
            return self.received
        return self.received


def exit_code(signum: int | None) -> int:
    return 0 if signum is None else 128 + int(signum)


class Diverged(RuntimeError):
    """Too many skipped steps in a row (non-finite or spikes) and no checkpoint to go back to (exit
    status 3)."""


DIVERGED_EXIT = 3
