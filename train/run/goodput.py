"""Goodput: where a run's wall time goes, across restarts.

The checkpoint/restart model: T_total = T_train + N_ckpt * T_save + N_fail * T_recover. Each attempt
(one process lifetime) times its own phases; the totals are written into every metrics.jsonl record,
so a resumed attempt carries on from the record of the step it resumed at. Everything a failed
attempt did after that record (steps that are now recomputed) plus the downtime until the new
attempt started is counted as `lost`. An attempt that ended cleanly (done, or stopped by
SIGINT/SIGTERM with its state committed: it wrote summary.json, with its totals and end time) failed
at nothing: the time until the next attempt is `idle`, kept apart from the total (the run was not
running), and only an attempt that started after it and died before logging anything makes the time
from that start on `lost`.

Categories (seconds): productive (steps, excluding data waits), data_wait, compile (the step and
the sharded init), checkpoint (time the loop was blocked by saves, incl. the final commit),
restore, eval (incl. the final sample), lost, other (start-up, logging: the rest of the wall
time). goodput = productive / total. `idle_between_attempts_s`, beside them, is in no total.
"""

from __future__ import annotations

import json
import time

from checkpoint import storage

CATEGORIES = ("productive", "data_wait", "compile", "checkpoint", "restore", "eval", "lost")
_PREFIX = "time_"
# the time between an attempt's clean end and the next attempt's start: not wall time of the run,
# so not a `time_` category (those add up to time_total_s)
IDLE = "idle_between_attempts_s"


class Goodput:
    def __init__(self, started_at: float | None = None):
        # this attempt (unix time)
        self.started_at = time.time() if started_at is None else started_at
        self.carried = {c: 0.0 for c in (*CATEGORIES, "total")}  # earlier attempts
        self.idle = 0.0  # seconds between a clean end and the next attempt: in no total
        self.spent = {c: 0.0 for c in CATEGORIES}  # this attempt
        self.recomputed_steps = 0
        self.restarts = 0
        self.after_failure = False  # set by resume(): the attempt before this one failed

    def add(self, category: str, seconds: float) -> None:
        self.spent[category] += seconds

    def resume(
        self,
        records: list[dict],
        step: int,
        restarts: int | None = None,
        ended: dict | None = None,
        earlier: list[dict] | None = None,
    ) -> None:
        """Continue the totals of the run whose metrics.jsonl `records` (all of them, in order)
        this attempt resumes at checkpoint `step`. `ended`: the run's summary.json (written by an
        attempt that ended cleanly), or None. `earlier`: the lines resumes.jsonl holds for the
        attempts that resumed before this one (when each started, and whether after a failure),
        which also tell an attempt that died before it logged anything. `restarts`: the count of
        attempts resumed after a failure, this one included, when the caller keeps it; else from
        `earlier`, or from the last record. Sets `after_failure` (this attempt's own verdict)."""
        timed = [r for r in records if _num(r.get(f"{_PREFIX}total_s")) and _num(r.get("time"))]
        clean = clean_end(ended, timed[-1] if timed else None)
        last = clean or (timed[-1] if timed else None)
        # an attempt that started after the clean end and left no record: it failed
        starts = [ln.get("time") for ln in earlier or () if isinstance(ln, dict)]
        died = sorted(
            t for t in starts if clean and _num(t) and clean["time"] < t < self.started_at
        )
        # no record and no attempt before in this run dir: it continues another run's
        # checkpoint (--resume PATH, --resume latest), which is no restart after a failure
        self.after_failure = bool(died) or (not clean and bool(records or earlier))
        if restarts is None and earlier is not None:
            restarts = sum(
                ln.get("after") != AFTER_CLEAN_END for ln in earlier if isinstance(ln, dict)
            )
            restarts += self.after_failure
        self.restarts = restarts if restarts is not None else int(self.after_failure)
        if last is None:
            return
        at = [r for r in timed if r["step"] <= step]
        base = clean if clean and clean["steps"] == step else (at[-1] if at else None)
        if base is not None:  # a clean end's totals include its time after its last record
            self.carried = {c: base.get(f"{_PREFIX}{c}_s", 0.0) for c in self.carried}
            self.idle = base.get(IDLE, 0.0)
        done_before = base[f"{_PREFIX}total_s"] if base else 0.0
        # the work after the checkpoint (now redone), then the time from the last sign of life
        # to this start: lost after a failure; idle after a clean end, up to the start of an
        # attempt that died without a record (from there on, lost)
        lost, gap_from = last[f"{_PREFIX}total_s"] - done_before, last["time"]
        if clean:
            idle_to = died[0] if died else self.started_at
            self.idle += max(0.0, idle_to - gap_from)
            gap_from = idle_to
        lost += max(0.0, self.started_at - gap_from)
        self.carried["lost"] += lost
        self.carried["total"] += lost
        # counts from the newest record: an attempt that resumed earlier and died after the
        # checkpoint step logged its own restart and recomputed steps there, not at `step`
        last_step = last["steps"] if last is clean else last["step"]  # a summary says "steps"
        self.recomputed_steps = last.get("recomputed_steps", 0) + max(0, last_step - step)
        if restarts is None:
            self.restarts = last.get("restarts", 0) + int(self.after_failure)

    def totals(self, now: float | None = None) -> dict:
        """Cumulative seconds per category, `other`, `total` and `goodput`, as metrics fields."""
        now = time.time() if now is None else now
        out = {c: self.carried[c] + self.spent[c] for c in CATEGORIES}
        total = self.carried["total"] + (now - self.started_at)
        out["other"] = max(0.0, total - sum(out.values()))
        out["total"] = total
        rec = {f"{_PREFIX}{k}_s": round(v, 4) for k, v in out.items()}
        rec[IDLE] = round(self.idle, 4)
        rec.update(
            goodput=out["productive"] / total if total > 0 else 0.0,
            time=now,
            recomputed_steps=self.recomputed_steps,
            restarts=self.restarts,
        )
        return rec


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


