"""`brigade COMMAND [ARGS...]`, the console script (pyproject's [project.scripts]): one name for
the project's entry points. Each command hands its arguments to the `python -m` form's own main,
which stays the same; nothing is imported before the command is known (`brigade --help` starts
no JAX).
"""

from __future__ import annotations

import sys

from errors import UserError, one_line_errors


def _train(argv: list[str]) -> int:
    from train.cli.main import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    # `python -m train plan`: train's entry point may dispatch to plan
    from train.cli.main import main

    return main(["plan", *argv])


def _report(argv: list[str]) -> int:
    from train.cli.main import main

    return main(["report", *argv])


def _prepare(argv: list[str]) -> int:
    from train.data.__main__ import main

    return main(["prepare", *argv])


def _harness(argv: list[str]) -> int:
    from train.cli.harness_launcher import main

    return main(argv)


def _checkpoint(command: str):
    def run(argv: list[str]) -> int:
        from checkpoint.__main__ import main

        return main([command, *argv])

    return run


# command -> (what it does, the `python -m` form it is, its main)
COMMANDS = {
    "train": ("train a model on a device mesh", "python -m train", _train),
    "plan": (
        "compile the step ahead of time: memory, FLOPs, collectives, cost, mesh search",
        "python -m train plan",
        _plan,
    ),
    "doctor": (
        "check a run's environment, cluster, layout and inputs before it runs",
        "python -m train doctor",
        lambda a: _train(["doctor", *a]),
    ),
    "report": (
        "plot a run's metrics and summarise it in markdown",
        "python -m train report",
        _report,
    ),
    "eval": (
        "loss and perplexity of a checkpoint on prepared datasets",
        "python -m train eval",
        lambda a: _train(["eval", *a]),
    ),
    "sample": (
        "generate text from a checkpoint (--chat: the model's chat template)",
        "python -m train sample",
        lambda a: _train(["sample", *a]),
    ),
    "harness": (
        "lm-evaluation-harness tasks on a checkpoint (lm_eval's flags)",
        "python -m train.harness",
        _harness,
    ),
    "prepare": (
        "tokenise text, JSONL, Parquet or a HuggingFace dataset into shards",
        "python -m train.data prepare",
        _prepare,
    ),
    "hf": (
        "import a HuggingFace checkpoint, or export one: hf import|export ...",
        "python -m checkpoint hf",
        _checkpoint("hf"),
    ),
    "inspect": (
        "a checkpoint's step, config, mesh and arrays",
        "python -m checkpoint inspect",
        _checkpoint("inspect"),
    ),
    "export": (
        "write a parameters-only checkpoint",
        "python -m checkpoint export",
        _checkpoint("export"),
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join(
        [
            "usage: brigade COMMAND [ARGS...]   (brigade COMMAND --help: that command's options)",
            "",
            "commands:",
        ]
        + [f"  {name:<{width}}  {what} (= {form})" for name, (what, form, _) in COMMANDS.items()]
    )


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["--help"], ["-h"], ["help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        got = f"unknown command '{argv[0]}'" if argv else "no command"
        raise UserError(f"brigade: {got}; valid: {', '.join(COMMANDS)} (brigade --help)")
    return COMMANDS[argv[0]][2](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
