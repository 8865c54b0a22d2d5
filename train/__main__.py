"""`python -m train [flags]` trains; `python -m train plan [flags]` compiles and reports only."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from mesh.errors import UserError
    try:
        if argv and argv[0] == "plan":
            from train.plan import main as plan_main
            return plan_main(argv[1:])
        from train.config import from_args
        cfg, _ = from_args(argv)
        from train.loop import Trainer
        Trainer(cfg).fit()
        return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
