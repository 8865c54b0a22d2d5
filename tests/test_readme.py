"""Every command in README.md's code blocks runs, in the README's order, so the README cannot drift
from the CLI. A command runs as written unless one of two tables says otherwise: SHORTEN (a
command prefix -> the flags that make it a few tiny steps, and why) or SKIP (a command prefix ->
why it cannot run here). A command that is in neither and cannot be run fails the test, so a new
README command cannot go untested.

Each README section runs in a fresh directory under pytest's tmp_path (a section continues an
earlier one's directory where CONTINUES says so), so nothing is written into the checkout."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_env import cpu_env
from data_files import TEXTS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
# The programs a README command may start; anything else must be in SKIP.
PROGRAMS = {"python": sys.executable, "brigade": str(Path(sys.executable).parent / "brigade")}
# A training run made tiny: the README's commands train real models for minutes; here each one only
# has to prove that its flags parse, its mesh builds, its step compiles and runs, and it saves.
TINY = "--steps 2 --seq-len 32 --batch-size 8 --log-every 1 --eval-every 0 --train.sample_tokens 0"


@dataclasses.dataclass(frozen=True)
class Shorten:
    why: str
    flags: str = ""  # appended: a repeated flag's last value wins
    devices: int | None = None  # fake CPU devices when the command itself sets none (else 1)
    replace: tuple[tuple[str, str], ...] = ()  # text replaced in the command (or the Python block)
    prelude: str = ""  # Python run before a Python block


# Command prefix (or a Python block's first line) -> how it is shortened. A training command always
# runs with an explicit --run-dir (its own or one added here): the later commands of its section
# read that run directory back.
SHORTEN = {
    "python -m train": Shorten(
        "the default run, tiny, keeping one eval batch and a short sample"
        " (the README promises both)",
        "--model tiny --steps 2 --seq-len 32 --batch-size 8 --log-every 1 --train.eval_batches 1"
        " --train.sample_tokens 16 --run-dir runs/latest",
    ),
    "python -m train --mesh data=2,fsdp=2,model=2": Shorten(
        "the 8-device run, tiny; its own run directory, so it does not resume the run above",
        f"--model tiny {TINY} --run-dir runs/mesh",
    ),
    "python -m train --mesh data=4,tensor=2": Shorten("refused before anything runs: as written"),
    "python -m train plan": Shorten(
        "plan trains nothing: it runs as written (compile time does not grow with the model)"
    ),
    "brigade plan": Shorten(
        "plan trains nothing: it runs as written, on 8 fake CPU devices for the node's 8 GPUs",
        devices=8,
    ),
    "python -m train report": Shorten(
        "the README's /tmp/r is outside the test's directory", replace=(("/tmp/r", "report-out"),)
    ),
    "from mesh.build import make_mesh": Shorten(
        "the API walk-through of examples/quickstart.ipynb, which asks for 8 fake CPU devices in"
        " its first cell; 4 steps instead of 40 (the restore onto another mesh needs only a"
        " checkpoint)",
        devices=8,
        replace=(('"train.steps": 40', '"train.steps": 4'),),
    ),
    "from checkpoint import hf": Shorten(
        "a fragment: the reader brings `tokens`, `prompt_tokens` and `path`"
        " (here: the tiny model in INPUTS)",
        devices=8,
        prelude="import numpy as np\nfrom mesh.build import make_mesh\n"
        "tokens = prompt_tokens = np.array([[1, 2, 3, 4]], np.int32)\n"
        "path = 'path/to/Llama-3.2-1B'\n",
    ),
    "python -m train --config ckpt/hf/model.yaml": Shorten(
        "the fine-tune of the imported (tiny) model on the prepared chats, on the 8 devices its"
        " --mesh names",
        f"{TINY} --run-dir runs/latest",
        devices=8,
    ),
    "python -m train --config ckpt/hf/model.yaml --config configs/finetune.yaml"
    " --init-from ckpt/hf --data data/chats --lora.rank": Shorten(
        "the LoRA fine-tune of the imported (tiny) model, on the 8 devices of the fine-tune above",
        TINY,
        devices=8,
    ),
    "python -m train eval": Shorten(
        "an evaluation runs as written: the fine-tune above, or the import, on one device"
    ),
    "python -m train sample": Shorten(
        "sampling runs as written: 128 tokens of the fine-tuned tiny model"
    ),
    "python -m train --steps 1000": Shorten(
        "two steps, so the final checkpoint is step 2 (the export below reads it)",
        "--model tiny --steps 2 --seq-len 32 --batch-size 8 --eval-every 0 --train.sample_tokens 0",
    ),
    "python -m checkpoint export runs/long/checkpoints/1000": Shorten(
        "the run above ended at step 2", replace=(("checkpoints/1000", "checkpoints/2"),)
    ),
    "python -m train --model moe-default": Shorten(
        "the MoE preset of the tiny model", f"--model moe-tiny {TINY} --run-dir runs/moe"
    ),
    "python -m train --model moe-default --mesh expert=8": Shorten(
        "the same, expert parallel; its own run directory, so it does not resume the run above",
        f"--model moe-tiny {TINY} --run-dir runs/moe-expert",
    ),
    "python -m train --model moe-default --mesh data=2,expert=4": Shorten(
        "the same, capacity dispatch; its own run directory",
        f"--model moe-tiny {TINY} --run-dir runs/moe-capacity",
    ),
    "python -m train --model tiny --model.max_seq_len 32768": Shorten(
        "the 32k-token context=8 run at 64 tokens (tests/test_context.py trains the 32k one)",
        f"{TINY.replace('--seq-len 32', '--seq-len 64')} --run-dir runs/context",
    ),
    "brigade train": Shorten(
        "the 1B run on 8 GPUs, tiny, on 8 fake CPU devices", f"--model tiny {TINY}", devices=8
    ),
}
# Command prefix (or a Python block's first line) -> why it cannot run here.
SKIP = {
    "pip install": "changes the environment this suite runs in"
    " (the accelerator extras need CUDA or a TPU VM)",
    "pytest": "the whole suite, which this test is part of",
    "python -m train.harness": "needs the user's task directory; tests/test_harness.py runs the"
    " launcher on local tasks it writes",
    "import models, optax": "a sketch of the four extension points"
    " (the reader brings init, apply, batches); examples/extensions.ipynb runs them in full,"
    " executed by tests/test_notebook.py",
}
# Section -> the earlier section whose directory it continues (it reads a run made there).
HF_SECTION = (
    "HuggingFace checkpoints (Llama, Mistral, Mixtral, Qwen2/2.5, Qwen3, Qwen3-MoE, DeepSeek-V3,"
    " Gemma 1/2/3)"
)
CONTINUES = {
    "Run reports": HF_SECTION,
    "Fine-tuning, evaluation and sampling: `configs/finetune.yaml`, `eval`, `sample`": HF_SECTION,
}


def _hf_model(path: Path) -> None:
    """A tiny HF model directory: config.json, safetensors, a tokenizer of the tiny vocabulary and a
    chat template."""
    import jax

    from checkpoint.hf import save_pretrained
    from models import model as model_lib
    from models.hf import Model
    from models.presets import preset

    cfg = preset("tiny")
    save_pretrained(Model(cfg, jax.device_get(model_lib.init(cfg, jax.random.key(0)))), str(path))
    _tokenizer(path / "tokenizer.json")
    template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": template})
    )


def _chats(path: Path) -> None:
    path.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            )
            + "\n"
            for q, a in zip(TEXTS[::2], TEXTS[1::2])
        )
    )


def _finetune_config(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text((REPO / "configs" / "finetune.yaml").read_text())


def _corpus(path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
        )
    )


def _tokenizer(path: Path) -> None:
    hf_tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = hf_tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # 264 ids: the tiny model's vocabulary, so the 1B command shortened to `tiny` trains on it.
    tok.train_from_iterator(
        TEXTS,
        trainers.BpeTrainer(
            vocab_size=264,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(str(path))


# The inputs a README command assumes the reader has, made tiny in the section's directory before
# the first command that names them: path -> maker.
INPUTS = {
    "path/to/hf_model": _hf_model,
    "path/to/Llama-3.2-1B": _hf_model,
    "corpus/docs.jsonl.zst": _corpus,
    "tokenizer.json": _tokenizer,
    "chats.jsonl": _chats,
    "configs/finetune.yaml": _finetune_config,
}
# What a command leaves behind, where the README says so: command prefix -> paths,
# relative to its directory.
LEAVES = {
    "python -m checkpoint hf import": ["ckpt/hf/model.yaml"],
    "python -m train report runs/latest": ["runs/latest/report/report.md"],
    "python -m checkpoint export": ["params"],
    "python -m checkpoint hf export": ["out/hf_model/config.json"],
    "python -m train --steps 1000": ["runs/long/checkpoints/2"],
    "brigade prepare": ["data/web/index.json"],
}


@dataclasses.dataclass(frozen=True)
class Command:
    section: str
    line: int  # README line
    words: tuple[str, ...]  # the command without leading VAR=VALUE assignments
    env: tuple[tuple[str, str], ...]  # those assignments
    expected: tuple[str, ...] = ()  # the output lines the README shows
    source: str = ""  # a Python block's code

    @property
    def text(self) -> str:
        return self.source.splitlines()[0] if self.source else " ".join(self.words)


def _split_line(section: str, line: int, text: str) -> list[Command]:
    """One shell line -> its commands: `[--opt]` is run with the option, a lone `...` (the reader's
    own flags) is dropped, and `a && b` is two commands."""
    words = [
        w for w in shlex.split(re.sub(r"\[(--[^\]]*)\]", r"\1", text), comments=True) if w != "..."
    ]
    out, current = [], []
    for w in words + ["&&"]:
        if w != "&&":
            current.append(w)
            continue
        env = []
        while current and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", current[0]):
            env.append(tuple(current.pop(0).split("=", 1)))
        out.append(Command(section, line, tuple(current), tuple(env)))
        current = []
    return out


def _shell_commands(section: str, line: int, lang: str, body: str) -> list[Command]:
    lines = body.replace("\\\n", " ").splitlines()
    if lang in ("bash", "sh", "shell"):
        return [
            c
            for i, t in enumerate(lines)
            if t.strip() and not t.lstrip().startswith("#")
            for c in _split_line(section, line + 1 + i, t)
        ]
    # A console block: `$ ` lines are commands, the lines up to the next `$ ` their output.
    out: list[Command] = []
    for i, t in enumerate(lines):
        if t.startswith("$ "):
            out += _split_line(section, line + 1 + i, t[2:])
        elif out and t.strip():
            out[-1] = dataclasses.replace(out[-1], expected=out[-1].expected + (t.strip(),))
    if not out:  # a text block (the file map): it must hold nothing that reads like a command
        for t in lines:
            assert not re.match(r"\s*(python|pip|brigade|pytest|[A-Z_]+=)\b", t), (
                f"README: {t!r} in a text block"
            )
    return out


def readme_commands(text: str) -> list[Command]:
    """Every command of README.md's code blocks, in order, with the heading it is under."""
    out, section = [], ""
    fence = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
    heading = re.compile(r"^#{2,3} (.+)$", re.M)
    for m in fence.finditer(text):
        section = ([section] + heading.findall(text, 0, m.start()))[-1]
        line, lang, body = text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)
        if lang == "python":
            out.append(Command(section, line, ("python", "-"), (), source=body))
        elif lang in ("bash", "sh", "shell", "console", ""):
            out += _shell_commands(section, line, lang, body)
        else:
            raise AssertionError(
                f"README line {line}: a ```{lang} block; say here whether it holds commands"
            )
    return out


