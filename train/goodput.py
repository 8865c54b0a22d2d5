"""Goodput: where a run's wall time goes, across restarts.

The checkpoint/restart model: T_total = T_train + N_ckpt * T_save + N_fail * T_recover. Each attempt (one process
lifetime) times its own phases; the totals are written into every metrics.jsonl record, so a
resumed attempt carries on from the record of the step it resumed at. Everything the failed
attempt did after that record (steps that are now recomputed) plus the downtime until the new
attempt started is counted as `lost`.

Categories (seconds): productive (steps, excluding data waits), data_wait, compile (the step and
the sharded init), checkpoint (time the loop was blocked by saves, incl. the final commit),
restore, eval (incl. the final sample), lost, other (start-up, logging: the rest of the wall
time). goodput = productive / total.
"""

from __future__ import annotations

import json
import time

from checkpoint import storage

CATEGORIES = ("productive", "data_wait", "compile", "checkpoint", "restore", "eval", "lost")
_PREFIX = "time_"


class Goodput:
    def __init__(self, started_at: float | None = None):
        self.started_at = (
            time.time() if started_at is None else started_at
        )  # this attempt (unix time)
        self.carried = {c: 0.0 for c in (*CATEGORIES, "total")}  # earlier attempts
        self.spent = {c: 0.0 for c in CATEGORIES}  # this attempt
        self.recomputed_steps = 0
        self.restarts = 0

    def add(self, category: str, seconds: float) -> None:
        self.spent[category] += seconds

    def resume(self, records: list[dict], step: int, restarts: int | None = None) -> None:
        """Continue the totals of the run whose metrics.jsonl `records` (all of them, in order)
        this attempt resumes at checkpoint `step`. `restarts`: how many attempts have resumed so
        far, this one included, when the caller keeps that count (an attempt killed before it
        logged anything leaves no record); else one more than the last record says."""
        num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        timed = [r for r in records if num(r.get(f"{_PREFIX}total_s")) and num(r.get("time"))]
        self.restarts = restarts if restarts is not None else 1
        if not timed:
            return
        at = [r for r in timed if r["step"] <= step]
        base, last = (at[-1] if at else None), timed[-1]
        if base is not None:
            self.carried = {c: base.get(f"{_PREFIX}{c}_s", 0.0) for c in self.carried}
        done_before = base[f"{_PREFIX}total_s"] if base else 0.0
        # work after the checkpoint (now redone) + the gap between the last sign of life and this start
        lost = (last[f"{_PREFIX}total_s"] - done_before) + max(0.0, self.started_at - last["time"])
        self.carried["lost"] += lost
        self.carried["total"] += lost
        # counts from the newest record: an attempt that resumed earlier and died after the
        # checkpoint step logged its own restart and recomputed steps there, not at `step`
        self.recomputed_steps = last.get("recomputed_steps", 0) + max(0, last["step"] - step)
        if restarts is None:
            self.restarts = last.get("restarts", 0) + 1

    def totals(self, now: float | None = None) -> dict:
        """Cumulative seconds per category, `other`, `total` and `goodput`, as metrics fields."""
        now = time.time() if now is None else now
        out = {c: self.carried[c] + self.spent[c] for c in CATEGORIES}
        total = self.carried["total"] + (now - self.started_at)
        out["other"] = max(0.0, total - sum(out.values()))
        out["total"] = total
        rec = {f"{_PREFIX}{k}_s": round(v, 4) for k, v in out.items()}
        rec.update(
            goodput=out["productive"] / total if total > 0 else 0.0,
            time=now,
            recomputed_steps=self.recomputed_steps,
            restarts=self.restarts,
        )
        return rec


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
    return (
        f"goodput {100 * rec['goodput']:.0f}% of {total:.1f}s"
        + (f" (lost to {', '.join(parts)})" if parts else "")
        + extra
    )
