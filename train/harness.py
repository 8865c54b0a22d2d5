"""`python -m train.harness ...` and `import train.harness`: lm-evaluation-harness's command line
with the "brigade" model registered (importing train/cli/harness.py registers it; the launcher
is train/cli/harness_launcher.py)."""

import sys

from train.cli.harness import BrigadeLM
from train.cli.harness_launcher import main

__all__ = ["BrigadeLM", "main"]

if __name__ == "__main__":
    sys.exit(main())