def _key(table: dict, cmd: Command) -> str:
    """The longest key of `table` that `cmd` starts with (whole words), else ''."""
    return max(
        (k for k in table if cmd.text.split()[: len(k.split())] == k.split()), key=len, default=""
    )


def _plan(cmd: Command) -> tuple[str, Shorten]:
    """'skip', 'run' or 'unknown' (neither runnable nor skipped), and how it is shortened."""
    skip, shorten = _key(SKIP, cmd), _key(SHORTEN, cmd)
    if skip and len(skip) > len(shorten):
        return "skip", Shorten(SKIP[skip])
    return ("run" if cmd.words[0] in PROGRAMS else "unknown"), SHORTEN.get(
        shorten, Shorten("as written")
    )


COMMANDS = readme_commands(README.read_text())


def test_every_readme_command_runs_or_is_skipped_with_a_reason():
    unknown = [f"README line {c.line}: `{c.text}`" for c in COMMANDS if _plan(c)[0] == "unknown"]
    assert not unknown, "commands neither runnable here nor in SKIP:\n" + "\n".join(unknown)
    # The tables name only what the README holds, so a stale entry cannot hide a missing command.
    for table in (SHORTEN, SKIP, LEAVES):
        for key in table:
            assert any(_key(table, c) == key for c in COMMANDS), (
                f"{key!r}: no README command starts so"
            )
    assert set(CONTINUES) | set(CONTINUES.values()) <= {c.section for c in COMMANDS}


