"""Which run a checkpoint directory belongs to, and which of its steps that run wrote: the only
steps its retention (--checkpoint.keep, --checkpoint.keep_every) may ever delete.

A checkpoint directory a run saves into holds RECORD, written by the run at each save (process
0, or each process for its own local-tier copy):

    {"run_dir": the run directory of the run that saves here, "written": [the steps it saved],
     "adopted_from": the run the directory belonged to before (--checkpoint.adopt), or "",
     "since": when that run first saved here, "directory": the directory it was written in}

A record is about the directory it was written in (`directory`): one found elsewhere (the
directory, or the run directory around it, was copied or moved) describes the original, and
train/run/ownership.py takes it for a copy.

A step that is not in `written` (another run's, a step saved before the record existed in a
directory outside the run's own, a step of the run this one adopted the directory from) is
never deleted by retention: at worst a directory keeps more steps than --checkpoint.keep says,
never fewer than the run that wrote them expects. Which run may save into which directory is
train/run/ownership.py's decision; this module only keeps the record and applies it.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Sequence
from typing import Any

from checkpoint import storage

RECORD = "brigade-owner.json"


def read_record(directory: str) -> dict | None:
    """The directory's RECORD, None when it has none; a record that does not parse (or is of the
    wrong shape) reads as `{"unreadable": why}`: its steps are then nobody's known own."""
    path = storage.join(directory, RECORD)
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return {"unreadable": e.strerror or str(e)}
    try:
        record = json.loads(text)
    except ValueError as e:
        return {"unreadable": f"not valid JSON: {e}"}
    ok = (
        isinstance(record, dict)
        and isinstance(record.get("run_dir"), str)
        and isinstance(record.get("written"), list)
        and all(isinstance(s, int) and not isinstance(s, bool) for s in record["written"])
    )
    return record if ok else {"unreadable": "not an object of run_dir and written steps"}


@dataclasses.dataclass
class Owner:
    """The run that saves into `directory` (its `run_dir`) and the steps it wrote there.
    `writer`: this process keeps the record (process 0; each process for a local-tier copy)."""

    directory: str
    run_dir: str
    written: set[int]
    adopted_from: str = ""
    since: str = ""
    writer: bool = True

    def wrote(self, step: int) -> None:
        """`step` is about to be saved by this run: it becomes one retention may delete. Recorded
        before the save starts, so a save cut short by a kill is still this run's."""
        self.written.add(step)
        if not self.writer:
            return
        self.since = self.since or datetime.datetime.now().astimezone().isoformat(
            timespec="seconds"
        )
        record = {
            "run_dir": self.run_dir,
            "written": sorted(self.written),
            "adopted_from": self.adopted_from,
            "since": self.since,
            "directory": self.directory,
        }
        storage.write_text(storage.join(self.directory, RECORD), json.dumps(record) + "\n")


class Retention:
    """Orbax's preservation policy for a Checkpointer: keep the newest `keep` of the steps this
    run wrote (0: all), every step divisible by `keep_every` (> 0), and every step this run did
    not write. `owner` None: every step is the run's (a directory no run record governs, e.g.
    an export), which is Orbax's own LatestN + EveryNSteps."""

    def __init__(self, keep: int, keep_every: int, owner: Owner | None):
        self.keep, self.keep_every, self.owner = keep, keep_every, owner

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
        steps = [info.step for info in checkpoints]
        mine = set(steps) if self.owner is None else set(self.owner.written) & set(steps)
        newest = set(sorted(mine)[-self.keep :]) if self.keep > 0 else mine
        return [
            s not in mine or s in newest or bool(self.keep_every and s % self.keep_every == 0)
            for s in steps
        ]
