"""Untrusted input to `python -m checkpoint hf`: a HuggingFace directory whose config.json,
safetensors headers or index lie, and a Brigade checkpoint whose metadata does not describe its
arrays, are each refused in one line naming the culprit (exit 2, no traceback) before anything is
written."""

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

import jax
from test_hf import CASES, make_hf

from checkpoint import hf
from checkpoint.__main__ import main as checkpoint_main
from checkpoint.hf_files import INDEX, SAFETENSORS, load_params, read_config
from errors import UserError
from models import hf_config

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One tiny GQA Llama as `single` (model.safetensors), as `sharded` (two shards and an index)
    and imported through the CLI as the Brigade checkpoint `ckpt`: the inputs every case
    corrupts."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("good")
    make_hf(root / "single", **CASES["gqa"])
    tensors = load_file(str(root / "single" / SAFETENSORS))
    (root / "sharded").mkdir()
    shutil.copy(root / "single" / "config.json", root / "sharded")
    names, weight_map = sorted(tensors), {}
    for shard, part in zip(SHARDS, (names[::2], names[1::2])):
        save_file(
            {n: tensors[n] for n in part}, str(root / "sharded" / shard), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(part, shard))
    (root / "sharded" / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model_type, cfg = hf_config.config_from_hf(read_config(str(root / "single")))
    one, two = (load_params(str(root / d), model_type, cfg) for d in ("single", "sharded"))
    # the shards hold the same model
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, one, two)))
    assert checkpoint_main(["hf", "import", str(root / "single"), "--out", str(root / "ckpt")]) == 0
    return root


