"""`python -m train report RUN_DIR [--out DIR]`: a run's plots and markdown summary
(train/run/report.py), written beside its records."""

from __future__ import annotations

from checkpoint import storage
from errors import ArgParser
from train.run.report import report


def main(argv: list[str]) -> int:
    p = ArgParser(
        prog="python -m train report",
        description="Plot a run's metrics and summarise it in markdown.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.jsonl)")
    p.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="where to write report.md and the PNGs (default: RUN_DIR/report)",
    )
    ns = p.parse_args(argv)
    path = report(ns.run_dir, ns.out)
    pngs = sorted(f for f in storage.listdir(storage.dirname(path)) if f.endswith(".png"))
    print(f"report: {path} ({', '.join(pngs)})")
    return 0
