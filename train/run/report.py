"""A run's report (`python -m train report RUN_DIR [--out DIR]`, train/cli/report.py): PNG plots of
a run's metrics and a markdown summary.

Reads what the loop writes into a run directory: `metrics.jsonl` (required), `config.json` and
`summary.json` (used when present). Writes `<out>/report.md` beside one PNG per metric group
(default out: `<RUN_DIR>/report`). A metric missing from every record (goodput in older runs,
eval loss with eval off) gets no plot rather than an empty one.
"""

from __future__ import annotations

import json

from checkpoint import storage
from errors import UserError
from train.run.device_memory import size_text
from train.run.goodput import read_records

# (file, title, y label, metric keys drawn on it, stacked); a key ending in '*' matches every key
# with that prefix
PLOTS = (
    ("loss.png", "Loss", "loss", ("loss", "eval_loss"), False),
    ("tokens_per_sec.png", "Throughput", "tokens/s", ("tokens_per_sec",), False),
    ("mfu.png", "Model FLOPs utilisation", "MFU (%)", ("mfu",), False),
    ("data_wait.png", "Data wait per step", "seconds", ("data_wait_s",), False),
    (
        "step_split.png",
        "Step time on the devices and on the host",
        "seconds per step",
        ("compute_s", "host_s"),
        False,
    ),
    (
        "stragglers.png",
        "Slowest process's step time / the others' median",
        "ratio",
        ("step_time_max_over_median",),
        False,
    ),
    (
        "memory.png",
        "Memory (the fullest device; the host process)",
        "GiB",
        ("mem_peak_bytes", "mem_bytes_in_use", "host_rss_bytes"),
        False,
    ),
    (
        "goodput.png",
        "Goodput (productive step time / wall time)",
        "goodput (%)",
        ("goodput*",),
        False,
    ),
    # the goodput breakdown: cumulative seconds per category, which add up to the wall time
    ("time.png", "Where the wall time went", "seconds (cumulative)", ("time_*",), True),
)
TOTALS = ("time_total_s",)  # drawn by the stack itself
PERCENT = ("mfu", "goodput")  # stored as fractions, shown as percentages
BYTES = ("mem_", "host_rss_")  # stored in bytes, shown in GiB


def read_run(run_dir: str) -> tuple[list[dict], dict, dict]:
    """-> (metrics records in step order, config, summary); UserError naming the missing file."""
    if not storage.isdir(run_dir):
        raise UserError(
            f"report: '{run_dir}' is not a directory (expected a run directory such as runs/latest)"
        )
    path = storage.join(run_dir, "metrics.jsonl")
    if not storage.isfile(path):
        raise UserError(
            f"report: '{run_dir}' has no metrics.jsonl (is it a run directory? `python -m train"
            f" --run-dir DIR` writes one)"
        )
    records = read_records(run_dir)  # lines cut short by a kill, or not records, are skipped
    if not records:
        raise UserError(f"report: {path} holds no metrics records yet")

    def optional(name):
        try:
            return json.loads(storage.read_text(storage.join(run_dir, name)))
        except (OSError, json.JSONDecodeError):
            return {}

    return (
        sorted(records, key=lambda r: r["step"]),
        optional("config.json"),
        optional("summary.json"),
    )


