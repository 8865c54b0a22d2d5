"""The doctor's checklist: one Check per line, the union over a job's processes, and its text
and JSON forms."""

from __future__ import annotations

import dataclasses
import json

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_RANK = {OK: 0, WARN: 1, FAIL: 2}


@dataclasses.dataclass(frozen=True)
class Check:
    """One line: what was checked (`name`), the verdict, what was found, and, unless it is OK,
    the one thing to do about it."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def ok(name: str, detail: str) -> Check:
    return Check(name, OK, detail)


def warn(name: str, detail: str, fix: str) -> Check:
    return Check(name, WARN, detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, FAIL, detail, fix)


def union(by_process: dict[int, list[Check]]) -> list[dict]:
    """The checks of every process, in process 0's order: a check every process found alike is
    one line; one that differs is a line per distinct finding, naming its processes."""
    order: list[str] = []
    found: dict[str, dict[tuple, list[int]]] = {}
    for process in sorted(by_process):
        for c in by_process[process]:
            if c.name not in found:
                order.append(c.name)
                found[c.name] = {}
            found[c.name].setdefault((c.status, c.detail, c.fix), []).append(process)
    everyone = sorted(by_process)
    out = []
    for name in order:
        for (status, detail, fix), processes in found[name].items():
            out.append(
                {
                    "check": name,
                    "status": status,
                    "detail": detail,
                    "fix": fix,
                    "processes": processes if processes != everyone else "all",
                }
            )
    return out


def passed(lines: list[dict]) -> bool:
    return all(line["status"] != FAIL for line in lines)


def render(lines: list[dict], header: str) -> str:
    """The checklist as text: `STATUS  check: detail`, and `fix: ...` under a WARN or FAIL."""
    text = [header]
    for line in lines:
        who = "" if line["processes"] == "all" else f" (process {_ids(line['processes'])})"
        text.append(f"{line['status']:<5} {line['check']}{who}: {line['detail']}")
        if line["status"] != OK and line["fix"]:
            text.append(f"      fix: {line['fix']}")
    worst = max((_RANK[line["status"]] for line in lines), default=0)
    counts = {s: sum(line["status"] == s for line in lines) for s in (OK, WARN, FAIL)}
    verdict = {
        0: "ready to run",
        1: "ready to run, with warnings",
        2: "not ready: fix the FAIL lines",
    }
    text.append(
        f"doctor: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL: {verdict[worst]}"
    )
    return "\n".join(text)


def as_json(lines: list[dict], facts: dict) -> str:
    return json.dumps({"ok": passed(lines), "checks": lines, **facts}, indent=2)


def _ids(processes: list[int]) -> str:
    return ", ".join(map(str, processes))
