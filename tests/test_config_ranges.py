"""Every numeric option's declared range: a value outside it is one line naming the option and the
range, exit 2, whether it comes from a flag or a YAML file; presets and shipped configs stay
valid."""

import dataclasses
import glob
import math
import os
import typing

import pytest

from errors import UserError
from models.fields import Range, check_ranges, numeric_fields, ranged
from models.presets import PRESETS
from train.cli.main import main
from train.core.config import SECTIONS, build, from_args
from train.core.flags import public_flag

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (option, value as typed, the option as the message names it, the range it states)
OUT_OF_RANGE = [
    ("train.lr", "nan", "--lr", "a finite number > 0"),
    ("train.lr", "-0.01", "--lr", "a finite number > 0"),
    ("train.lr", "inf", "--lr", "a finite number > 0"),
    ("train.steps", "0", "--steps", "an integer >= 1"),
    ("train.micro_batches", "-2", "--micro-batches", "an integer >= 1"),
    ("train.warmup_steps", "-5", "--train.warmup_steps", "an integer >= 0"),
    ("train.b1", "1.5", "--train.b1", "a number in [0, 1)"),
    ("train.b2", "-0.1", "--train.b2", "a number in [0, 1)"),
    ("train.grad_clip", "-1", "--train.grad_clip", "a finite number >= 0"),
    ("train.min_lr_ratio", "2", "--train.min_lr_ratio", "a number in [0, 1]"),
    ("train.eps", "0", "--train.eps", "a finite number > 0"),
    ("train.weight_decay", "nan", "--train.weight_decay", "a finite number >= 0"),
    ("train.seed", "-1", "--seed", "an integer in [0, 9223372036854775807]"),
    ("train.step_timeout", "inf", "--train.step_timeout", "a finite number >= 0"),
    ("train.sample_tokens", "-1", "--train.sample_tokens", "an integer >= 0"),
    ("parallelism.num_processes", "0", "--num-processes", "an integer >= 1"),
    ("parallelism.peer_timeout", "0", "--parallelism.peer_timeout", "a finite number > 0"),
    ("data.prefetch", "-1", "--data.prefetch", "an integer >= 1"),
    ("data.eval_fraction", "1.5", "--data.eval_fraction", "a number in [0, 1)"),
    ("data.eval_fraction", "-0.1", "--data.eval_fraction", "a number in [0, 1)"),
    ("logging.log_every", "0", "--log-every", "an integer >= 1"),
    ("logging.peak_tflops", "-inf", "--peak-tflops", "a finite number >= 0"),
    ("checkpoint.keep", "-1", "--checkpoint.keep", "an integer >= 0"),
    ("checkpoint.every", "-2", "--checkpoint.every", "an integer >= 0"),
    ("checkpoint.keep_every", "-1", "--checkpoint.keep_every", "an integer >= 0"),
    ("comm.topk_fraction", "1.5", "--comm.topk_fraction", "a number in (0, 1]"),
    ("comm.outer_momentum", "1", "--comm.outer_momentum", "a number in [0, 1)"),
    ("comm.outer_lr", "nan", "--comm.outer_lr", "a finite number > 0"),
    ("comm.sync_every", "0", "--comm.sync_every", "an integer >= 1"),
    ("pipeline.repeats", "0", "--pipeline.repeats", "an integer >= 1"),
    ("pipeline.microbatches", "-1", "--pipeline.microbatches", "an integer >= 0"),
    ("model.d_model", "0", "--model.d_model", "an integer >= 1"),
    ("model.n_layers", "-1", "--model.n_layers", "an integer >= 1"),
    ("model.vocab_size", "0", "--model.vocab_size", "an integer >= 1"),
    ("model.rope_theta", "-1", "--model.rope_theta", "a finite number > 0"),
    ("model.rope_scaling_factor", "0.5", "--model.rope_scaling_factor", "a finite number >= 1"),
    ("model.norm_eps", "nan", "--model.norm_eps", "a finite number > 0"),
    ("model.init_std", "inf", "--model.init_std", "a finite number > 0"),
    ("model.capacity_factor", "0", "--model.capacity_factor", "a finite number > 0"),
    ("model.aux_loss_coef", "-0.1", "--model.aux_loss_coef", "a finite number >= 0"),
    ("model.n_experts", "-1", "--model.n_experts", "an integer >= 0"),
]


def _one_line(err: UserError, shown: str, rng: str) -> str:
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith(f"{shown} ") and f": must be {rng}" in msg, msg
    return msg


@pytest.mark.parametrize(
    "option,value,shown,rng", OUT_OF_RANGE, ids=[f"{c[0]}={c[1]}" for c in OUT_OF_RANGE]
)
def test_out_of_range_flag_and_yaml(tmp_path, option, value, shown, rng):
    with pytest.raises(UserError) as by_flag:
        from_args([f"--{option}={value}"])  # `=`: argparse would take a lone -inf for an option
    msg = _one_line(by_flag.value, shown, rng)
    section, name = option.split(".")
    y = tmp_path / "c.yaml"
    y.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(UserError) as by_yaml:
        build(None, str(y))
    # the same check, the same words, whichever way the value came in
    assert str(by_yaml.value) == msg


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf"])
def test_yaml_native_nan_and_inf_are_rejected(tmp_path, text):
    y = tmp_path / "c.yaml"
    y.write_text(f"train:\n  lr: {text}\n")
    with pytest.raises(UserError) as e:
        build(None, str(y))
    _one_line(e.value, "--lr", "a finite number > 0")


