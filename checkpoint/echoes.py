"""Keep the echoes of an Orbax/tensorstore failure out of the one-line error output (no JAX import)."""
from __future__ import annotations

import io
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
                block, rest = "\n".join(lines[:n + 1]) + "\n", "\n".join(lines[n + 1:])
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
