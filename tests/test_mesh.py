"""mesh/: --mesh parsing and resolution, mesh construction, the logical-axis table, and the
divisibility / under-sharding checks. Pure Python or abstract arrays: no compiles."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from errors import UserError
from mesh.build import make_mesh
from mesh.rules import DEFAULT_RULES, logical_to_spec, make_rules, parse_overrides
from mesh.shard import check_divisible, tree_shardings, warn_undersharded
from mesh.spec import AXES, parse_spec, resolve
from models import model as model_lib
from models.presets import PRESETS

TINY = PRESETS["tiny"]
HINTS = {
    "heads": "model.n_heads",
    "kv_heads": "model.n_kv_heads",
    "mlp": "model.d_ff",
    "embed": "model.d_model",
    "vocab": "model.vocab_size",
    "layers": "model.n_layers",
}


def sizes(shape):
    return shape.as_dict()


# ------------------------------------------------------------------ parse_spec / resolve


def test_axes_order():
    assert AXES == ("pipeline", "data", "fsdp", "context", "expert", "model")


def test_parse_spec_basic():
    assert parse_spec("data=2,fsdp=-1,model=2") == {"data": 2, "fsdp": -1, "model": 2}
    assert parse_spec(" data = 4 , model=2 ,") == {"data": 4, "model": 2}
    assert parse_spec({"model": 4, "fsdp": "2"}) == {"model": 4, "fsdp": 2}
    assert parse_spec("") == {} and parse_spec(None) == {}


def test_resolve_fills_minus_one():
    s = resolve("data=2,fsdp=-1,model=2", 8)
    assert sizes(s) == {"pipeline": 1, "data": 2, "fsdp": 2, "context": 1, "expert": 1, "model": 2}
    assert s.sizes == (1, 2, 2, 1, 1, 2) and s.size == 8 and s["fsdp"] == 2
    assert s.dcn == (1,) * 6 and s.ici == s.sizes


def test_resolve_minus_one_alone_and_unnamed_axes():
    assert sizes(resolve("model=-1", 8)) == {
        "pipeline": 1,
        "data": 1,
        "fsdp": 1,
        "context": 1,
        "expert": 1,
        "model": 8,
    }
    assert sizes(resolve("fsdp=4,model=2", 8)) == {
        "pipeline": 1,
        "data": 1,
        "fsdp": 4,
        "context": 1,
        "expert": 1,
        "model": 2,
    }
    assert sizes(resolve("pipeline=2,expert=-1", 8))["expert"] == 4


@pytest.mark.parametrize("spec", ["", None, {}])
def test_resolve_empty_is_all_data(spec):
    assert sizes(resolve(spec, 8)) == {
        "pipeline": 1,
        "data": 8,
        "fsdp": 1,
        "context": 1,
        "expert": 1,
        "model": 1,
    }
    assert sizes(resolve(spec, 1))["data"] == 1


def test_resolve_dcn():
    s = resolve("data=4,model=2", 8, "data=2")
    assert s.dcn == (1, 2, 1, 1, 1, 1) and s.ici == (1, 2, 1, 1, 1, 2)


# Every bad input: UserError (a ValueError), message names the culprit and the valid choices.
BAD = [
    # (spec, n_devices, dcn, substrings that must all be in the message)
    ("date=8", 8, None, ["'date'", "valid axes: pipeline, data, fsdp, context, expert, model"]),
    ("data=2,model=2", 8, None, ["multiply to 4", "8 devices", "-1"]),
    ("data=3", 8, None, ["multiply to 3", "8 devices"]),
    ("data=-1,fsdp=-1", 8, None, ["only one axis may be -1", "data", "fsdp"]),
    ("data=two", 8, None, ["'data'", "integer", "'two'"]),
    ("data=2.5", 8, None, ["'data'", "integer", "'2.5'"]),
    ("data=0", 8, None, ["'data'", "positive integer or -1", "0"]),
    ("data=-2", 8, None, ["'data'", "positive integer or -1", "-2"]),
    ("data", 8, None, ["'data'", "axis=size"]),
    ("data=2,data=4", 8, None, ["'data'", "twice"]),
    ("data=3,fsdp=-1", 8, None, ["'fsdp=-1'", "[1, 2, 4, 8]"]),
    ("data=8", 8, "data=3", ["--mesh-dcn", "data=3", "data=8", "valid: [1, 2, 4, 8]"]),
    ("data=4,model=2", 8, "model=4", ["--mesh-dcn", "model=4", "model=2", "valid: [1, 2]"]),
    ("data=8", 8, "data=-1", ["--mesh-dcn", "-1"]),
    ("data=8", 8, "dta=2", ["--mesh-dcn", "'dta'", "valid axes"]),
]


@pytest.mark.parametrize("spec,n,dcn,needles", BAD, ids=[f"{b[0]}|{b[2]}" for b in BAD])
def test_resolve_bad_input(spec, n, dcn, needles):
    with pytest.raises(UserError) as ei:
        resolve(spec, n, dcn)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "\n" not in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


# ------------------------------------------------------------------ make_mesh


def ids(mesh):
    return np.vectorize(lambda d: d.id)(mesh.devices)


def test_make_mesh_axes_and_model_innermost():
    m = make_mesh("data=2,fsdp=2,model=2")
    assert m.axis_names == AXES
    assert dict(m.shape) == {
        "pipeline": 1,
        "data": 2,
        "fsdp": 2,
        "context": 1,
        "expert": 1,
        "model": 2,
    }
    assert all(t == jax.sharding.AxisType.Auto for t in m.axis_types)
    flat = ids(m).reshape(-1, 2)  # rows: model pairs
    # consecutive devices along model, then fsdp, then data
    assert flat.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_make_mesh_model4_fsdp2():
    m = make_mesh("model=4,fsdp=2")
    a = ids(m).reshape(2, 4)
    assert a.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.shape["model"] == 4 and m.shape["fsdp"] == 2


def test_make_mesh_default_and_subset():
    m = make_mesh()
    assert m.shape["data"] == 8 and m.size == 8
    sub = make_mesh("", devices=jax.devices()[:1])
    assert sub.size == 1 and all(sub.shape[a] == 1 for a in AXES)
    m4 = make_mesh("data=2,model=2", devices=jax.devices()[4:])
    assert ids(m4).ravel().tolist() == [4, 5, 6, 7]


def test_make_mesh_bad_spec_and_dcn():
    with pytest.raises(UserError, match="valid axes"):
        make_mesh("tensor=8")
    with pytest.raises(UserError, match="1 host"):  # dcn product must equal the number of hosts
        make_mesh("data=8", "data=2")


# ------------------------------------------------------------------ logical rules

GOLDEN = [
    (("batch", "seq", "act_embed"), P(("data", "fsdp", "expert"), "context", None)),
    (("embed", "mlp"), P(("fsdp", "context", "expert"), "model")),
    (("mlp", "embed"), P("model", ("fsdp", "context", "expert"))),
    (("vocab", "embed"), P("model", ("fsdp", "context", "expert"))),
    (("embed", "vocab"), P(("fsdp", "context", "expert"), "model")),
    (("embed", "heads", "head_dim"), P(("fsdp", "context", "expert"), "model", None)),
    (("embed", "kv_heads", "head_dim"), P(("fsdp", "context", "expert"), "model", None)),
    (("heads", "head_dim", "embed"), P("model", None, ("fsdp", "context", "expert"))),
    (("layers", "embed", "mlp"), P("pipeline", ("fsdp", "context", "expert"), "model")),
    (("norm",), P(None)),
    (("layers", "norm"), P("pipeline", None)),
    (("batch", "seq"), P(("data", "fsdp", "expert"), "context")),
    (("batch", "seq", "act_mlp"), P(("data", "fsdp", "expert"), "context", "model")),
    (("batch", "seq", "act_heads", None), P(("data", "fsdp", "expert"), "context", "model", None)),
    (("batch", "seq", "act_vocab"), P(("data", "fsdp", "expert"), "context", "model")),
    (("experts", "expert_embed", "expert_mlp"), P("expert", ("fsdp", "context"), "model")),
    (("stages", "layers", "embed"), P("pipeline", None, ("fsdp", "context", "expert"))),
    ((None, "embed"), P(None, ("fsdp", "context", "expert"))),
]


@pytest.mark.parametrize("names,spec", GOLDEN, ids=[",".join(map(str, g[0])) for g in GOLDEN])
def test_logical_to_spec_golden(names, spec):
    assert logical_to_spec(names, DEFAULT_RULES) == spec
    assert logical_to_spec(names) == spec  # default table is the context default


def _used_axes(spec):
    out = []
    for e in spec:
        if e is not None:
            out.extend((e,) if isinstance(e, str) else e)
    return out


def test_mesh_axis_never_used_twice():
    # batch takes fsdp first, so embed (-> fsdp) stays replicated; heads and mlp both want model
    assert logical_to_spec(("batch", "embed")) == P(("data", "fsdp", "expert"), "context")
    assert logical_to_spec(("embed", "batch")) == P(("fsdp", "context", "expert"), "data")
    assert logical_to_spec(("heads", "mlp")) == P("model", None)
    rules = make_rules("embed=fsdp+model")
    assert logical_to_spec(("embed", "mlp"), rules) == P(("fsdp", "model"), None)
    for names, _ in GOLDEN:
        for r in (DEFAULT_RULES, rules):
            used = _used_axes(logical_to_spec(names, r))
            assert len(used) == len(set(used)), names


def test_unknown_logical_name_raises():
    with pytest.raises(KeyError, match="nope"):
        logical_to_spec(("nope",))


def test_parse_overrides():
    assert parse_overrides("embed=fsdp+model,vocab=none") == {
        "embed": ("fsdp", "model"),
        "vocab": (),
    }
    assert parse_overrides({"mlp": None, "heads": ["model", "fsdp"], "embed": "data"}) == {
        "mlp": (),
        "heads": ("model", "fsdp"),
        "embed": ("data",),
    }
    assert parse_overrides("") == {} and parse_overrides(None) == {}
    rules = make_rules("embed=fsdp+model,vocab=none")
    assert (
        rules["embed"] == ("fsdp", "model") and rules["vocab"] == () and rules["mlp"] == ("model",)
    )
    assert logical_to_spec(("vocab", "embed"), rules) == P(None, ("fsdp", "model"))
    # make_rules does not mutate the default table
    assert DEFAULT_RULES["embed"] == (
        "fsdp",
        "context",
        "expert",
    )


@pytest.mark.parametrize(
    "spec,needles",
    [
        ("embd=fsdp", ["'embd'", "valid:", "embed", "vocab"]),
        (
            "embed=fsdpp",
            ["'embed'", "'fsdpp'", "valid: pipeline, data, fsdp, context, expert, model"],
        ),
        ("embed=fsdp+tensor", ["'tensor'", "valid:"]),
        ("embed", ["'embed'", "name=axis"]),
        ({"bogus": "data"}, ["'bogus'", "valid:"]),
    ],
)
def test_parse_overrides_bad(spec, needles):
    with pytest.raises(UserError) as ei:
        parse_overrides(spec)
    for n in needles:
        assert n in str(ei.value), (n, str(ei.value))


# ------------------------------------------------------------------ check_divisible


def _check(cfg, mesh_spec, rules=None):
    mesh = make_mesh(mesh_spec)
    check_divisible(
        mesh, model_lib.abstract_params(cfg), model_lib.param_axes(cfg), make_rules(rules), HINTS
    )


def test_check_divisible_passes_on_good_shapes():
    for spec in ("data=8", "fsdp=8", "data=2,fsdp=2,model=2", "model=2,fsdp=4"):
        _check(TINY, spec)
    _check(dataclasses.replace(TINY, n_heads=4, n_kv_heads=4), "model=4,fsdp=2")


def test_check_divisible_names_n_heads():
    cfg = dataclasses.replace(TINY, n_heads=6, d_model=96, n_kv_heads=6)
    with pytest.raises(
        UserError
    ) as ei:  # kv heads replicated, so the n_heads check is the one that fires
        _check(cfg, "model=4,data=2", "kv_heads=none")
    msg = str(ei.value)
    assert "model.n_heads=6" in msg and "model=4" in msg, msg
    assert "[1, 2, 3, 6]" in msg, msg


def test_check_divisible_names_n_kv_heads_and_d_ff():
    with pytest.raises(UserError) as ei:  # tiny: n_kv_heads=2 on model=4
        _check(TINY, "model=4,fsdp=2")
    assert "model.n_kv_heads=2" in str(ei.value) and "model=4" in str(ei.value)
    with pytest.raises(UserError) as ei:
        _check(dataclasses.replace(TINY, d_ff=99), "model=2,data=4")
    assert "model.d_ff=99" in str(ei.value) and "model=2" in str(ei.value)
    assert "[1, 3, 9, 11, 33, 99]" in str(ei.value)
    with pytest.raises(UserError) as ei:  # embed -> fsdp
        _check(dataclasses.replace(TINY, d_model=60, n_heads=2, n_kv_heads=2), "fsdp=8")
    msg = str(ei.value)
    assert (
        "model.d_model=60" in msg
        and "fsdp=8" in msg
        and "[1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60]" in msg
    )


def test_check_divisible_without_hint_names_the_path():
    mesh = make_mesh("model=8")
    shapes = {"w": jax.ShapeDtypeStruct((4, 12), jnp.float32)}
    with pytest.raises(UserError) as ei:
        check_divisible(mesh, shapes, {"w": ("embed", "mlp")}, DEFAULT_RULES)
    assert "w dim 1 (mlp=12)" in str(ei.value) and "model=8" in str(ei.value)


# ------------------------------------------------------------------ warn_undersharded


def _big_cfg():  # embed/lm_head 8192 x 64 float32 = 2 MiB each; the rest is small
    return dataclasses.replace(TINY, vocab_size=8192)


def _abstract_params(cfg, mesh, rules):
    sh = tree_shardings(mesh, model_lib.param_axes(cfg), rules)
    return jax.tree.map(
        lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
        model_lib.abstract_params(cfg),
        sh,
    )


def test_warn_undersharded_names_replicated_array():
    cfg, mesh = _big_cfg(), make_mesh("fsdp=8")
    params = _abstract_params(cfg, mesh, make_rules("vocab_embed=none"))
    with pytest.warns(UserWarning) as rec:
        msgs = warn_undersharded(mesh, params)
    assert len(msgs) == 2 and len(rec) == 2
    assert any(m.startswith("embed_VD ") for m in msgs) and any(
        m.startswith("lm_head_DV ") for m in msgs
    )
    assert all("fsdp=8" in m and "2.0 MiB" in m for m in msgs)


def test_warn_undersharded_real_array():
    mesh = make_mesh("fsdp=8")
    x = jax.device_put(jnp.zeros((512, 1024)), NamedSharding(mesh, P()))
    with pytest.warns(UserWarning, match="big_table"):
        assert len(warn_undersharded(mesh, {"big_table": x})) == 1


def test_warn_undersharded_silent_when_sharded_or_small():
    cfg = _big_cfg()
    for spec in ("fsdp=8", "data=8", "data=2,fsdp=2,model=2"):
        mesh = make_mesh(spec)
        params = _abstract_params(cfg, mesh, DEFAULT_RULES)
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            assert warn_undersharded(mesh, params) == []
    # pure data parallelism replicates everything on purpose: nothing to warn about
    mesh = make_mesh("data=8")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert warn_undersharded(mesh, _abstract_params(cfg, mesh, make_rules("embed=none"))) == []
        # small arrays are not worth warning about
        mesh = make_mesh("fsdp=8")
        assert warn_undersharded(mesh, _abstract_params(TINY, mesh, make_rules("embed=none"))) == []