def _refused(capsys, argv, out, words):
    """main(argv) exits 2 with one `error:` line holding every word, and `out` was never created."""
    assert checkpoint_main(["hf", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "Traceback" not in err, err
    missing = [w for w in words if w not in err]
    assert not missing, f"{missing} not in {err}"
    assert not os.path.exists(out) and not [
        p for p in os.listdir(os.path.dirname(out)) if ".partial-" in p
    ]


# -- corrupting a directory ------------------------------------------------------------------------
def _edit_json(name, edit):
    def mutate(d):
        doc = json.loads((d / name).read_text())
        (d / name).write_text(json.dumps(edit(doc)))  # json.dumps writes NaN for float("nan")

    return mutate


def _config(**changes):
    return _edit_json("config.json", lambda cfg: {**cfg, **changes})


def _write(name, text):
    return lambda d: (d / name).write_text(text)


def _split(file):
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _header(edit, file=SAFETENSORS, claimed=None):
    """Rewrite a safetensors file's header as edit(header) (a JSON value, or raw bytes); `claimed`
    replaces the 8-byte header length."""

    def mutate(d):
        header, data = _split(d / file)
        blob = edit(header)
        raw = blob if isinstance(blob, bytes) else json.dumps(blob).encode()
        (d / file).write_bytes((claimed or len(raw)).to_bytes(8, "little") + raw + data)

    return mutate


def _append(file, data):
    def mutate(d):
        with open(d / file, "ab") as f:
            f.write(data)

    return mutate


def _entry(name, **changes):
    return _header(lambda h: {**h, name: {**h[name], **changes}})


def _resave(edit):
    """Rewrite model.safetensors through safetensors itself (a well-formed file), tensors edited."""

    def mutate(d):
        from safetensors.numpy import load_file, save_file

        save_file(edit(load_file(str(d / SAFETENSORS))), str(d / SAFETENSORS))

    return mutate


def _outside(rel):
    """Point one weight_map entry at a valid shard copied outside the directory, named by `rel`
    (a function of the directory)."""

    def mutate(d):
        (d.parent / "elsewhere").mkdir()
        shutil.copy(d / SHARDS[0], d.parent / "elsewhere" / SHARDS[0])
        doc = json.loads((d / INDEX).read_text())
        doc["weight_map"]["model.embed_tokens.weight"] = rel(d)
        (d / INDEX).write_text(json.dumps(doc))

    return mutate


def _move_tensor(doc):
    name = next(n for n, s in doc["weight_map"].items() if s == SHARDS[0])
    doc["weight_map"][name] = SHARDS[1]
    return doc


EMBED = "model.embed_tokens.weight"
BAD_DIRS = {  # case: (base directory, corruption, words the one-line error must hold)
    "config_is_a_list": ("single", _write("config.json", "[1, 2]"), ["config.json", "JSON object"]),
    "config_not_json": (
        "single",
        _write("config.json", '{"vocab_size": '),
        ["config.json", "not valid JSON"],
    ),
    "config_string_number": (
        "single",
        _config(hidden_size="32"),
        ["config.json", "hidden_size", '"32"', "integer"],
    ),
    "config_bool_number": (
        "single",
        _config(num_hidden_layers=True),
        ["num_hidden_layers", "true"],
    ),
    "config_nan": (
        "single",
        _config(rms_norm_eps=float("nan")),
        ["rms_norm_eps", "NaN", "positive number"],
    ),
    "config_zero_kv_heads": (
        "single",
        _config(num_key_value_heads=0),
        ["num_key_value_heads", "positive"],
    ),
    "config_string_bool": (
        "single",
        _config(tie_word_embeddings="false"),
        ["tie_word_embeddings", "true or false"],
    ),
    "config_list_model_type": ("single", _config(model_type=["llama"]), ["model_type", "a string"]),
    "config_rope_list": (
        "single",
        _config(rope_parameters=[1e4]),
        ["rope_parameters", "an object"],
    ),
    "config_rope_string": (
        "single",
        _config(rope_parameters={"rope_theta": "1e4"}),
        ["rope_parameters.rope_theta"],
    ),
    "config_missing_key": (
        "single",
        _edit_json("config.json", lambda c: {k: v for k, v in c.items() if k != "vocab_size"}),
        ["vocab_size"],
    ),
    # a billion layers claimed: refused at the first layer the file lacks, nothing
    # allocated for the rest
    "config_absurd_layers": (
        "single",
        _config(num_hidden_layers=10**9),
        ["model.layers.2.", "missing"],
    ),
    "header_absurd_length": (
        "single",
        _header(lambda h: h, claimed=2**62),
        [SAFETENSORS, "header length"],
    ),
    "header_too_short": (
        "single",
        _write(SAFETENSORS, "\x01\x02"),
        [SAFETENSORS, "not a safetensors file"],
    ),
    "header_not_json": ("single", _header(lambda h: b'{"x": ['), [SAFETENSORS, "not valid JSON"]),
    "header_a_list": (
        "single",
        _header(lambda h: [1]),
        [SAFETENSORS, "not a JSON object of tensors"],
    ),
    "header_metadata": (
        "single",
        _header(lambda h: {**h, "__metadata__": ["pt"]}),
        ["__metadata__"],
    ),
    "dtype_unknown": ("single", _entry(EMBED, dtype="F7"), [SAFETENSORS, EMBED, '"F7"', "BF16"]),
    "dtype_not_float": ("single", _entry(EMBED, dtype="I32"), [EMBED, '"I32"', "F32"]),
    "shape_vs_offsets": ("single", _entry(EMBED, shape=[96, 33]), [EMBED, "data_offsets", "needs"]),
    "offsets_past_end": (
        "single",
        _entry(EMBED, data_offsets=[0, 10**12]),
        [EMBED, "do not lie within"],
    ),
    # lm_head.weight has embed's shape: reading embed's bytes as lm_head passes
    # every per-tensor check
    "offsets_overlap": (
        "single",
        _header(
            lambda h: {
                **h,
                "lm_head.weight": {**h["lm_head.weight"], "data_offsets": h[EMBED]["data_offsets"]},
            }
        ),
        ["without gaps or overlaps"],
    ),
    "file_truncated": (
        "single",
        lambda d: os.truncate(d / SAFETENSORS, os.path.getsize(d / SAFETENSORS) - 64),
        [SAFETENSORS, "do not lie within"],
    ),
    "file_padded": ("single", _append(SAFETENSORS, b"\0" * 64), [SAFETENSORS, "data bytes"]),
    "tensor_missing": (
        "single",
        _resave(lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up" not in k}),
        ["model.layers.1.mlp.up_proj.weight", "missing"],
    ),
    "tensor_unknown": (
        "single",
        _resave(lambda t: {**t, "model.extra.weight": t[EMBED]}),
        ["model.extra.weight"],
    ),
    "index_a_list": ("sharded", _write(INDEX, "[]"), [INDEX, "weight_map"]),
    "index_not_json": ("sharded", _write(INDEX, "{"), [INDEX, "not valid JSON"]),
    "index_absolute_shard": (
        "sharded",
        _outside(lambda d: str(d.parent / "elsewhere" / SHARDS[0])),
        [INDEX, EMBED, "outside the checkpoint directory"],
    ),
    "index_dotdot_shard": (
        "sharded",
        _outside(lambda d: f"../elsewhere/{SHARDS[0]}"),
        [INDEX, "../elsewhere/"],
    ),
    "index_missing_shard": (
        "sharded",
        lambda d: os.remove(d / SHARDS[1]),
        [INDEX, SHARDS[1], "does not exist"],
    ),
    "index_wrong_shard": (
        "sharded",
        _edit_json(INDEX, _move_tensor),
        [INDEX, SHARDS[1], "does not hold it"],
    ),
    "shard_header_corrupt": (
        "sharded",
        _header(lambda h: h, file=SHARDS[1], claimed=2**40),
        [SHARDS[1]],
    ),
}


@pytest.mark.parametrize("case", list(BAD_DIRS))
def test_bad_hf_directory_is_one_line_and_writes_nothing(good, tmp_path, capsys, case):
    base, corrupt, words = BAD_DIRS[case]
    shutil.copytree(good / base, tmp_path / "hf")
    corrupt(tmp_path / "hf")
    _refused(
        capsys,
        ["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")],
        str(tmp_path / "ckpt"),
        words,
    )


# -- a checkpoint whose metadata lies about its arrays ---------------------------------------------
def _meta(edit):
    return lambda meta: {**meta, "model": edit(dict(meta["model"]))}


BAD_META = {  # case: (metadata edit, words)
    "fewer_heads": (
        _meta(lambda m: {**m, "n_heads": 2}),
        ["params/blocks/attn/", "n_heads=2", "does not describe"],
    ),
    "fewer_kv_heads": (
        _meta(lambda m: {**m, "n_kv_heads": 1}),
        ["params/blocks/attn/wk_DKH", "n_kv_heads=1"],
    ),
    "tied_but_lm_head": (
        _meta(lambda m: {**m, "tie_embeddings": True}),
        ["params/lm_head_DV", "no such array"],
    ),
    "string_heads": (_meta(lambda m: {**m, "n_heads": "4"}), ["model.n_heads", "int", '"4"']),
    "float_width": (_meta(lambda m: {**m, "d_model": 32.0}), ["model.d_model", "int", "32.0"]),
    "no_model": (lambda meta: {k: v for k, v in meta.items() if k != "model"}, ["no model config"]),
}


@pytest.mark.parametrize("case", list(BAD_META))
def test_export_refuses_metadata_that_does_not_describe_the_arrays(good, tmp_path, capsys, case):
    edit, words = BAD_META[case]
    shutil.copytree(good / "ckpt", tmp_path / "ckpt")
    meta_file = tmp_path / "ckpt" / "0" / "meta" / "metadata"
    meta_file.write_text(json.dumps(edit(json.loads(meta_file.read_text()))))
    _refused(
        capsys,
        ["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")],
        str(tmp_path / "out"),
        words,
    )


def test_export_of_the_unedited_checkpoint_succeeds(good, tmp_path):
    """The control for the refusals above: the same checkpoint, unedited, exports the tensors it was
    imported from."""
    from safetensors.numpy import load_file

    assert (
        checkpoint_main(["hf", "export", str(good / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    )
    ours, theirs = (
        load_file(str(tmp_path / "out" / SAFETENSORS)),
        load_file(str(good / "single" / SAFETENSORS)),
    )
    assert sorted(ours) == sorted(theirs) and all(np.array_equal(ours[n], theirs[n]) for n in ours)


def test_failed_write_leaves_no_output(good, tmp_path, monkeypatch):
    """A write that fails midway (disk full) is one line and leaves neither the output directory
    nor its staging directory behind; the next try writes it whole."""
    import safetensors.numpy

    model = hf.load_checkpoint(str(good / "ckpt"))
    real_save, calls = safetensors.numpy.save_file, []

    def save_then_fail(tensors, file, metadata=None):
        calls.append(file)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(tensors, file, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", save_then_fail)
    with pytest.raises(
        UserError, match="writing the HuggingFace files failed .No space left on device"
    ):
        hf.save_pretrained(model, str(tmp_path / "out"), max_shard_bytes=20_000)
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    hf.save_pretrained(model, str(tmp_path / "out"), max_shard_bytes=20_000)
    assert sorted(os.listdir(tmp_path)) == ["out"] and INDEX in os.listdir(tmp_path / "out")