def _run(cmd: Command, cwd: Path) -> subprocess.CompletedProcess:
    shorten = _plan(cmd)[1]
    env = dict(cmd.env)
    readme_flags = env.pop("XLA_FLAGS", "")
    count = re.search(r"--xla_force_host_platform_device_count=(\d+)", readme_flags)
    # The suite's env (compilation cache, LLVM level), with the README's device count and flags.
    run_env = cpu_env(int(count.group(1)) if count else shorten.devices or 1, **env)
    run_env["XLA_FLAGS"] += " " + re.sub(
        r"--xla_force_host_platform_device_count=\S+", "", readme_flags
    )
    text, source = " ".join(shlex.quote(w) for w in cmd.words), shorten.prelude + cmd.source
    for old, new in shorten.replace:
        text, source = text.replace(old, new), source.replace(old, new)
    for (
        path,
        make,
    ) in INPUTS.items():  # a word naming it (a glob, or after `kind:`), or the Python code
        named = (
            any(fnmatch.fnmatch(path, w.split(":")[-1]) for w in shlex.split(text))
            or path in source
        )
        if named and not (cwd / path).exists():
            make(cwd / path)
    words = shlex.split(text) + shlex.split(shorten.flags)
    outside = [w for w in words[1:] if w.startswith("/")]
    assert not outside, (
        f"README line {cmd.line}: {outside} is outside the test's directory:"
        " add a replace to SHORTEN"
    )
    return subprocess.run(
        [PROGRAMS[words[0]]] + words[1:],
        cwd=cwd,
        env=run_env,
        input=source or None,
        capture_output=True,
        text=True,
        timeout=900,
    )


