"""`python -m train [flags]` trains; `python -m train plan [flags]` compiles and reports only."""
from __future__ import annotations

import os
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
        return Trainer(cfg).fit()["exit_code"]  # 143 / 130 after SIGTERM / SIGINT (checkpoint committed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        _exit_now_if_distributed(2)
        return 2
    except Exception as e:
        from train.resilience import DIVERGED_EXIT, Diverged
        if not isinstance(e, Diverged):
            raise
        print(f"error: {e}", file=sys.stderr)
        _exit_now_if_distributed(DIVERGED_EXIT)
        return DIVERGED_EXIT


def _exit_now_if_distributed(code: int) -> None:
    """In a multi-process job a normal interpreter exit blocks in jax.distributed's shutdown
    barrier until every peer arrives (or the heartbeat times out); a configuration error must
    not hang for that long, so leave at once."""
    import jax
    if jax.distributed.is_initialized():
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
