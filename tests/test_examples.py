"""The launch examples and the GPU benchmark stay in step with the CLI (fast: no training)."""

import functools
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "examples" / "slurm.sbatch"
K8S = REPO / "examples" / "k8s-jobset.yaml"
GPU = REPO / "benchmarks" / "gpu.py"


def train_flags(text: str) -> set[str]:
    """Every --flag given to `python -m train` in shell text (backslash-continued lines joined)."""
    flags = set()
    for line in text.replace("\\\n", " ").splitlines():
        if "-m train" in line:
            flags |= set(re.findall(r"(?<!\S)--[A-Za-z][\w.-]*", line.split("-m train", 1)[1]))
    return flags


def strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)


def k8s_docs() -> list[dict]:
    return list(yaml.safe_load_all(K8S.read_text()))


def k8s_commands() -> list[str]:
    return [s for d in k8s_docs() for s in strings(d) if "-m train" in s]


@functools.cache
def gpu_dry_run() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GPU), "--dry-run", "--", "--seed", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@functools.cache
def train_help() -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "train", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def cli_missing() -> bool:
    r = train_help()
    return r.returncode != 0 and "No module named train.__main__" in r.stderr


def arg(command: str, flag: str) -> str:
    return re.search(rf"{re.escape(flag)}[ =](\S+)", command).group(1)


def test_k8s_yaml_parses_and_names_line_up():
    docs = k8s_docs()
    assert [d["kind"] for d in docs] == ["JobSet", "Service", "Job"]
    for d in docs:  # the header's `kubectl apply -l brigade.example/variant=...` relies on these
        assert d["metadata"]["labels"]["brigade.example/variant"] in ("jobset", "indexed-job")
    jobset, svc, job = docs
    # JobSet pod DNS: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain = jobset name>
    rjob = jobset["spec"]["replicatedJobs"][0]
    js_cmd = next(s for s in strings(jobset) if "-m train" in s)
    assert (
        arg(js_cmd, "--coordinator").split(":")[0]
        == f"{jobset['metadata']['name']}-{rjob['name']}-0-0.{jobset['metadata']['name']}"
    )
    # Indexed Job pod DNS: <job>-<index>.<subdomain>, and the subdomain must be
    # the headless Service.
    pod = job["spec"]["template"]["spec"]
    assert svc["spec"]["clusterIP"] == "None" and pod["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"]["job-name"] == job["metadata"]["name"]
    job_cmd = next(s for s in strings(job) if "-m train" in s)
    assert (
        arg(job_cmd, "--coordinator").split(":")[0]
        == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    )
    for spec, cmd in ((rjob["template"]["spec"], js_cmd), (job["spec"], job_cmd)):
        n = spec["parallelism"]
        assert spec["completionMode"] == "Indexed" and spec["completions"] == n
        assert int(arg(cmd, "--num-processes")) == n
        assert '--process-id "$JOB_COMPLETION_INDEX"' in cmd
        dcn = [int(p.split("=")[1]) for p in arg(cmd, "--mesh-dcn").split(",")]
        assert math.prod(dcn) == n, "--mesh-dcn must multiply to the number of processes (pods)"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_sbatch_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "--mesh-dcn" in train_flags(SBATCH.read_text())


def test_gpu_dry_run_prints_commands():
    r = gpu_dry_run()
    assert r.returncode == 0, r.stderr
    cmds = [line for line in r.stdout.splitlines() if "-m train" in line]
    assert len(cmds) >= 2 and all("--seed 1" in c for c in cmds)  # args after `--` reach every run
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in r.stdout
    # the long-context case at 32k tokens, and the expert-parallel MoE case shown as for 8 GPUs
    assert any("--model.attention cudnn --model.max_seq_len 32768" in c for c in cmds)
    assert any("--seq-len 32768" in c and "--batch-size 1 " in c for c in cmds)
    ragged = [c for c in cmds if "--model.ep_exchange ragged" in c]
    assert ragged and all("--mesh expert=8" in c for c in ragged)


@pytest.mark.skipif(cli_missing(), reason="the train CLI (train/__main__.py) does not exist yet")
def test_every_flag_used_is_one_the_cli_accepts():
    r = train_help()
    assert r.returncode == 0, r.stderr
    used = {
        "examples/slurm.sbatch": train_flags(SBATCH.read_text()),
        "examples/k8s-jobset.yaml": set().union(*(train_flags(c) for c in k8s_commands())),
        "benchmarks/gpu.py": train_flags(gpu_dry_run().stdout),
    }
    for source, flags in used.items():
        assert flags, f"no train flags found in {source}"
        # `--model` must match as a whole word, not as the prefix of `--model.dtype`.
        unknown = sorted(f for f in flags if not re.search(re.escape(f) + r"(?![\w.-])", r.stdout))
        assert not unknown, f"{source} uses flags missing from `python -m train --help`: {unknown}"
