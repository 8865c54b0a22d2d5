"""`python -m train [flags]` trains; `python -m train plan [flags]` compiles and reports only;
`python -m train doctor [flags]` checks the run those flags describe before it runs (plan/doctor/);
`python -m train report RUN_DIR` renders a run's plots and summary; `python -m train eval CKPT
--data DIR` evaluates a checkpoint (train/cli/evaluate.py); `python -m train sample CKPT --prompt
TEXT` generates with it (train/cli/sample.py)."""

from __future__ import annotations

import os
import signal
import sys

from errors import quiet_closed_stdout


@quiet_closed_stdout  # `python -m train ... | head`: the run goes on, its lines go nowhere
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from errors import UserError

    if argv[:1] not in (["plan"], ["report"]):
        from checkpoint.echoes import QuietClosedLoopEchoes

        sys.stderr = QuietClosedLoopEchoes(sys.stderr)
    try:
        from mesh.xla import apply_argv

        # XLA reads its flags when jax starts a backend: before any import of jax
        apply_argv(argv, os.environ)
        if argv and argv[0] == "plan":
            from plan.cli import main as plan_main

            return plan_main(argv[1:])
        if argv and argv[0] == "doctor":
            from plan.doctor.main import main as doctor_main

            return doctor_main(argv[1:])
        if argv and argv[0] == "report":
            from train.cli.report import main as report_main

            return report_main(argv[1:])
        if argv and argv[0] == "eval":
            from train.cli.evaluate import main as eval_main

            return eval_main(argv[1:])
        if argv and argv[0] == "sample":
            from train.cli.sample import main as sample_main

            return sample_main(argv[1:])
        return _run(argv)
    except UserError as e:
        return final_error(f"error: {e}", 2, exit_now=getattr(e, "exit_now", False))
    except Exception as e:
        from train.run.resilience import DIVERGED_EXIT, Diverged

        if not isinstance(e, Diverged):
            raise
        return final_error(f"error: {e}", DIVERGED_EXIT)


def _run(argv: list[str]) -> int:
    """`python -m train [flags]`: the config, the fault drills' check and the run's directory,
    then the run itself, under the supervisor with --max-restarts."""
    from train.core.config import from_args
    from train.run import faults
    from train.run.named_runs import start_named_run, withdraw_named_run

    cfg, _ = from_args(argv)
    faults.current().check(cfg.train.steps)  # before the run directory is made
    # once, before any child: every restart continues this one directory
    named = start_named_run(cfg)
    if not cfg.train.max_restarts or os.environ.get("BRIGADE_SUPERVISED"):
        return _train(named)
    from checkpoint import storage
    from train.run.supervisor import Fresh, supervise

    c = named.checkpoint
    fresh = Fresh(named.logging.run_dir, c.resume) if named is not cfg else None
    ckpt_dir = c.dir or storage.join(named.logging.run_dir, "checkpoints")
    if cfg.train.elastic:
        from train.run.elastic_supervisor import supervise_elastic

        code = supervise_elastic(argv, cfg, named.logging.run_dir, ckpt_dir, fresh)
    else:
        code = supervise(argv, cfg.train.max_restarts, named.logging.run_dir, ckpt_dir, fresh=fresh)
    withdraw_named_run(named)  # a child refused before writing: no empty runs/<name>
    return code


def _train(cfg) -> int:
    """Join the job and build the mesh (mesh.build.start_mesh), then train with the peer
    heartbeat running from before the first cross-process wait (restore barriers, compile,
    steps, saves) to after the last one (jax.distributed's shutdown barrier): a peer lost
    anywhere in between ends this process with one line and PEER_LOST_EXIT within
    --parallelism.peer_timeout."""
    from mesh.build import start_mesh
    from train.run.elastic import record_origin
    from train.run.loop import Trainer
    from train.run.watchdog import PeerHeartbeat

    mesh = start_mesh(cfg.parallelism)
    record_origin(cfg, mesh)  # an elastic job's first layout, re-planned from after a loss
    with PeerHeartbeat(timeout_s=cfg.parallelism.peer_timeout):
        try:
            # 143 / 130 after SIGTERM / SIGINT, checkpoint committed
            code = Trainer(cfg, mesh=mesh).fit()["exit_code"]
        except Exception as e:  # noqa: BLE001
            _exit_if_peer_lost(e)
            raise
        _leave_job()
    return code


def _leave_job() -> None:
    """jax.distributed's shutdown barrier, passed while the heartbeat still runs (at interpreter
    exit it would not be: a peer dying now would leave this process to JAX's C++ abort)."""
    import jax

    if not jax.distributed.is_initialized():
        return
    from train.run import faults
    from train.run.watchdog import set_doing

    if jax.process_index() in faults.current().kill_at_shutdown:
        # fault injection: a process that dies after the run finished
        os.kill(os.getpid(), signal.SIGKILL)
    set_doing("waiting in jax.distributed's shutdown barrier (the run had finished)")
    jax.distributed.shutdown()


def final_error(line: str, code: int, exit_now: bool = False) -> int:
    """A configuration/input error (2) or a divergence (3): restarting cannot help. In a
    multi-process job every process must end with this status (a peer left blocked would be
    declared lost, exit 5, and restarted by its supervisor): tell them and leave at once."""
    if "jax" in sys.modules:
        import jax

        if jax.distributed.is_initialized():
            from train.run.watchdog import end_job

            end_job(line, code)
    print(line, file=sys.stderr)
    if exit_now:  # e.g. a failed save: its I/O still in flight would print noise at exit
        _exit_now(code)
    return code


def _exit_if_peer_lost(e: Exception) -> None:
    """An error in a multi-process job is most often a cross-process wait whose peer is gone (a
    collective's JaxRuntimeError, or a checkpoint save that failed in Orbax's barrier and reads
    as a SaveFailed): name the peer (from the heartbeats) and leave with PEER_LOST_EXIT, a crash
    to restart, rather than a traceback, a final status 2, or a hang in the shutdown barrier."""
    import jax

    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return
    from checkpoint.integrity import cross_process_failure
    from train.run.watchdog import PEER_LOST_EXIT, PeerHeartbeat, end_process

    lost = PeerHeartbeat().lost()
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    # every peer alive, but one came too late to a collective
    if not lost and cross_process_failure(e):
        end_process(
            f"error: process {jax.process_index()}: a cross-process wait timed out with every peer"
            f" alive ({first}): a peer is slower (compile, I/O, load) than"
            f" --parallelism.peer_timeout allows; raise it; exiting with status {PEER_LOST_EXIT}:"
            " restart every process to resume from the last checkpoint",
            PEER_LOST_EXIT,
        )
    if not lost:
        return
    end_process(
        f"error: process {jax.process_index()}: {lost}; the step failed ({first}); exiting with"
        f" status {PEER_LOST_EXIT}: restart every process to resume from the last checkpoint",
        PEER_LOST_EXIT,
    )


def _exit_now(code: int) -> None:
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
