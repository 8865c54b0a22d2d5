"""Every numeric flag of every command goes through the ranges the config fields use (errors.py
check_number): NaN, infinity and out-of-range values are one line naming the flag and its range,
exit 2; `plan --search` refuses the sizes it cannot rank in about a minute."""

import argparse

import pytest

from errors import ArgParser, UserError, number
from plan.__main__ import main as plan_main
from train.core.config import SECTIONS, build
from train.core.config import make_parser as train_parser

# every command's parser and the positional arguments it needs to parse
COMMANDS = {
    "train": (train_parser, []),
    "plan": ("plan.cli:make_plan_parser", []),
    "eval": ("train.cli.evaluate:make_eval_parser", ["CKPT", "--data", "D"]),
    "sample": ("train.cli.sample:make_sample_parser", ["CKPT", "--prompt", "x"]),
    "prepare": ("train.data.prepare:make_parser", ["IN", "--out", "OUT"]),
    "checkpoint": ("checkpoint.__main__:_parser", ["inspect", "P"]),
    "mesh.bench": ("mesh.bench:make_parser", []),
}


def _parser(name: str) -> ArgParser:
    make = COMMANDS[name][0]
    if isinstance(make, str):
        import importlib

        module, _, attr = make.partition(":")
        make = getattr(importlib.import_module(module), attr)
    return make()


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        else:
            yield action


def _numeric(name: str) -> list[argparse.Action]:
    return [
        a for a in _actions(_parser(name)) if a.type in (int, float) or isinstance(a.type, number)
    ]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_numeric_flag_declares_its_range(name):
    for action in _numeric(name):
        if isinstance(action.type, number):
            continue
        # a bare int/float is a config field's flag: build() checks the field's declared range
        section, _, field = action.dest.partition(".")
        assert section in SECTIONS and field, f"{name}: {action.option_strings} has no range"


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "train"])
def test_out_of_range_numbers_are_one_line_naming_the_flag(name):
    flags = [a for a in _numeric(name) if isinstance(a.type, number)]
    assert flags or name == "checkpoint", f"{name}: no numeric flag found"
    for action in flags:
        flag = max(action.option_strings, key=len)
        for bad in ["-1"] + (["nan", "inf", "-inf"] if action.type.tp is float else []):
            with pytest.raises(UserError) as e:
                _parser(name).parse_args([*COMMANDS[name][1], f"{flag}={bad}"])
            msg = str(e.value)
            assert msg.startswith(f"{flag} ") and ": must be " in msg and "\n" not in msg, msg


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--fail-rate", "nan"], "error: --fail-rate nan: must be a finite number >= 0"),
        (["--fail-rate", "-1"], "error: --fail-rate -1.0: must be a finite number >= 0"),
        (["--restart-s", "inf"], "error: --restart-s inf: must be a finite number >= 0"),
        (["--top", "0"], "error: --top 0: must be an integer >= 1"),
        (
            ["--search", "1000000007"],
            "error: --search 1000000007: must be an integer in [0, 1048576]",
        ),
        (["--search", "720720"], "error: --search 720720: its many divisors make 3429216"),
    ],
)
def test_plan_numbers(capsys, argv, line):
    assert plan_main(["--model", "tiny", "--hardware", "h100", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(line), err


def test_search_sizes_that_rank_are_accepted():
    from plan.cli import MAX_SEARCH_DEVICES, MAX_SEARCH_MESHES, check_search_size, mesh_count

    for n in (8, 4096, 98304, MAX_SEARCH_DEVICES):  # 98,304 = 3 * 2^15 GPUs: 93,024 meshes
        check_search_size(n)
    assert mesh_count(MAX_SEARCH_DEVICES) < MAX_SEARCH_MESHES < mesh_count(55440)


def test_an_unparsable_number_is_still_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        _parser("sample").parse_args(["CKPT", "--prompt", "x", "--top-k", "many"])
    assert e.value.code == 2
    assert "argument --top-k: expected an integer, got 'many'" in capsys.readouterr().err


def test_config_flags_keep_their_own_check():
    with pytest.raises(UserError, match=r"^--lr nan: must be a finite number > 0$"):
        build({"train.lr": float("nan")})
