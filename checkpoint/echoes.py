"""Keep the echoes of an Orbax/tensorstore failure out of the one-line error output (no JAX
import)."""

from __future__ import annotations

import io
import logging
import sys
import threading


class QuietClosedLoopEchoes(io.TextIOBase):
    """A stderr wrapper. After a failed save or restore, tensorstore completes the writes/reads
    still in flight into Orbax's already-closed asyncio loop, and each completion prints a
    traceback ending in 'RuntimeError: Event loop is closed' (printed directly, not through
    sys.excepthook). They echo an error the CLI already reports in one line; this drops exactly
    those traceback blocks and passes everything else through unchanged and unbuffered. Blocks are
    kept per thread: another thread's log line may land in the middle of a traceback."""

    _START = "Traceback (most recent call last):"
    _ECHO = "RuntimeError: Event loop is closed"

    def __init__(self, stream):
        self.stream, self._blocks = stream, {}  # thread id -> the traceback text so far

    def write(self, text: str) -> int:
        me = threading.get_ident()
        if me not in self._blocks:
            i = text.find(self._START)
            if i < 0:
                return self.stream.write(text)
            self.stream.write(text[:i])
            self._blocks[me], text = "", text[i:]
        self._blocks[me] += text
        lines = self._blocks[me].split("\n")
        for n, line in enumerate(lines[1:-1], start=1):  # complete lines after the 'Traceback' one
            if line and not line[0].isspace():  # the exception line ends the block
                block, rest = "\n".join(lines[: n + 1]) + "\n", "\n".join(lines[n + 1 :])
                del self._blocks[me]
                if line.strip() != self._ECHO:
                    self.stream.write(block)
                if rest:
                    self.write(rest)
                break
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def _is_echo(unraisable) -> bool:
    """Whether an unraisable exception only echoes a failed Orbax read that was already raised to
    the caller: tensorstore completing a read into Orbax's closed asyncio loop, or an Orbax read
    coroutine that a failed restore left behind ('Encountered error while reading array index')."""
    e, tb = unraisable.exc_value, unraisable.exc_traceback
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
        return "call_soon_threadsafe" in frames
    return type(e) is Exception and str(e).startswith("Encountered error while reading array index")


class _UnretrievedReadErrors(logging.Filter):
    """asyncio's 'Future exception was never retrieved' for a tensorstore error: the other reads of
    a failed restore, which failed too but whose futures nobody awaited once the first error ended
    the restore. Every other asyncio record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        e = record.exc_info[1] if record.exc_info else None
        return not (
            e is not None
            and "exception was never retrieved" in str(record.msg)
            and "[tensorstore_spec=" in str(e)
        )


def quiet_failed_read_echoes() -> None:
    """Install (once) what drops the echoes of a failed read and passes everything else on: a
    restore that fails on a damaged file raises at the first failed read while the others are still
    in flight, and each of them would then print a traceback (through sys.unraisablehook or the
    asyncio logger) after the one line that already named the step and the file."""
    previous = sys.unraisablehook
    if not getattr(previous, "drops_orbax_echoes", False):

        def hook(unraisable) -> None:
            if not _is_echo(unraisable):
                previous(unraisable)

        hook.drops_orbax_echoes = True
        sys.unraisablehook = hook
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _UnretrievedReadErrors) for f in log.filters):
        log.addFilter(_UnretrievedReadErrors())
