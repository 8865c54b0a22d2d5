"""`python -m train [flags]` trains; `python -m train plan [flags]` compiles and reports only;
`python -m train report RUN_DIR` renders a run's plots and summary."""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from mesh.errors import UserError
    if argv[:1] not in (["plan"], ["report"]):
        from checkpoint.echoes import QuietClosedLoopEchoes
        sys.stderr = QuietClosedLoopEchoes(sys.stderr)
    try:
        from mesh.xla import apply_argv
        apply_argv(argv, os.environ)  # XLA reads its flags when jax starts a backend: before any import of jax
        if argv and argv[0] == "plan":
            from train.plan import main as plan_main
            return plan_main(argv[1:])
        if argv and argv[0] == "report":
            from train.report import main as report_main
            return report_main(argv[1:])
        from train.config import from_args
        cfg, _ = from_args(argv)
        if cfg.train.max_restarts and not os.environ.get("BRIGADE_SUPERVISED"):
            from train.supervisor import supervise
            c = cfg.checkpoint
            return supervise(argv, cfg.train.max_restarts, cfg.logging.run_dir,
                             c.dir or os.path.join(cfg.logging.run_dir, "checkpoints"))
        from train.loop import Trainer
        try:
            return Trainer(cfg).fit()["exit_code"]  # 143 / 130 after SIGTERM / SIGINT (checkpoint committed)
        except Exception as e:  # noqa: BLE001
            _exit_if_peer_lost(e)
            raise
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        if getattr(e, "exit_now", False):  # e.g. a failed save: its I/O still in flight would print noise at exit
            _exit_now(2)
        _exit_now_if_distributed(2)
        return 2
    except Exception as e:
        from train.resilience import DIVERGED_EXIT, Diverged
        if not isinstance(e, Diverged):
            raise
        print(f"error: {e}", file=sys.stderr)
        _exit_now_if_distributed(DIVERGED_EXIT)
        return DIVERGED_EXIT


def _exit_if_peer_lost(e: Exception) -> None:
    """A runtime error in a multi-process job is most often a collective whose peer is gone: name
    it (from the heartbeats) and leave with PEER_LOST_EXIT rather than a traceback and a hang in
    the shutdown barrier."""
    import jax
    if not jax.distributed.is_initialized() or jax.process_count() == 1 \
            or not isinstance(e, jax.errors.JaxRuntimeError):
        return
    from train.watchdog import PEER_LOST_EXIT, PeerHeartbeat
    lost = PeerHeartbeat().lost()
    if not lost:
        return
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    print(f"error: process {jax.process_index()}: {lost}; the step failed ({first}); exiting with status"
          f" {PEER_LOST_EXIT}: restart every process to resume from the last checkpoint", file=sys.stderr)
    _exit_now_if_distributed(PEER_LOST_EXIT)


def _exit_now_if_distributed(code: int) -> None:
    """In a multi-process job a normal interpreter exit blocks in jax.distributed's shutdown
    barrier until every peer arrives (or the heartbeat times out); a configuration error must
    not hang for that long, so leave at once."""
    import jax
    if jax.distributed.is_initialized():
        _exit_now(code)


def _exit_now(code: int) -> None:
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
