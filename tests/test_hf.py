"""HuggingFace interop: tiny Llama and Mixtral models built with transformers (CPU torch) at test
time, saved, imported, and compared logit by logit; export then re-import is exact; the CLI round
trip."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# the imports below wait for the skips above (E402): without transformers and torch nothing runs
import jax  # noqa: E402
from cpu_env import cpu_env  # noqa: E402

from checkpoint import hf  # noqa: E402
from checkpoint.__main__ import main as checkpoint_main  # noqa: E402
from checkpoint.hf_files import INDEX, SAFETENSORS  # noqa: E402
from errors import UserError  # noqa: E402
from models import hf_config  # noqa: E402
from train.core.setup import abstract_state  # noqa: E402
from train.run import resume  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = cpu_env(8)

CASES = {  # n_kv_heads < n_heads is GQA (2 query heads per kv head); tied shares embed and lm_head
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0),
    "tied": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    # every layer MoE: 4 experts, top-2 (softmax, top-k, renormalise)
    "mixtral": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=24,
    ),
}


def make_hf(path, **overrides):
    """A random tiny LlamaForCausalLM (MixtralForCausalLM when given experts) saved to `path`; norms
    are random too, so a swapped or dropped norm weight shows in the logits."""
    kw = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        rope_theta=10000.0,
    )
    kw.update(overrides)
    if "rope_parameters" in kw:
        kw.pop("rope_theta")
    torch.manual_seed(0)
    if "num_local_experts" in kw:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def tokens(vocab=96, shape=(2, 11)):
    return np.random.default_rng(0).integers(0, vocab, shape).astype(np.int32)


def torch_logits(model, toks):
    with torch.no_grad():
        return model(torch.from_numpy(toks.astype(np.int64))).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref_model = make_hf(tmp_path, **CASES[case])
    toks = tokens()
    ref = torch_logits(ref_model, toks)
    model = hf.from_pretrained(str(tmp_path), dtype="float32")
    out = model(toks)
    assert out.dtype == np.float32 and out.shape == (2, 11, 96)
    assert np.std(ref) > 0.3  # logits large enough that 1e-4 is a real test
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, rtol=1e-4)
    assert model.cfg.tie_embeddings == (case == "tied") and ("lm_head_DV" in model.params) != (
        case == "tied"
    )
    assert model.cfg.n_kv_heads == CASES[case]["num_key_value_heads"]
    assert model.cfg.n_experts == CASES[case].get("num_local_experts", 0)


def test_sharded_placement_and_sharded_files(tmp_path):
    """Params placed sharded on a mesh give the same logits; a sharded safetensors index loads."""
    from mesh.build import make_mesh

    ref_model = make_hf(tmp_path / "hf", **CASES["gqa"])
    toks = tokens()
    mesh = make_mesh("fsdp=4,model=2")
    model = hf.from_pretrained(str(tmp_path / "hf"), mesh=mesh)
    spec = model.params["blocks"]["attn"][
        "wq_DNH"
    ].sharding.spec  # [L, D, N, H]: D over fsdp, N over model
    # context, expert: size 1 here, named all the same
    assert tuple(spec)[1:] == (
        ("fsdp", "context", "expert"),
        "model",
        None,
    )
    assert spec[0] is None or mesh.shape[spec[0]] == 1  # layers: over pipeline, size 1 here
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(
            np.asarray(model(toks)), torch_logits(ref_model, toks), atol=1e-4, rtol=1e-4
        )
    hf.save_pretrained(
        hf.from_pretrained(str(tmp_path / "hf")), str(tmp_path / "sharded"), max_shard_bytes=20_000
    )
    index = json.loads((tmp_path / "sharded" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = hf.from_pretrained(str(tmp_path / "sharded"))
    np.testing.assert_array_equal(
        np.asarray(again(toks)), np.asarray(hf.from_pretrained(str(tmp_path / "hf"))(toks))
    )


def test_mixtral_on_an_expert_mesh(tmp_path):
    """Experts placed over the expert axis (and the MoE layer's all-to-all) give the same logits."""
    from mesh.build import make_mesh

    ref_model = make_hf(tmp_path, **CASES["mixtral"])
    toks = tokens(shape=(4, 11))
    mesh = make_mesh("expert=2,fsdp=2,model=2")
    model = hf.from_pretrained(str(tmp_path), mesh=mesh)
    w = model.params["moe_blocks"]["moe"]["w_gate_EDF"]
    assert w.shape == (2, 4, 32, 24) and w.sharding.shard_shape(w.shape) == (2, 2, 16, 12)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(
            np.asarray(model(toks)), torch_logits(ref_model, toks), atol=1e-4, rtol=1e-4
        )


def assert_export_is_exact(model, src, out):
    """Export `model` (imported from the HF directory `src`) to `out`: re-importing it is bit-exact,
    the files hold the same tensors as `src`, bit for bit -> the export loaded by transformers."""
    hf.save_pretrained(model, str(out))
    again = hf.from_pretrained(str(out))
    assert again.cfg == model.cfg
    jax.tree.map(
        np.testing.assert_array_equal, jax.device_get(again.params), jax.device_get(model.params)
    )
    from safetensors.numpy import load_file

    theirs, ours = load_file(str(src / SAFETENSORS)), load_file(str(out / SAFETENSORS))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    return transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()


@pytest.mark.parametrize("case", ["gqa", "tied", "mixtral"])
def test_export_reimport_exact_and_loads_in_transformers(tmp_path, case):
    make_hf(tmp_path / "hf", **CASES[case])
    model = hf.from_pretrained(str(tmp_path / "hf"))
    reloaded = assert_export_is_exact(model, tmp_path / "hf", tmp_path / "out")
    # and transformers reads our config.json the same way
    assert reloaded.config.rope_parameters["rope_theta"] == model.cfg.rope_theta
    toks = tokens()
    np.testing.assert_allclose(
        torch_logits(reloaded, toks), np.asarray(model(toks)), atol=1e-4, rtol=1e-4
    )


def test_llama3_rope_scaling(tmp_path):
    """Llama 3.1's long-context RoPE ("llama3"), at positions past
    original_max_position_embeddings."""
    if not hf_config._LLAMA3_ROPE:
        make_hf(tmp_path, num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3)
        with pytest.raises(UserError, match='rope_type="llama3" is not supported'):
            hf.from_pretrained(str(tmp_path))
        pytest.skip(
            "this ModelConfig has no rope_scaling_factor: llama3 RoPE is refused in one line"
        )
    ref_model = make_hf(
        tmp_path / "hf",
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters=LLAMA3,
        max_position_embeddings=256,
    )
    toks = tokens(shape=(1, 150))
    model = hf.from_pretrained(str(tmp_path / "hf"))
    assert model.cfg.rope_scaling == (8.0, 1.0, 4.0, 32)
    np.testing.assert_allclose(
        np.asarray(model(toks)), torch_logits(ref_model, toks), atol=1e-4, rtol=1e-4
    )
    hf.save_pretrained(model, str(tmp_path / "out"))
    assert hf.from_pretrained(str(tmp_path / "out")).cfg == model.cfg


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def test_bfloat16_checkpoint_and_greedy_generation(tmp_path):
    """Hub checkpoints are mostly bfloat16 safetensors: read as float32 they give the logits of the
    rounded weights; greedy decoding with the KV cache picks HF's tokens."""
    ref_model = make_hf(tmp_path / "hf", **CASES["gqa"]).to(torch.bfloat16)
    ref_model.save_pretrained(tmp_path / "bf16")
    ref_model = ref_model.float()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / SAFETENSORS), "numpy") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    model = hf.from_pretrained(str(tmp_path / "bf16"))
    toks = tokens()
    np.testing.assert_allclose(
        np.asarray(model(toks)), torch_logits(ref_model, toks), atol=1e-4, rtol=1e-4
    )
    with torch.no_grad():
        want = ref_model.generate(
            torch.from_numpy(toks[:1].astype(np.int64)),
            max_new_tokens=6,
            do_sample=False,
            min_new_tokens=6,
        ).numpy()[0, toks.shape[1] :]
    np.testing.assert_array_equal(np.asarray(model.generate(toks[:1], 6))[0], want)