CLEAN_EXITS = (0, 130, 143)
# resumes.jsonl's `after`  # done, or stopped by SIGINT/SIGTERM with the state committed
AFTER_CLEAN_END, AFTER_FAILURE = ("clean end", "failure")


def clean_end(summary: dict | None, last: dict | None) -> dict | None:
    """`summary` (summary.json: written only by an attempt that ended cleanly, with the totals
    and the time it ended) when it is that of the newest attempt to log anything: newer than
    the newest metrics record `last`. An older one belongs to an attempt before that record's,
    and the attempt that logged it then failed. None otherwise."""
    if not isinstance(summary, dict) or summary.get("exit_code") not in CLEAN_EXITS:
        return None
    if not _num(summary.get("time")) or not _num(summary.get(f"{_PREFIX}total_s")):
        return None
    if last is not None and summary["time"] < last["time"]:
        return None
    return summary if isinstance(summary.get("steps"), int) else None


def read_json_lines(path: str, whole: bool = False) -> list[dict] | dict | None:
    """The JSON objects of a file of lines (resumes.jsonl); with `whole`, the file's one object
    (summary.json) or None. What does not parse (a line cut short by a kill) is skipped."""
    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        return None if whole else []
    out = []
    for ln in [text] if whole else text.splitlines():
        try:
            obj = json.loads(ln)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return (out[0] if out else None) if whole else out


def read_records(run_dir: str) -> list[dict]:
    """metrics.jsonl's records: JSON objects with an integer step. Anything else (a line cut short
    by a kill, a line edited by hand) is skipped: the file is a log, never a reason to stop."""
    out = []
    try:
        text = storage.read_text(storage.join(run_dir, "metrics.jsonl"))
    except FileNotFoundError:
        return out
    for ln in text.splitlines():
        try:
            rec = json.loads(ln)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def breakdown_text(rec: dict) -> str:
    """'goodput 83% (compile 6%, checkpoint 1%, ...)' from a totals() record."""
    total = rec[f"{_PREFIX}total_s"] or 1.0
    parts = [
        f"{c.replace('_', ' ')} {100 * rec[f'{_PREFIX}{c}_s'] / total:.0f}%"
        for c in (*CATEGORIES[1:], "other")
        if rec[f"{_PREFIX}{c}_s"] / total >= 0.005
    ]
    extra = (
        f"; {rec['restarts']} restart(s), {rec['recomputed_steps']} step(s) recomputed"
        if rec["restarts"]
        else ""
    )
    if rec.get("elastic_shrinks") or rec.get("elastic_grows"):
        extra += (
            f"; the mesh shrank {rec['elastic_shrinks']} and grew {rec['elastic_grows']} time(s)"
            f" ({rec.get('elastic_resize_s', 0.0):.0f}s between attempts)"
        )
    idle = rec.get(IDLE, 0.0)
    extra += f"; {idle:.0f}s idle between attempts, not counted" if idle >= 1 else ""
    return (
        f"goodput {100 * rec['goodput']:.0f}% of {total:.1f}s"
        + (f" (lost to {', '.join(parts)})" if parts else "")
        + extra
    )
