"""The elastic job's membership: which of its original processes ("slots") run the next attempt.

Every supervisor of a `--train.elastic` job meets the others in `<run-dir>/elastic/` (the run
directory is on storage every host reaches, as the checkpoints are). Attempt g of the job is
generation g: `gen-<g>/slot-<s>.json` says that slot s is ready to run it (with the address its
host is reached at), `gen-<g>/members.json` fixes who does. A supervisor joins a generation by
announcing itself in the next one, then waiting for its members file:

- every member of the previous generation announced (a plain restart, or a grow: a returning
  slot announced before them): the generation closes at once, with all of them;
- otherwise, `wait_s` after this supervisor saw the first announcement, the generation closes
  with the slots that have announced (the lost ones are left out: a shrink);
- the first generation waits for every slot of the job (as jax.distributed would).

The lowest announced slot of the previous generation writes the members file; the others read
it. A slot that comes back while a generation runs (its host restarted, the launcher started the
same command again) finds itself outside the newest members file, announces in the next
generation and waits: the running supervisors, which say they are running (`beat`, a counter
in `alive-<slot>`), see its announcement (`newcomers`) and stop their children at a checkpoint,
so the next generation holds it again. Only when no member of the previous generation has
beaten for `wait_s` (the whole job died) do returning slots fix a generation of their own.
The files are written whole (storage.write_text), so a reader never sees half of one; nothing
here imports JAX.
"""

from __future__ import annotations

import dataclasses
import json
import time

from checkpoint import storage
from errors import UserError

MEMBERS = "members.json"
DONE = "done.json"  # the job ended for good: its exit status
POLL_S = 0.2  # how often a waiting supervisor looks at the directory (a file, not an event)
SAY_AFTER_S = 10.0  # a join that takes longer says whom it waits for, once


@dataclasses.dataclass(frozen=True)
class Generation:
    """One attempt of the elastic job: its number and its member slots (ascending; the attempt's
    process ids are their positions), with the host each member is reached at."""

    number: int
    members: tuple[int, ...]
    hosts: dict[int, str]

    def process_id(self, slot: int) -> int:
        return self.members.index(slot)