def test_bfloat16(tmp_path):
    make_hf(tmp_path / "hf", **CASES["gqa"])
    ref = np.asarray(hf.from_pretrained(str(tmp_path / "hf"))(tokens()))
    model = hf.from_pretrained(str(tmp_path / "hf"), dtype="bfloat16")
    assert model.params["embed_VD"].dtype == jax.numpy.bfloat16
    out = np.asarray(model(tokens()))
    assert out.dtype == np.float32 and np.abs(out - ref).max() < 0.1 * np.abs(ref).max()


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "changes,words",
    [
        (
            dict(rope_scaling={"rope_type": "dynamic", "factor": 8.0}),
            ["rope_scaling.rope_type", "dynamic", "supported"],
        ),
        (
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
            ["rope_parameters.rope_type", "yarn"],
        ),
        (dict(attention_bias=True), ["attention_bias=true", "false"]),
        (dict(hidden_act="gelu"), ["hidden_act", "gelu", "silu"]),
        (dict(head_dim=16), ["head_dim=16", "8"]),
        (dict(model_type="gpt2"), ["model_type", "gpt2", "llama"]),
        (dict(num_key_value_heads=3), ["n_kv_heads=3", "valid n_kv_heads"]),
        (dict(intermediate_size=40), ["mlp.gate_proj.weight", "(40, 32)"]),
    ],
)
def test_unsupported_config_is_one_line(tmp_path, changes, words):
    make_hf(tmp_path, **CASES["mha"])
    _edit_config(tmp_path, **changes)
    with pytest.raises(UserError) as e:
        hf.from_pretrained(str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_missing_files_are_one_line(tmp_path):
    with pytest.raises(UserError, match="no such HuggingFace checkpoint directory"):
        hf.from_pretrained(str(tmp_path / "nope"))
    make_hf(tmp_path, **CASES["mha"])
    os.rename(tmp_path / SAFETENSORS, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="neither model.safetensors nor .*pytorch_model.bin"):
        hf.from_pretrained(str(tmp_path))


def test_cli_import_inspect_train_shapes_export(tmp_path):
    """`python -m checkpoint hf import` writes a checkpoint that `python -m checkpoint inspect`
    reads, whose arrays are exactly the params of the model.yaml it writes; `export` gives the HF
    files back."""
    from checkpoint.__main__ import describe
    from mesh.shard import path_names
    from models import model as model_lib
    from train.core.config import build

    make_hf(tmp_path / "hf", **CASES["gqa"])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "checkpoint",
            "hf",
            "import",
            str(tmp_path / "hf"),
            "--out",
            str(tmp_path / "ckpt"),
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "--init-from" in r.stdout
    info = describe(str(tmp_path / "ckpt"))
    assert info["step"] == 0 and info["meta"]["contents"] == "params"
    cfg = build({"train.seq_len": 32}, yaml_path=str(tmp_path / "ckpt" / "model.yaml"))
    want = {
        f"params/{n}": list(s.shape)
        for n, s in path_names(
            model_lib.abstract_params(cfg.model), is_leaf=lambda x: hasattr(x, "shape")
        )
    }
    assert {a["name"]: a["shape"] for a in info["arrays"]} == want
    assert (
        checkpoint_main(["hf", "export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")])
        == 0
    )
    from safetensors.numpy import load_file

    theirs, ours = (
        load_file(str(tmp_path / "hf" / SAFETENSORS)),
        load_file(str(tmp_path / "out" / SAFETENSORS)),
    )
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_cli_errors_exit_2_one_line(tmp_path, capsys):
    assert (
        checkpoint_main(["hf", "import", str(tmp_path / "nope"), "--out", str(tmp_path / "ck")])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "nope" in err and "\n" not in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert checkpoint_main(["hf", "export", str(tmp_path), "--out", str(tmp_path / "full")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_export_refuses_what_hf_cannot_express():
    from models.presets import preset

    cfg = preset("moe-tiny")
    assert hf_config.config_to_hf(cfg)["architectures"] == ["MixtralForCausalLM"]
    assert hf_config.config_to_hf(preset("tiny"))["architectures"] == ["LlamaForCausalLM"]
    for field, value in (("n_shared_experts", 1), ("router", "sigmoid"), ("moe_every", 2)):
        with pytest.raises(
            UserError, match=f"model.{field}={value} has no HuggingFace Mixtral equivalent"
        ):
            hf_config.config_to_hf(dataclasses.replace(cfg, **{field: value}))


@pytest.mark.parametrize(
    "case,mesh", [("gqa", "fsdp=4,model=2"), ("mixtral", "expert=2,fsdp=2,model=2")]
)
def test_init_from_imported_checkpoint(tmp_path, case, mesh):
    """`--init-from` an imported checkpoint: every parameter lands bit-exact in the new mesh's
    shardings, with a fresh optimizer state at step 0; a model config that does not match is one
    line."""
    from train.core.config import build
    from train.run.loop import Trainer

    make_hf(tmp_path / "hf", **CASES[case])
    hf.import_checkpoint(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    over = {
        "parallelism.mesh": mesh,
        "train.seq_len": 32,
        "train.batch_size": 8,
        "checkpoint.init_from": str(tmp_path / "ckpt"),
        "logging.run_dir": str(tmp_path / "run"),
    }
    trainer = Trainer(build(over, str(tmp_path / "ckpt" / "model.yaml")))
    state, _ = resume.init_from(
        trainer.setup, abstract_state(trainer.setup).params, str(tmp_path / "ckpt")
    )
    assert int(state.step) == 0
    want = hf.from_pretrained(str(tmp_path / "hf")).params
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), jax.device_get(want))
    shardings = jax.tree.map(lambda a: a.sharding, state.params)
    assert shardings == trainer.setup.state_shardings.params
    assert all(float(jnp_abs_sum(m)) == 0.0 for m in jax.tree.leaves(state.opt_state) if m.ndim > 1)
    with pytest.raises(UserError, match="does not match this model config.*model.yaml"):
        tiny = Trainer(build({**over, "model.preset": "tiny"})).setup
        resume.init_from(tiny, abstract_state(tiny).params, str(tmp_path / "ckpt"))


def jnp_abs_sum(a):
    return np.abs(np.asarray(jax.device_get(a))).sum()