def _keys(records: list[dict], patterns: tuple[str, ...]) -> list[str]:
    present = {
        k
        for r in records
        for k, v in r.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    out = []
    for p in patterns:
        out += (
            sorted(k for k in present if k.startswith(p[:-1]))
            if p.endswith("*")
            else [p] * (p in present)
        )
    return out


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    scale = 100.0 if key.startswith(PERCENT) else 2.0**-30 if key.startswith(BYTES) else 1.0
    return [s for s, _ in pts], [v * scale for _, v in pts]


def plot(records: list[dict], out_dir: str) -> list[tuple[str, str]]:
    """One PNG per metric group that has data -> [(title, file name)]."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(
            "report: plotting needs matplotlib: pip install 'brigade[report]'"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed (servers, CI)
    import matplotlib.pyplot as plt

    made = []
    for name, title, ylabel, patterns, stacked in PLOTS:
        keys = [k for k in _keys(records, patterns) if not (stacked and k in TOTALS)]
        if stacked:  # categories that never took any time only clutter the legend
            keys = [k for k in keys if any(series(records, k)[1])]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7.2 if stacked else 6.4, 3.6), dpi=100)
        if stacked:
            rows = [r for r in records if all(isinstance(r.get(k), (int, float)) for k in keys)]
            ax.stackplot(
                [r["step"] for r in rows],
                *[[r[k] for r in rows] for k in keys],
                labels=[k.removeprefix("time_").removesuffix("_s") for k in keys],
                alpha=0.85,
            )
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
        else:
            for k in keys:
                x, y = series(records, k)
                ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=k)
            if len(keys) > 1:
                ax.legend()
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        # a local or gs:// / s3:// folder
        with storage.open_file(storage.join(out_dir, name), "wb") as f:
            fig.savefig(f, format="png")
        plt.close(fig)
        made.append((title, name))
    return made


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return "" if v is None else str(v)


def _memory(summary: dict, *keys: str) -> str | None:
    """'1.20 GiB / 1.50 GiB' from summary.json's byte counts; None when the run has none of them
    (older runs); 'unavailable' for a figure the backend did not keep."""
    if not any(k in summary for k in keys):
        return None
    return " / ".join(size_text(summary.get(k)) for k in keys)


def _figures(records: list[dict], config: dict, summary: dict) -> list[tuple[str, object]]:
    """The report's table of final figures: (what, value or None when the run has none)."""
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    last = train[-1] if train else {}
    mesh = summary.get("mesh") or config.get("parallelism", {}).get("mesh") or "?"
    return [
        ("steps", summary.get("steps", last.get("step"))),
        (
            "loss (first -> last)",
            f"{_fmt(train[0]['loss'])} -> {_fmt(last['loss'])}" if train else None,
        ),
        ("eval loss", evals[-1]["eval_loss"] if evals else None),
        ("tokens/s (median)", summary.get("tokens_per_sec")),
        ("MFU (median)", f"{100 * summary['mfu']:.2f}%" if "mfu" in summary else None),
        (
            "goodput",
            f"{100 * summary['goodput']:.1f}%"
            if isinstance(summary.get("goodput"), (int, float))
            else None,
        ),
        (
            "device memory peak (measured / predicted)",
            _memory(summary, "mem_peak_bytes", "predicted_peak_bytes"),
        ),
        ("host RSS (largest logged)", _memory(summary, "host_rss_bytes")),
        ("compile (s)", summary.get("compile_s")),
        ("wall time (s)", summary.get("wall_s")),
        ("parameters", f"{summary['params'] / 1e6:.2f}M" if summary.get("params") else None),
        ("mesh", mesh),
        ("resumed from step", summary.get("resumed_from")),
        ("stopped by", summary.get("stopped_by")),
    ]


def markdown(
    run_dir: str, records: list[dict], config: dict, summary: dict, plots: list[tuple[str, str]]
) -> str:
    n_train = sum(1 for r in records if "loss" in r)
    n_evals = sum(1 for r in records if "eval_loss" in r)
    figures = _figures(records, config, summary)
    lines = [
        f"# Run report: `{storage.absolute(run_dir)}`",
        "",
        f"{n_train} logged steps and {n_evals} evals from `metrics.jsonl`"
        + ("" if summary else " (no summary.json: the run has not finished)")
        + ".",
        "",
        "## Final figures",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in figures if v not in (None, "")]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{title}]({name})" for title, name in plots]
    if config:
        lines += ["", "## Config", "", "| section | settings |", "|---|---|"]
        for section, values in config.items():
            text = (
                ", ".join(f"{k}={v}" for k, v in values.items())
                if isinstance(values, dict)
                else values
            )
            lines.append(f"| {section} | {text} |")
    if summary.get("sample"):
        lines += ["", "## Sample", "", "```", summary["sample"], "```"]
    return "\n".join(lines) + "\n"


def report(run_dir: str, out_dir: str | None = None) -> str:
    """Write the plots and report.md; -> the report's path."""
    records, config, summary = read_run(run_dir)
    out_dir = out_dir or storage.join(run_dir, "report")
    try:
        storage.makedirs(out_dir)
    except OSError as e:
        raise UserError(f"report --out: cannot create '{out_dir}': {e.strerror}") from None
    plots = plot(records, out_dir)
    path = storage.join(out_dir, "report.md")
    storage.write_text(path, markdown(run_dir, records, config, summary, plots))
    return path
