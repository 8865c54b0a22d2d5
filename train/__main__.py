"""`python -m train ...`: the command line, whose code is train/cli/main.py."""

import sys

from train.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
