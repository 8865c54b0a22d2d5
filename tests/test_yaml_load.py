"""A YAML file from the user (`--config`, a data mixture file) is read without trusting it: a key
given twice, an alias bomb, an oversized or binary file are each one line naming the file."""

import pytest

from errors import UserError
from train.core.config import build
from train.data.sources import parse_mixture


def _build(tmp_path, text: str | bytes):
    path = tmp_path / "c.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return build(None, str(path))


@pytest.mark.parametrize(
    "text, words",
    [
        ("train: {lr: 0.5}\ntrain: {steps: 3}\n", ["key 'train'", "lines 1 and 2"]),
        ("train:\n  lr: 0.5\n  steps: 3\n  lr: 0.1\n", ["key 'lr' in 'train'", "lines 2 and 4"]),
        ("train: {lr: 0.5, lr: 0.1}\n", ["key 'lr' in 'train'", "lines 1 and 1"]),
        (
            "model:\n  preset: tiny\ntrain:\n  'steps': 3\n  steps: 4\n",
            ["'steps'", "lines 4 and 5"],
        ),
    ],
)
def test_a_key_given_twice_names_it_and_both_lines(tmp_path, text, words):
    with pytest.raises(UserError) as e:
        _build(tmp_path, text)
    assert "\n" not in str(e.value) and str(e.value).startswith("--config: '"), e.value
    assert all(w in str(e.value) for w in words), e.value


def test_merge_keys_may_be_overridden(tmp_path):
    # the defaults-by-merge idiom: the one place a key may be given twice
    cfg = _build(tmp_path, "train:\n  <<: {steps: 3, lr: 0.5}\n  lr: 0.25\n")
    assert cfg.train.lr == 0.25 and cfg.train.steps == 3


def _bomb(levels: int, width: int = 9) -> str:
    lines = ["a0: &a0 [lol]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "train:\n  " + "\n  ".join(lines) + f"\n  lr: *a{levels - 1}\n"


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    # the refusal counts nodes on the composed graph, where each alias is one shared node: the 43
    # million lists are never built (the test itself would not return otherwise)
    with pytest.raises(UserError, match=r"aliases expand to \d+ nodes, more than the 100000"):
        _build(tmp_path, _bomb(9))  # 9**8 ~ 43 million lists once expanded
    with pytest.raises(UserError, match="more than 100 alias uses"):
        _build(tmp_path, "train:\n  a: &a 1\n  b: [" + ", ".join(["*a"] * 101) + "]\n")


def test_an_alias_inside_itself_is_refused(tmp_path):
    with pytest.raises(UserError, match="contains it"):
        _build(tmp_path, "train: &t\n  lr: *t\n")


def test_a_few_aliases_still_work(tmp_path):
    cfg = _build(tmp_path, "train:\n  steps: &n 7\n  warmup_steps: *n\n")
    assert cfg.train.steps == cfg.train.warmup_steps == 7


def test_size_binary_and_nesting_are_one_line(tmp_path):
    with pytest.raises(UserError, match=r"larger than 262144 bytes \(256 KiB\)"):
        _build(tmp_path, "train:\n  prompt: '" + "x" * (300 << 10) + "'\n")
    with pytest.raises(UserError, match=r"not UTF-8 text \(byte 0xff at offset 2\)"):
        _build(tmp_path, b"PK\xff\xfe\x00\x01" * 64)
    with pytest.raises(UserError, match="nests lists or mappings deeper"):
        _build(tmp_path, "train: " + "[" * 5000 + "]" * 5000 + "\n")
    assert _build(tmp_path, b"\xef\xbb\xbftrain: {steps: 5}\n").train.steps == 5  # a BOM is fine


def test_the_largest_accepted_file_loads(tmp_path):
    # its slowest content, a flow list of small ints, loads in ~2.5 s on one core (a 30 MB value
    # took minutes); a figure for the docstring, not an assertion: tests do not time
    from train.data import yaml_load

    path = tmp_path / "big.yaml"
    body = "x: [" + "1, " * ((yaml_load.MAX_BYTES - 16) // 3) + "]\n"
    path.write_text(body)
    assert len(body) <= yaml_load.MAX_BYTES
    assert len(yaml_load.load(str(path), "--config")["x"]) > 80_000


def test_a_mixture_file_is_read_the_same_way(tmp_path):
    (tmp_path / "mix.yaml").write_text(
        "- {source: default, weight: 1}\n- {source: synthetic, weight: 1, weight: 2}\n"
    )
    with pytest.raises(UserError, match=r"^--data: '.*mix.yaml': key 'weight' .*lines 2 and 2"):
        parse_mixture(str(tmp_path / "mix.yaml"))
