"""The one exception type for bad user input, and the helpers that make every CLI report it in one line.

Anything raised as `UserError` is shown by the CLIs as a single line (no traceback) and exits
with status 2. Every message names the culprit and the valid choices.
"""

import argparse
import functools
import sys
from collections.abc import Callable


class UserError(ValueError):
    """Bad configuration or input, reported to the user as one line."""


def one_line_errors(main):
    """Decorate a CLI's `main(argv) -> exit status`: a UserError becomes `error: ...` on stderr
    and status 2, with no traceback."""

    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    return run


class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`PROG: error: ... (see --help)`) and exit status 2,
    like every other bad input: no usage dump. Every CLI's parser (and subparser) is one.
    `explain_unknown(flag)`, where given, words the error for an option the parser does not know
    (e.g. with the valid options of the flag's config section)."""

    def __init__(self, *args, explain_unknown: Callable[[str], str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.explain_unknown = explain_unknown

    def error(self, message: str):
        if self.explain_unknown and message.startswith("unrecognized arguments:"):
            message = self.explain_unknown(message.split(":", 1)[1].split()[0])
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)