def test_eval_fraction_names_itself_not_seq_len():
    with pytest.raises(UserError) as e:
        build({"data.eval_fraction": 1.5})
    assert "--seq-len" not in str(e.value) and "held out for eval" in str(e.value)


def test_eval_batches_zero_only_while_evaluating():
    with pytest.raises(
        UserError, match=r"^--train.eval_batches 0: must be >= 1 while --eval-every 60"
    ):
        build({"train.eval_batches": 0})
    assert build({"train.eval_batches": 0, "train.eval_every": 0}).train.eval_batches == 0


def test_process_id_below_num_processes():
    with pytest.raises(
        UserError, match=r"^--process-id 2: must be in \[0, 1\] for --num-processes 2$"
    ):
        build({"parallelism.num_processes": 2, "parallelism.process_id": 2})


def test_warmup_longer_than_the_run_is_accepted():
    # short smoke runs keep the default warmup; train/core/optim.py cuts it to the run
    # (tests/test_train.py)
    assert build({"train.steps": 5, "train.warmup_steps": 50}).train.warmup_steps == 50


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_numeric_field_declares_a_range(section):
    cls = SECTIONS[section]
    for f in numeric_fields(cls):
        assert isinstance(f.metadata.get("range"), Range), (
            f"{section}.{f.name} has no declared range"
        )


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_field_declares_its_help_text(section):
    for f in dataclasses.fields(SECTIONS[section]):
        assert f.metadata.get("help"), f"{section}.{f.name} has no help text"


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_float_field_rejects_nan_and_inf(section):
    base = PRESETS["tiny"] if section == "model" else SECTIONS[section]()
    hints = typing.get_type_hints(SECTIONS[section])
    for f in numeric_fields(SECTIONS[section]):
        for bad in (math.nan, math.inf, -math.inf) if hints[f.name] is float else ():
            with pytest.raises(UserError, match=f"^{public_flag(section, f.name)} {bad}: must be "):
                dataclasses.replace(base, **{f.name: bad}).validate()


def test_a_field_without_a_range_is_a_programming_error():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        n: int = 3

    with pytest.raises(TypeError, match="Loose.n has no declared range"):
        check_ranges(Loose(), lambda name: f"--x.{name}")


def test_range_syntax():
    @dataclasses.dataclass(frozen=True)
    class Timeouts:
        wait: float = ranged(1.0, "[0, inf]")  # inf named with a closed bracket: allowed
        ratio: float = ranged(0.5, "(0, 1]")

    check_ranges(Timeouts(wait=math.inf), lambda name: f"--t.{name}")
    with pytest.raises(UserError, match=r"^--t.wait nan: must be a number in \[0, inf\]$"):
        check_ranges(Timeouts(wait=math.nan), lambda name: f"--t.{name}")
    with pytest.raises(UserError, match=r"^--t.ratio 0.0: must be a number in \(0, 1\]$"):
        check_ranges(Timeouts(ratio=0.0), lambda name: f"--t.{name}")
    assert Range.parse(f"[0, {2**63 - 1}]").admits(2**63 - 1) and not Range.parse(
        f"[0, {2**63 - 1}]"
    ).admits(2**63)
    with pytest.raises(ValueError, match="expected >X"):
        Range.parse("positive")


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate(name):
    assert PRESETS[name].validate() is PRESETS[name]
    assert build({"model.preset": name}).model == PRESETS[name]


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))), ids=os.path.basename
)
def test_shipped_configs_validate(path):
    assert build(None, path).train.steps >= 1


# ------------------------------------------------------------------ the real CLI, in-process

CLI = [
    (["--lr", "nan"], "--lr nan: must be a finite number > 0"),
    (["--train.b1", "1.5"], "--train.b1 1.5: must be a number in [0, 1)"),
    (["--data.eval_fraction", "1.5"], "--data.eval_fraction 1.5: must be a number in [0, 1)"),
    (["--config", "{yaml}"], "--checkpoint.keep -1: must be an integer >= 0"),
]


@pytest.mark.parametrize("args,needle", CLI, ids=[c[1].split(":")[0] for c in CLI])
def test_cli_exits_2_with_one_line(tmp_path, capsys, args, needle):
    (tmp_path / "c.yaml").write_text("checkpoint:\n  keep: -1\n")
    argv = [a.format(yaml=tmp_path / "c.yaml") for a in args] + [
        "--run-dir",
        str(tmp_path / "never"),
    ]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"error: {needle}"), err
    assert not (tmp_path / "never").exists()
