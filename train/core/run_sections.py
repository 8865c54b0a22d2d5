"""The sections the run around the step reads, `logging` and `checkpoint`, and whether this
machine can honour the logging options (a tracker installed, TensorBoard's writer for a URL run
directory, W&B's mode): checked when the Config is built, before anything starts."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys

from errors import UserError
from models.fields import check_ranges, option, ranged
from train.core.flags import public_flag

PROGRESS = ("auto", "bar", "lines", "none")
# Older configs and scripts say true/false (the option was a bool): the same as auto/none.
PROGRESS_ALIASES = {"true": "auto", "false": "none"}
# what wandb accepts in WANDB_MODE (wandb.sdk.wandb_settings.Settings.mode); set to anything else,
# even empty, wandb.init fails with a pydantic traceback
WANDB_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")
# tensorboardX writes a URL run directory's events itself, with these (gcsfs brings the first):
# scheme -> (module, package, the extra that installs it)
TENSORBOARD_BACKENDS = {
    "gs://": ("google.cloud.storage", "google-cloud-storage", "gcs"),
    "s3://": ("boto3", "boto3", "s3"),
}


def progress_mode(value: str, stream=None) -> str:
    """--logging.progress -> bar, lines or none; auto is a bar on a terminal (`stream`, default
    stderr, where tqdm draws) and lines elsewhere: a bar's carriage returns make a file
    unreadable."""
    mode = PROGRESS_ALIASES.get(str(value).strip().lower(), str(value).strip().lower())
    if mode not in PROGRESS:
        raise UserError(f"--logging.progress: '{value}' is not one of {', '.join(PROGRESS)}")
    if mode == "auto":
        stream = stream if stream is not None else sys.stderr
        return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"
    return mode


def check_tracker(flag: str, module: str, extra: str) -> None:
    """UserError unless `module` can be imported (checked without importing it: that is slow)."""
    if importlib.util.find_spec(module) is None:
        raise UserError(
            f"{flag}: the {module} package is not installed; pip install 'brigade[{extra}]', or"
            f" leave {flag} empty"
        )


def check_tensorboard(run_dir: str) -> None:
    """UserError when TensorBoard events cannot be written to a URL `run_dir` for lack of the
    package tensorboardX writes it with (it would raise ImportError when the run starts)."""
    for scheme, (module, package, extra) in TENSORBOARD_BACKENDS.items():
        if not run_dir.startswith(scheme):
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # its parent package (google.cloud) is missing too
            found = False
        if not found:
            raise UserError(
                f"--logging.tensorboard: TensorBoard events in {run_dir} need the {package}"
                f" package, which is not installed; pip install {package} (or pip install"
                f" 'brigade[{extra}]'), or --logging.tensorboard false"
            )


def check_wandb_mode(env=None) -> None:
    """UserError unless WANDB_MODE is unset or one of WANDB_MODES (checked at the config's
    validation, before the run starts, rather than when wandb.init reads it)."""
    mode = (os.environ if env is None else env).get("WANDB_MODE")
    if mode is not None and mode not in WANDB_MODES:
        raise UserError(
            f"WANDB_MODE={mode!r} (with --logging.wandb): not a W&B mode; valid: "
            f"{', '.join(WANDB_MODES)}, or unset it"
        )


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """The `logging` section: the run directory and what is reported while training."""

    run_dir: str = option(
        "runs/latest",
        "where the run writes its config, metrics, logs and checkpoints; the"
        " default gives each run a fresh runs/<YYYYmmdd-HHMMSS>-<model>-<mesh>"
        " and makes runs/latest a link to it; gs:// and s3:// work too",
    )
    log_every: int = ranged(10, ">=1", help="steps between metric lines")
    tensorboard: bool = option(True, "also write TensorBoard event files")
    progress: str = option(
        "auto",
        "auto | bar | lines | none: a tqdm bar, one plain line per logged step (for"
        " cluster log files), or neither; auto = bar when stderr is a terminal, else"
        " lines; true/false = auto/none",
    )
    wandb: str = option(
        "",
        "PROJECT: also log to this Weights & Biases project (pip install 'brigade[wandb]');"
        " <run_dir>/wandb_id keeps the run id, so a resumed run continues it; empty = off",
    )
    peak_tflops: float = ranged(
        0.0,
        ">=0",
        help="per-device peak TFLOP/s for MFU; 0 = from the device table (measured on CPU)",
    )
    straggler_threshold: float = ranged(
        1.5,
        ">1",
        help="warn when the slowest process's step time stays above this"
        " many times the median of the others for 3 log intervals",
    )

    def validate(self) -> LoggingConfig:
        check_ranges(self, functools.partial(public_flag, "logging"))
        from checkpoint.storage import require_backend

        progress_mode(self.progress)
        require_backend(self.run_dir, "--run-dir")  # gs:// without gcsfs: one line, at once
        if self.tensorboard:
            check_tensorboard(self.run_dir)
        if self.wandb:
            check_tracker("--logging.wandb", "wandb", "wandb")
            check_wandb_mode()
        return self


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The `checkpoint` section: when checkpoints are saved, which are kept, and where a run starts
    from."""

    dir: str = option("", "directory of the run's checkpoints (empty: the default)")
    every: int = ranged(50, ">=0", help="steps between saves; 0 = only the final save")
    keep: int = ranged(3, ">=0", help="the latest K checkpoints are kept; 0 = keep all")
    keep_every: int = ranged(
        0, ">=0", help="steps divisible by this are kept forever (recovery points); 0 = none"
    )
    # the option is `async` (flag and YAML): a Python keyword cannot be a field
    async_save: bool = option(True, "save in the background while training goes on")
    resume: str = option(
        "auto",
        "auto = the run dir's own newest intact checkpoint, if any | latest = continue"
        " the newest run under runs/ (its settings must match; with an explicit --run-dir:"
        " as auto) | none | PATH (a run dir, a checkpoint dir or one step's dir)",
    )
    init_from: str = option(
        "",
        "PATH: start a fresh run from these parameters (e.g. an HF import), with a fresh optimizer",
    )
    adopt: bool = option(
        False,
        "save into a --checkpoint.dir that belongs to another run, continuing from its"
        " steps (which this run then never deletes)",
    )
    local_dir: str = option(
        "",
        "host-local directory (fast disk, RAM disk) for frequent saves, each process"
        " its own copy in <local_dir>/process-<i>; empty = no local tier",
    )
    local_every: int = ranged(
        10, ">=0", help="steps between local-tier saves (>= 1 with local_dir)"
    )
    local_keep: int = ranged(
        2, ">=1", help="the latest K local-tier steps are kept on each process"
    )
    local_peer: bool = option(
        True,
        "with several processes: each process also keeps the previous process's local copy"
        " (<local_dir>/process-<i>-peer), so that losing one host's disk loses no local step",
    )

    def validate(self) -> CheckpointConfig:
        check_ranges(self, functools.partial(public_flag, "checkpoint"))
        from checkpoint.storage import require_backend

        require_backend(self.dir, "--checkpoint.dir")
        if not self.resume:
            raise UserError("--resume: expected auto, latest, none or a checkpoint PATH, got ''")
        if self.local_dir and self.local_every < 1:
            raise UserError(
                f"--checkpoint.local_every {self.local_every}: must be >= 1 when"
                f" --checkpoint.local_dir is set (steps between local saves)"
            )
        return self
