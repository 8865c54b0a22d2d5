"""`python -m train report RUN_DIR`: plots and report.md from a run directory's files (synthetic
records with the keys the loop writes; no training)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from errors import UserError  # noqa: E402
from train.run import report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(run_dir, goodput=True, summary=True, steps=(1, 10, 20, 30)):
    run_dir.mkdir()
    lines = []
    for i, s in enumerate(steps):
        rec = {
            "step": s,
            "loss": 5.0 - 0.1 * i,
            "grad_norm": 1.0,
            "lr": 1e-3,
            "step_time_s": 0.1,
            "tokens_per_sec": 1000.0 + i,
            "tokens_per_sec_per_device": 125.0,
            "mfu": 0.05,
            "data_wait_s": 0.001 * i,
            "skipped_steps": 0,
        }
        if goodput:
            rec.update(
                goodput=0.2 + 0.1 * i,
                time_productive_s=1.0 + i,
                time_compile_s=3.0,
                time_eval_s=0.0,
                time_total_s=4.0 + i,
            )
        lines.append(json.dumps(rec))
        if s % 10 == 0:
            lines.append(json.dumps({"step": s, "eval_loss": 4.5 - 0.1 * i, "eval_ppl": 90.0}))
    lines.append('{"step": 31, "loss": 4.')  # cut short by a kill
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "config.json").write_text(
        json.dumps(
            {"model": {"preset": "tiny", "d_model": 64}, "parallelism": {"mesh": "fsdp=4,model=2"}}
        )
    )
    if summary:
        (run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "steps": steps[-1],
                    "final_loss": 4.7,
                    "first_loss": 5.0,
                    "eval_loss": 4.3,
                    "tokens_per_sec": 1001.5,
                    "mfu": 0.05,
                    "compile_s": 3.0,
                    "wall_s": 7.5,
                    "goodput": 0.5,
                    "params": 132416,
                    "mesh": "fsdp=4,model=2",
                    "sample": "def hello():",
                }
            )
        )
    return run_dir


def test_report_plots_and_markdown(tmp_path):
    run = write_run(tmp_path / "run")
    path = report.report(str(run))
    out = run / "report"
    assert path == str(out / "report.md")
    pngs = sorted(p.name for p in out.iterdir() if p.suffix == ".png")
    assert pngs == [
        "data_wait.png",
        "goodput.png",
        "loss.png",
        "mfu.png",
        "time.png",
        "tokens_per_sec.png",
    ]
    for p in pngs:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (
            out / p
        ).stat().st_size > 5000
    md = (out / "report.md").read_text()
    for text in (
        "| loss (first -> last) | 5 -> 4.7 |",
        "| eval loss | 4.2 |",
        "| MFU (median) | 5.00% |",
        "| goodput | 50.0% |",
        "| mesh | fsdp=4,model=2 |",
        "| parameters | 0.13M |",
        "![Loss](loss.png)",
        "| model | preset=tiny, d_model=64 |",
        "def hello():",
        "4 logged steps and 3 evals",
    ):
        assert text in md, text


def test_series_and_percent():
    records = [
        {"step": 1, "loss": 2.0, "mfu": 0.25},
        {"step": 2, "eval_loss": 1.5},
        {"step": 3, "loss": 1.0},
    ]
    assert report.series(records, "loss") == ([1, 3], [2.0, 1.0])
    assert report.series(records, "mfu") == ([1], [25.0])
    assert report._keys(records, ("loss", "eval_loss", "goodput*")) == ["loss", "eval_loss"]


def test_run_without_goodput_or_summary(tmp_path):
    """An older or still-running run: no goodput fields (no plot for them), no summary.json."""
    run = write_run(tmp_path / "run", goodput=False, summary=False)
    report.report(str(run), str(tmp_path / "elsewhere"))
    pngs = sorted(p.name for p in (tmp_path / "elsewhere").iterdir() if p.suffix == ".png")
    assert "goodput.png" not in pngs and "time.png" not in pngs and "loss.png" in pngs
    md = (tmp_path / "elsewhere" / "report.md").read_text()
    assert "no summary.json" in md and "| steps | 30 |" in md and "| mesh | fsdp=4,model=2 |" in md


def test_bad_run_dir_is_one_line(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        report.report(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        report.report(str(tmp_path / "empty"))
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="holds no metrics records"):
        report.report(str(tmp_path / "empty"))
    r = subprocess.run(
        [sys.executable, "-m", "train", "report", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: report:")
    ), r.stderr


def test_python_m_train_report(tmp_path):
    """The CLI as users type it: `python -m train report` (train/cli/report.py)."""
    run = write_run(tmp_path / "run")
    r = subprocess.run(
        [sys.executable, "-m", "train", "report", str(run), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "report.md").exists() and "loss.png" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "train", "report", str(tmp_path / "nope")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "not a directory" in r.stderr


def test_step_split_stragglers_and_memory(tmp_path):
    run = write_run(tmp_path / "run")
    recs = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    with open(run / "metrics.jsonl", "w") as f:
        for r in recs:
            if "loss" in r:
                r.update(
                    compute_s=0.08,
                    host_s=0.01,
                    step_time_max_over_median=1.1,
                    slowest_process=1,
                    host_rss_bytes=3 << 30,
                )
            f.write(json.dumps(r) + "\n")
    summary = json.loads((run / "summary.json").read_text())
    summary.update(predicted_peak_bytes=3 << 29, mem_peak_bytes=None, host_rss_bytes=3 << 30)
    (run / "summary.json").write_text(json.dumps(summary))
    out = run / "report"
    report.report(str(run))
    pngs = {p.name for p in out.iterdir() if p.suffix == ".png"}
    assert {"step_split.png", "stragglers.png", "memory.png"} <= pngs, pngs
    md = (out / "report.md").read_text()
    assert "| device memory peak (measured / predicted) | unavailable / 1.50 GiB |" in md, md
    assert "| host RSS (largest logged) | 3.00 GiB |" in md, md
    x, y = report.series(recs, "host_rss_bytes")
    assert y == [3.0] * len(x)  # bytes are drawn in GiB
