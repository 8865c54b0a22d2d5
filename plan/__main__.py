"""`python -m plan [flags]`, the same as `python -m train plan [flags]` (plan/cli.py)."""

from __future__ import annotations

import os
import sys

from errors import one_line_errors


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from mesh.xla import apply_argv

    # XLA reads its flags when jax starts a backend: before any import of jax
    apply_argv(argv, os.environ)
    from plan.cli import main as plan_main

    return plan_main(argv)


if __name__ == "__main__":
    sys.exit(main())