class Rendezvous:
    """Slot `slot` of a job of `slots` processes, meeting the others in `directory`."""

    def __init__(self, directory: str, slot: int, slots: int, host: str, wait_s: float):
        self.directory, self.slot, self.slots, self.host, self.wait_s = (
            directory,
            slot,
            slots,
            host,
            wait_s,
        )

    def _gen_dir(self, number: int) -> str:
        return storage.join(self.directory, f"gen-{number}")

    def newest(self) -> Generation | None:
        """The newest generation whose members are fixed, or None before the first."""
        numbers = sorted(
            (int(n.split("-")[1]) for n in _listdir(self.directory) if _is_gen(n)), reverse=True
        )
        for number in numbers:
            found = self._members(number)
            if found is not None:
                return found
        return None

    def _members(self, number: int) -> Generation | None:
        try:
            raw = json.loads(storage.read_text(storage.join(self._gen_dir(number), MEMBERS)))
        except (FileNotFoundError, ValueError):
            return None
        hosts = {int(k): v for k, v in raw.get("hosts", {}).items()}
        return Generation(number, tuple(raw["members"]), hosts)

    def _announced(self, number: int) -> dict[int, str]:
        out = {}
        for name in _listdir(self._gen_dir(number)):
            if name.startswith("slot-") and name.endswith(".json"):
                try:
                    rec = json.loads(storage.read_text(storage.join(self._gen_dir(number), name)))
                except (FileNotFoundError, ValueError):
                    continue  # being written
                out[int(rec["slot"])] = str(rec["host"])
        return out

    def _announce(self, number: int) -> None:
        storage.makedirs(self._gen_dir(number))
        storage.write_text(
            storage.join(self._gen_dir(number), f"slot-{self.slot}.json"),
            json.dumps({"slot": self.slot, "host": self.host, "time": time.time()}),
        )

    def newcomers(self, current: Generation) -> list[int]:
        """Slots outside `current` that announced themselves for the generation after it."""
        return sorted(set(self._announced(current.number + 1)) - set(current.members))

    def finish(self, code: int) -> None:
        """The job ended for good with `code`: a slot waiting to rejoin it leaves with that code."""
        storage.write_text(
            storage.join(self.directory, DONE), json.dumps({"code": code, "time": time.time()})
        )

    def _ended_since(self, since: float) -> int | None:
        try:
            done = json.loads(storage.read_text(storage.join(self.directory, DONE)))
        except (FileNotFoundError, ValueError):
            return None
        return int(done["code"]) if done.get("time", 0) > since else None

    def join(self, timeout_s: float) -> Generation | int:
        """Announce this slot in the generation after the newest and wait until one that holds
        it is fixed -> that generation, or the job's exit status if it ended meanwhile (`finish`).
        UserError after `timeout_s` without either."""
        previous = self.newest()
        number = previous.number + 1 if previous else 0
        self._announce(number)
        since, first_seen, deadline = time.time(), None, time.monotonic() + timeout_s
        beats: dict[int, tuple[str | None, float]] = {}
        said = False
        while time.monotonic() < deadline:
            ended = self._ended_since(since)
            if ended is not None:
                return ended
            fixed = self._members(number)
            if fixed is not None:
                if self.slot in fixed.members:
                    return fixed
                # it closed without this slot: this slot returns in the generation after it
                previous, number, first_seen = fixed, number + 1, None
                self._announce(number)
                continue
            announced = self._announced(number)
            first_seen = first_seen or time.monotonic()
            expected = set(previous.members) if previous else set(range(self.slots))
            closed = expected <= set(announced) or (
                previous is not None and time.monotonic() - first_seen >= self.wait_s
            )
            if closed and self.slot == self._fixer(previous, announced, beats):
                self._fix(number, announced)
            if not said and time.monotonic() - first_seen >= max(self.wait_s, SAY_AFTER_S):
                said = self._say_waiting(number, expected - set(announced), previous)
            time.sleep(POLL_S)
        raise UserError(
            f"elastic: slot {self.slot} found no generation to join in {self.directory} within"
            f" {timeout_s:.0f}s (the lowest process that announced itself fixes the next one)"
        )

    def _say_waiting(self, number: int, missing: set[int], previous: Generation | None) -> bool:
        """One line while a join takes long: whom this process waits for (never a silent wait)."""
        if previous is not None and self.slot not in previous.members:
            what = f"the running process(es) {list(previous.members)} to stop at a checkpoint"
        else:
            what = f"process(es) {sorted(missing)}"
        print(
            f"supervisor: elastic: process {self.slot} waits for {what} to form generation"
            f" {number} ({self.directory})",
            flush=True,
        )
        return True

    def beat(self, count: int) -> None:
        """Say that this slot's child is running (its supervisor calls this about once a second):
        a returning slot waits for such a slot instead of going on without it."""
        storage.write_text(storage.join(self.directory, f"alive-{self.slot}"), str(count))

    def _fixer(self, previous: Generation | None, announced: dict[int, str], beats) -> int | None:
        """Which announced slot fixes the generation: the lowest that was a member of the one
        before (a returning slot waits for the running ones to stop at a checkpoint), or, once
        none of those has beaten for `wait_s` (the job died), the lowest announced."""
        if previous is None:
            return min(announced)
        old = sorted(set(announced) & set(previous.members))
        if old:
            return old[0]
        now = time.monotonic()
        for slot in previous.members:
            try:
                value = storage.read_text(storage.join(self.directory, f"alive-{slot}"))
            except FileNotFoundError:
                value = None
            if slot not in beats or beats[slot][0] != value:
                beats[slot] = (value, now)
        quiet = all(now - since >= self.wait_s for _, since in beats.values())
        return min(announced) if quiet else None

    def _fix(self, number: int, announced: dict[int, str]) -> None:
        members = sorted(announced)
        storage.write_text(
            storage.join(self._gen_dir(number), MEMBERS),
            json.dumps(
                {"members": members, "hosts": {str(s): announced[s] for s in members}},
            ),
        )


def _is_gen(name: str) -> bool:
    return name.startswith("gen-") and name[4:].isdigit()


def _listdir(path: str) -> list[str]:
    try:
        return storage.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
