"""`python -m train.harness ...` and `import train.harness`: lm-evaluation-harness's command line
with the "brigade" model registered (importing train/cli/harness.py registers it)."""

import sys

from train.cli.harness import BrigadeLM, main

__all__ = ["BrigadeLM", "main"]

if __name__ == "__main__":
    sys.exit(main())
