"""The runs/ folder of named runs: without --run-dir (the default `runs/latest`) each run gets a
fresh directory `runs/<YYYYmmdd-HHMMSS>-<model>-<mesh>` and `runs/latest` becomes a symbolic link
to it (`start_named_run`); `--resume latest` continues the newest run when its settings match
(`changed_settings`); which run is the newest when `runs/latest` no longer leads to one; and
taking back a named directory that a refused run made.

`runs/latest` is a symbolic link to the newest named run. It dangles once its target is deleted
or moved (a user cleaning up a failed run, a sync that skipped it). `--resume latest` means
"continue the newest run"; it never writes into the run it continues (the continuation gets a
directory of its own and only reads the checkpoint), so falling back to the newest run that
still exists is safe, and it is what the link would have named had the missing run never been.
The settings check of `--resume latest` then applies to that run as to any other.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import sys

from errors import UserError
from mesh.spec import AXES, parse_spec
from train.run.rundir import oserror_text

# <YYYYmmdd-HHMMSS>-<model>-<mesh>[-N]: the names start_named_run gives (run_name)
_NAMED = re.compile(r"^\d{8}-\d{6}-")
# a named run directory this process made -> the target `runs/latest` had before (None: no link)
_made: dict[str, str | None] = {}
# logging.run_dir's default: a fresh named run under runs/
DEFAULT_RUN_DIR = os.path.join("runs", "latest")
# The environments in which jax.distributed joins a multi-process job by itself (mesh/build.py).
_CLUSTER_ENVS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_ADDRESS")


def newest_run(root: str) -> str | None:
    """The newest named run under `root` that exists and has started (its config.json): by the
    start time in its name, then by when it wrote its config (two runs of one second). None
    when there is none. Links are not runs (`latest` itself, or a user's)."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        path = os.path.join(root, name)
        config = os.path.join(path, "config.json")
        if _NAMED.match(name) and not os.path.islink(path) and os.path.isfile(config):
            found.append((name[:15], os.path.getmtime(config), path))
    return max(found)[2] if found else None


def dangling_target(link: str) -> str | None:
    """Where `link` points when it is a symbolic link to nothing, else None."""
    if os.path.islink(link) and not os.path.exists(link):
        return os.readlink(link)
    return None


def instead_of_dangling(link: str) -> str | None:
    """--resume latest when `link` dangles: the newest run that exists (None: none), said in
    one line with where the link points."""
    root, prev = os.path.dirname(link), newest_run(os.path.dirname(link))
    then = f"continuing the newest run that exists, {prev}" if prev else "no other run under"
    print(
        f"warning: --resume latest: {link} is a dangling link (to {dangling_target(link)}, which"
        f" does not exist); " + (then if prev else f"{then} {root}; starting a new one"),
        flush=True,
    )
    return prev


def note_made(run_dir: str, link: str) -> None:
    """start_named_run made `run_dir` and is about to point `link` at it: remember the link's
    target before, for `withdraw`."""
    _made[run_dir] = os.readlink(link) if os.path.islink(link) else None


def withdraw(run_dir: str, link: str) -> bool:
    """Take back a named run directory this process made, when the run was refused before it
    wrote anything (it is empty): remove it and point `link` back where it pointed before (or
    remove the link, when there was none). A directory holding anything stays, and so does a
    link that another run has re-pointed since. -> whether it was withdrawn."""
    if run_dir not in _made:
        return False
    before = _made.pop(run_dir)
    try:
        os.rmdir(run_dir)  # only an empty directory: the run wrote nothing of its own
    except OSError:
        return False
    try:
        if os.path.islink(link) and os.readlink(link) == os.path.basename(run_dir):
            if before is None:
                os.remove(link)
            else:
                tmp = f"{link}.{os.getpid()}.tmp"
                os.symlink(before, tmp)
                os.replace(tmp, link)
    except OSError:  # the link is a convenience: a failure to restore it loses nothing
        pass
    return True


def start_named_run(cfg, now: datetime.datetime | None = None):
    """The default run directory (`runs/latest`) made concrete -> cfg with logging.run_dir set to a
    fresh `runs/<YYYYmmdd-HHMMSS>-<model>-<mesh>` (a suffix -2, -3, ... when that exists) and
    runs/latest linked to it, and --resume latest turned into the path of the run it continues.
    Any other run directory is returned as it is: an explicit --run-dir resumes its own
    checkpoints (supervisor restarts and scheduler requeues rely on that), and --resume latest
    with it means the same as auto, as before. Called once per job, before any child or process
    starts: the supervisor hands the name to every restart."""
    if os.path.normpath(cfg.logging.run_dir) != DEFAULT_RUN_DIR:
        return cfg
    p = cfg.parallelism
    cluster = [k for k in _CLUSTER_ENVS if k in os.environ]
    if p.num_processes > 1 or p.coordinator or cluster:
        # every process, and every requeue of the job, must write one directory: a name made of
        # the start time would differ between them
        why = f"{cluster[0]} is set" if cluster else "--num-processes/--coordinator"
        raise UserError(
            f"--run-dir: a multi-process or cluster job ({why}) needs an explicit --run-dir, the"
            f" same for every process and every requeue, e.g. --run-dir runs/$SLURM_JOB_ID"
        )
    root = os.path.dirname(DEFAULT_RUN_DIR)
    resume = cfg.checkpoint.resume
    if resume == "latest":
        resume = _run_to_continue(DEFAULT_RUN_DIR, cfg.to_dict())
    run_dir = _make_unique_dir(root, run_name(cfg, now or datetime.datetime.now()))
    note_made(run_dir, DEFAULT_RUN_DIR)  # a refused run gives it back (named_runs)
    _link_latest(DEFAULT_RUN_DIR, run_dir)
    continued = resume if resume not in (cfg.checkpoint.resume, "auto") else ""
    print(
        f"run directory: {run_dir}" + (f" (continues {continued})" if continued else ""), flush=True
    )
    return dataclasses.replace(
        cfg,
        logging=dataclasses.replace(cfg.logging, run_dir=run_dir),
        checkpoint=dataclasses.replace(cfg.checkpoint, resume=resume),
    )


def run_name(cfg, now: datetime.datetime) -> str:
    """'20261202-031500-tiny-data2.fsdp4': the start time, the model preset and the --mesh axes
    of size other than 1 ('N' for -1, the rest of the devices; 'dataN' for the default mesh)."""
    sizes = parse_spec(cfg.parallelism.mesh)
    mesh = (
        ".".join(
            f"{axis}{'N' if sizes[axis] == -1 else sizes[axis]}"
            for axis in AXES
            if sizes.get(axis, 1) != 1
        )
        or "dataN"
    )
    return f"{now:%Y%m%d-%H%M%S}-{cfg.model_preset or 'custom'}-{mesh}"


def _make_unique_dir(root: str, name: str) -> str:
    """Create root/name, or root/name-2, -3, ... when it exists (os.mkdir is atomic: two runs
    started in the same second get two directories) -> its path."""
    os.makedirs(root, exist_ok=True)
    for n in range(1, 1000):
        path = os.path.join(root, name if n == 1 else f"{name}-{n}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise UserError(f"--run-dir: cannot create {path} ({oserror_text(e)})") from None
    raise UserError(
        f"--run-dir: {os.path.join(root, name)} and 998 suffixed names exist; pass --run-dir DIR"
    )


def withdraw_named_run(cfg) -> None:
    """A named run (start_named_run) that was refused before it wrote anything: its empty
    directory removed and runs/latest pointed back where it was (train/run/py)."""
    withdraw(cfg.logging.run_dir, DEFAULT_RUN_DIR)


def _link_latest(link: str, run_dir: str) -> None:
    """Point `link` at `run_dir` atomically (a symlink under a temporary name renamed over it), so
    a reader never finds it missing. A real directory there, from a Brigade that wrote runs into
    runs/latest itself, is the user's data: it stays, and is no longer updated."""
    if os.path.exists(link) and not os.path.islink(link):
        print(
            f"note: {link} is a run directory of an earlier Brigade version: it is kept as it is"
            f" and no longer updated (this run is {run_dir})",
            file=sys.stderr,
            flush=True,
        )
        return
    tmp = f"{link}.{os.getpid()}.tmp"
    try:
        os.symlink(os.path.basename(run_dir), tmp)  # relative: the runs folder can be moved whole
        os.replace(tmp, link)
    except OSError as e:
        raise UserError(f"--run-dir: cannot link {link} to {run_dir} ({oserror_text(e)})") from None


def _run_to_continue(link: str, now: dict) -> str:
    """--resume latest without --run-dir: the run `link` points at (a dangling link: the newest
    run that exists, said in one line), when it was started with the settings this run has in
    every field that changes the state layout or the math (else one line naming the fields);
    -> its directory, which --resume PATH then reads, or auto (a fresh start) when there is no
    earlier run."""
    if dangling_target(link) is not None:  # its run deleted or moved (named_runs)
        prev = instead_of_dangling(link)
        if prev is None:
            return "auto"
    elif not os.path.exists(link):  # the first run of a script that always says --resume latest
        print(
            f"--resume latest: no earlier run to continue ({link} does not exist); starting a new"
            " one",
            flush=True,
        )
        return "auto"
    else:
        prev = os.path.relpath(os.path.realpath(link)) if os.path.islink(link) else link
    try:
        with open(os.path.join(prev, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(
            f"--resume latest: {prev} has no readable config.json ({e}); --resume PATH continues"
            f" from a checkpoint anyway"
        ) from None
    changed = changed_settings(saved, now)
    if changed:
        raise UserError(
            f"--resume latest: {prev} was run with other settings: {', '.join(changed)}; run with"
            f" its settings, or pass --resume {prev} to continue from it with these"
        )
    return prev


# Settings that change what a resumed run computes (the rest, e.g. eval or logging, do not).
RESUME_SENSITIVE = {
    "train": (
        "steps",
        "batch_size",
        "seq_len",
        "micro_batches",
        "lr",
        "min_lr_ratio",
        "warmup_steps",
        "weight_decay",
        "decay_embeddings",
        "b1",
        "b2",
        "eps",
        "grad_clip",
        "seed",
    ),
    "data": ("source", "eval_fraction", "packing", "packing_mask"),
    "comm": (
        "compression",
        "topk_fraction",
        "error_feedback",
        "sync_every",
        "outer_lr",
        "outer_momentum",
    ),
}


def changed_settings(saved: dict, now: dict) -> list[str]:
    """'section.field old -> new' for every resume-sensitive setting that changed: the listed train,
    data and comm fields, and every field of the model section (a changed param_dtype casts the
    restored parameters, a changed rope_theta or router changes what they compute)."""
    keys = {**RESUME_SENSITIVE, "model": tuple(now.get("model", {}))}
    out = [
        f"{sec}.{k} {saved[sec][k]} -> {now[sec][k]}"
        for sec, names in keys.items()
        for k in names
        if isinstance(saved.get(sec), dict) and k in saved[sec] and saved[sec][k] != now[sec][k]
    ]
    return [
        c + (" (the restored parameters are cast)" if c.startswith("model.param_dtype ") else "")
        for c in out
    ]