def _check(cmd: Command, result: subprocess.CompletedProcess, cwd: Path) -> None:
    where = f"README line {cmd.line}: `{cmd.text}`"
    output = result.stdout + result.stderr
    # The README's rule: bad input is one line starting `error:` and exit status 2.
    status = 2 if any(e.startswith("error:") for e in cmd.expected) else 0
    assert result.returncode == status, f"{where}: exit {result.returncode}\n{output[-3000:]}"
    lines = {s.strip() for s in output.splitlines()}
    for expected in cmd.expected:
        assert expected in lines, f"{where}: the README shows {expected!r}; got\n{output[-3000:]}"
    for shown in re.findall(r"^print\(.*#\s*'([^']*)'", cmd.source, re.M):  # `print(x)  # 'value'`
        assert shown in result.stdout, f"{where}: the README shows {shown!r}; got\n{output[-3000:]}"
    for path in LEAVES.get(_key(LEAVES, cmd), []):
        assert (cwd / path).exists(), f"{where}: {path} not written; output:\n{output[-3000:]}"


def _repo_files(paths: list[str]) -> str:
    """What git sees at `paths` (ignored files too): a command that wrote into the checkout shows
    here."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "--", *paths],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout


@pytest.mark.slow
def test_readme_commands(tmp_path):
    """Each section's commands in order in its own directory: exit status, the output the README
    shows, the files it says a command writes; and the checkout is left as it was."""
    # Where a command run in the checkout would write: the top directories its path arguments name.
    # Not runs/: ignored by git, it holds the developer's own runs, which other processes may start.
    touched = sorted(
        {
            w.split("/")[0]
            for c in COMMANDS
            for w in c.words + tuple(INPUTS)
            if "/" in w and not w.startswith(("-", "/")) and "=" not in w
        }
        - {"runs"}
    )
    before, dirs, done = _repo_files(touched), {}, set()
    for cmd in COMMANDS:
        if cmd.section not in dirs:
            dirs[cmd.section] = dirs.get(
                CONTINUES.get(cmd.section), tmp_path / f"section{len(dirs)}"
            )
            dirs[cmd.section].mkdir(exist_ok=True)
        if _plan(cmd)[0] != "run":
            continue
        result = _run(cmd, dirs[cmd.section])
        _check(cmd, result, dirs[cmd.section])
        if (cmd.section, cmd.words) in done and cmd.words[:3] == ("python", "-m", "train"):
            # The README: "the same command again continues from the latest committed step".
            assert re.search(r"already reached --steps|resum", result.stdout + result.stderr), (
                f"README line {cmd.line}: the same command again did not continue the run:\n"
                f"{result.stdout[-2000:]}"
            )
        done.add((cmd.section, cmd.words))
    assert _repo_files(touched) == before, "a README command wrote into the checkout"


def _readme_test_command() -> str:
    """The README's test command: the line of "The two commands" that runs pytest, its comment
    cut."""
    block = re.search(r"## The two commands\s+```bash\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md: no bash block under 'The two commands'"
    lines = [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if "pytest" in ln]
    assert len(lines) == 1, (
        f"README.md: one test command expected under 'The two commands', got {lines}"
    )
    return lines[0]


@pytest.mark.parametrize("job", ["run", "run-jax-latest"])
def test_ci_runs_the_readme_test_command(job):
    """CI runs the README's test command in the same words, so CI cannot pass a command a newcomer
    is not shown (it once ran `python -m pytest`, whose path differs from plain `pytest`'s); both
    jobs (the oldest and the newest jax) run it, and the README names both."""
    ci = [ln.strip() for ln in (REPO / ".ci" / job).read_text().splitlines()]
    assert _readme_test_command() in ci, (
        f".ci/{job} does not run the README's `{_readme_test_command()}`"
    )
    assert f"`.ci/{job}`" in README.read_text(), f"README.md does not name .ci/{job}"


def test_test_helpers_imported_one_way():
    """Test helpers are imported as top-level modules (tests/ is on pytest's path): `tests.x` is
    importable only when the project root is on the path as well, as with `python -m pytest`."""
    wrong = [
        f"{p.name}: {ln.strip()}"
        for p in sorted((REPO / "tests").glob("*.py"))
        for ln in p.read_text().splitlines()
        if re.match(r"\s*(from|import) tests\b", ln)
    ]
    assert not wrong, wrong


@pytest.mark.slow
def test_plain_pytest_collects_every_file(tmp_path):
    """`pytest` as the README writes it (the console script, not `python -m pytest`), started from
    the project root with nothing added to PYTHONPATH, collects every test file without an error."""
    env = {k: v for k, v in cpu_env(8).items() if k != "PYTHONPATH"}
    pytest_script = Path(sys.executable).parent / "pytest"
    r = subprocess.run(
        [str(pytest_script), "--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR")]
    assert r.returncode == 0 and not errors, r.stdout[-3000:] + r.stderr[-2000:]
    files = {ln.split("::")[0] for ln in r.stdout.splitlines() if "::" in ln}
    assert files == {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")}, files
