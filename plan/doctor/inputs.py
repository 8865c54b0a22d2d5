"""The doctor's checks of the run's inputs and outputs, by the run's own refusals where it has
them (nothing is created): the run directory and the checkpoint store writable (local, or an
object store with its package and credentials), the data readable with every token id within
the model's vocabulary, the tokenizer the --init-from checkpoint was trained with, the
--init-from and --resume checkpoints present."""

from __future__ import annotations

import os

from checkpoint import storage
from checkpoint.manager import open_checkpoint
from errors import UserError
from plan.doctor.report import Check, fail, ok
from train.run import checkpoint_match
from train.run.inputs import open_data
from train.run.named_runs import DEFAULT_RUN_DIR
from train.run.rundir import check_writable_run_dir
from train.run.startup import check_before_creating, checkpoint_dir


def _writable(path: str, flag: str) -> Check | None:
    """A FAIL when `path` (or, before it exists, the nearest directory above it) cannot be
    written, or an object store cannot be reached; None when it can."""
    if not storage.is_local(path):
        try:
            storage.exists(path)  # the package, the credentials and the bucket, in one request
        except Exception as e:  # noqa: BLE001  (each store raises its own kinds)
            return fail(
                flag,
                f"{path}: the object store did not answer ({type(e).__name__}: {str(e)[:160]})",
                "install its package (pip install 'brigade[gcs]' / 'brigade[s3]') and set its"
                " credentials (GOOGLE_APPLICATION_CREDENTIALS, AWS_* or the instance's role)",
            )
        return None
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        return fail(
            flag, f"{path}: {existing} is not writable by this user", "choose a writable path"
        )
    return None


def directories(cfg) -> list[Check]:
    run_dir = cfg.logging.run_dir
    shown = (
        "runs/<time>-<model>-<mesh>" if os.path.normpath(run_dir) == DEFAULT_RUN_DIR else run_dir
    )
    where = os.path.dirname(run_dir) if shown != run_dir else run_dir
    out: list[Check] = []
    try:
        check_writable_run_dir(run_dir)
        out.append(_writable(where, "run directory") or ok("run directory", f"{shown} writable"))
    except UserError as e:
        out.append(fail("run directory", str(e), "use another --run-dir"))
    ckpt = checkpoint_dir(cfg)
    try:
        check_before_creating(cfg, storage.absolute(ckpt))
        out.append(
            _writable(ckpt, "checkpoint store") or ok("checkpoint store", f"{ckpt} writable")
        )
    except UserError as e:
        out.append(fail("checkpoint store", str(e), "the line names the flag to change"))
    return out


def checkpoints(cfg) -> list[Check]:
    """--init-from and a --resume PATH: present and readable (their metadata)."""
    out = []
    c = cfg.checkpoint
    for flag, path in (("--init-from", c.init_from), ("--resume", c.resume)):
        if not path or (flag == "--resume" and path in ("auto", "latest", "none")):
            continue
        try:
            src, step = open_checkpoint(path)
            src.meta(step)
            out.append(ok(flag, f"step {step} in {src.directory}"))
        except UserError as e:
            out.append(fail(flag, str(e), f"give {flag} a run, checkpoint or step directory"))
    return out


def data(cfg, run_setup) -> list[Check]:
    """The training data opened as the run opens it (its vocabulary checked against the model's),
    and the tokenizer of --init-from's checkpoint against the data's."""
    try:
        pipeline = open_data(run_setup)  # pairs for a preference objective
    except UserError as e:
        return [fail("data", str(e), "the line names what to change (docs/data.md)")]
    try:
        out = [
            ok(
                "data",
                f"{pipeline.describe()}; token ids below --model.vocab_size {cfg.model.vocab_size}",
            )
        ]
        if cfg.checkpoint.init_from:
            try:
                checkpoint_match.check_init_tokenizer(run_setup, pipeline)
                out.append(ok("tokenizer", "the data's tokenizer is --init-from's"))
            except UserError as e:
                out.append(
                    fail("tokenizer", str(e), "prepare the data with the checkpoint's tokenizer")
                )
        return out
    finally:
        pipeline.close()
