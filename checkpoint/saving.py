"""A run's saves: when to save (every N steps, and whenever the caller forces one: the last step,
a stop signal), never a state that is not finite, the metadata each save carries (with the data
loader's position), and one line (SaveFailed) for a save that failed.

The caller passes everything in as values (the config dict, the mesh, the seed, a function giving
the data position of a step): this package knows nothing of the train loop.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from checkpoint.layout import TMP_SUFFIX, make_meta
from checkpoint.manager import Checkpointer
from checkpoint.peer_copy import peer_tier, save_copy
from checkpoint.tiers import layout, local_tier
from errors import UserError


def step_list(steps: list[int]) -> str:
    """'3, 6, 9': steps named in a one-line message (the first eight, then '...')."""
    return ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")


class SaveFailed(UserError):
    """Writing a checkpoint failed (disk full, permissions, storage gone). Orbax writes a step under
    `<step>.orbax-checkpoint-tmp` and renames it only when complete, so committed steps are
    untouched."""

    # the CLI exits at once: the failed save's writes still in flight would print noise
    exit_now = True

    def __init__(self, saver: Checkpointer, step: int, err: Exception):
        kept = saver.all_steps()
        tmp = re.search(r"/(\d+)" + re.escape(TMP_SUFFIX), str(err))
        # a background save fails a step later than it started
        step = int(tmp.group(1)) if tmp else step
        super().__init__(
            f"checkpoint: saving step {step} to {saver.directory} failed ({_write_error(err)});"
            f" committed checkpoints are intact (steps {step_list(kept) if kept else 'none'});"
            f" free space or fix the directory, then run the same command again to resume"
        )


def _write_error(err: Exception) -> str:
    """The OS reason and file of a failed write: OSError, or tensorstore's ValueError text."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f": {err.filename}" if err.filename else "")
    text = str(err)
    m = re.search(
        r"Failed to write \d+ bytes to file \d+: ([^\[]+?) \[os_error_code", text
    ) or re.search(r": ([A-Z][a-z][^:\[]+?) \[os_error_code", text)
    reason = (
        m.group(1).strip() if m else (text.strip().splitlines() or [type(err).__name__])[0][:200]
    )
    f = re.search(r'Failed writing: "([^"]+)"', text)
    return reason + (f": {f.group(1)}" if f else "")


@contextlib.contextmanager
def _reporting(saver: Checkpointer, step: int) -> Iterator[None]:
    """A save's failure -> SaveFailed (whatever Orbax/tensorstore raise for a failed write)."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001
        raise SaveFailed(saver, step, e) from None


@contextlib.contextmanager
def committed_on_exit(saver: Checkpointer) -> Iterator[Checkpointer]:
    """`saver`, closed on leaving: every save in flight is committed before the caller goes on. A
    commit that fails raises SaveFailed, unless an error is already on its way out (it says
    more)."""
    try:
        yield saver
    except BaseException:
        with contextlib.suppress(Exception):
            saver.close()
        raise
    try:
        saver.close()
    except Exception as e:  # noqa: BLE001
        raise SaveFailed(saver, saver.latest_step() or 0, e) from None


@jax.jit
def _all_finite(state: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class Saves:
    """The saves of one run into `saver`: every `every` steps (0: only forced ones), each with the
    metadata of `make_meta` (`config`: the run's config as a dict; `seed`) and the data loader's
    position before the next batch (`data_position(step)`, checked by the loader on resume).

    With `checkpoint.local_dir` in `config`, the steps in between that are due every
    `checkpoint.local_every` go to the local tier (checkpoint/tiers.py) instead: each process its
    own copy on host-local storage, much faster to write than shared storage."""

    def __init__(
        self,
        saver: Checkpointer,
        *,
        every: int,
        mesh: Mesh,
        config: dict,
        seed: int,
        data_position: Callable[[int], dict],
    ):
        self.saver, self.every, self.mesh = saver, every, mesh
        self._config, self._seed, self._data_position = config, seed, data_position
        # the newest step whose save started (committed once `wait` returns)
        self.started: int | None = None
        ck = config.get("checkpoint", {})
        self.local = local_tier(
            saver,
            ck.get("local_dir", ""),
            keep=ck.get("local_keep", 2),
            async_save=ck.get("async", True),
        )
        self.local_every = ck.get("local_every", 0) if self.local else 0
        self.peer = (  # the previous process's local copy, kept here too (checkpoint/peer_copy.py)
            peer_tier(
                self.local,
                ck.get("local_dir", ""),
                keep=ck.get("local_keep", 2),
                async_save=ck.get("async", True),
            )
            if ck.get("local_peer", True)
            else None
        )
        self.local_started: int | None = None  # the same, in the local tier

    def due(self, step: int, force: bool = False) -> bool:
        return self._persistent_due(step, force) or bool(
            self.local_every and step % self.local_every == 0
        )

    def _persistent_due(self, step: int, force: bool) -> bool:
        return force or bool(self.every and step % self.every == 0)

    def maybe_save(self, step: int, state: Any, *, force: bool = False) -> str:
        """Start saving `step` if it is due (or `force`; to the persistent tier when it is due
        there, else to the local tier) -> "" (saving, or not due); or, when its state holds a NaN
        or an infinity, why nothing was saved: where the newest committed checkpoint is, or "no
        checkpoint" (a checkpoint must always be a safe place to resume from). Returns once the
        arrays are copied to host memory (the next step may donate them); an asynchronous save
        that fails in the background surfaces here or in `wait`."""
        if not self.due(step, force):
            return ""
        persistent = self._persistent_due(step, force)
        saver = self.saver if persistent else self.local
        with jax.set_mesh(self.mesh):
            if bool(_all_finite(state)):
                with _reporting(saver, step):
                    meta = make_meta(step, self._config, self.mesh, self._seed)
                    meta["data"]["loader"] = self._data_position(step)
                    if not persistent:
                        meta["local"] = layout(self.mesh)  # the copy restores onto this layout only
                    saver.save(step, state, meta)
                    if not persistent and self.peer is not None:
                        save_copy(self.peer, step, state, meta, self.mesh)
                if persistent:
                    self.started = step
                else:
                    self.local_started = step
                return ""
        self.saver.wait()
        last = self.saver.latest_step()
        return (
            f"the newest committed checkpoint is {self.saver.step_dir(last)}"
            if last is not None
            else "no checkpoint"
        )

    def wait(self) -> None:
        """Block until every save in flight (both tiers) is committed; SaveFailed if one failed."""
        with _reporting(self.saver, self.started or 0):
            self.saver.wait()
        if self.local:
            with _reporting(self.local, self.local_started or 0):
                self.local.wait()
                if self.peer is not None:
                    self.peer.wait()
