"""plan/hlo.py and plan/replica_groups.py against real compiled programs on 8 fake CPU devices,
plus hand-written HLO for the formats XLA:CPU never prints (async pairs, unknown trip counts,
sub-axis mesh groups)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from mesh.build import make_mesh
from plan.hlo import KINDS, Collective, parse_collectives, shape_bytes, summarize
from plan.replica_groups import explicit_groups, iota_groups, mesh_axes_groups

N = 1024  # local elements per device: f32 -> 4096 bytes


@pytest.fixture(scope="module")
def m8():
    return make_mesh("data=8")


@pytest.fixture(scope="module")
def m222():
    return make_mesh("data=2,fsdp=2,model=2")


def compiled_text(mesh, f, in_specs, out_specs, *args):
    sm = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(sm).lower(*args).compile().as_text()


def only(colls, kind):
    got = [c for c in colls if c.kind == kind]
    assert len(got) == 1, colls
    return got[0]


# ------------------------------------------------------------------ real programs, data=8


def test_psum_data8(m8):
    text = compiled_text(m8, lambda a: lax.psum(a, "data"), P("data"), P(), jnp.ones(8 * N))
    colls = parse_collectives(text, m8)
    assert [c.kind for c in colls] == ["all-reduce"]
    c = colls[0]
    assert (c.operand_bytes, c.result_bytes, c.group_size, c.axes, c.count) == (
        4096,
        4096,
        8,
        ("data",),
        1,
    )
    assert not c.is_async and c.trip_count_known
    assert c.wire_bytes() == 2 * 7 / 8 * 4096


def test_all_gather_and_reduce_scatter(m8):
    ag = only(
        parse_collectives(
            compiled_text(
                m8,
                lambda a: lax.all_gather(a, "data", axis=0, tiled=True, to="invarying"),
                P("data"),
                P(),
                jnp.ones(8 * N),
            ),
            m8,
        ),
        "all-gather",
    )
    assert (ag.operand_bytes, ag.result_bytes, ag.group_size, ag.axes) == (
        4096,
        32768,
        8,
        ("data",),
    )
    assert ag.wire_bytes() == 7 / 8 * 32768

    rs = only(
        parse_collectives(
            compiled_text(
                m8,
                lambda a: lax.psum_scatter(a, "data", scatter_dimension=0, tiled=True),
                P(),
                P("data"),
                jnp.ones(8 * N),
            ),
            m8,
        ),
        "reduce-scatter",
    )
    assert (rs.operand_bytes, rs.result_bytes, rs.group_size, rs.axes) == (
        32768,
        4096,
        8,
        ("data",),
    )
    assert rs.wire_bytes() == 7 / 8 * 32768


@pytest.mark.parametrize(
    "dtype,local_bytes",
    [
        (jnp.float16, 2048),
        (jnp.int8, 1024),
        # XLA:CPU quirk: bf16 collectives are upcast to f32
        # (convert -> f32 all-gather -> convert), so 4 B/elt
        (jnp.bfloat16, 4096),
    ],
)
def test_dtype_bytes(m8, dtype, local_bytes):
    ag = only(
        parse_collectives(
            compiled_text(
                m8,
                lambda a: lax.all_gather(a, "data", axis=0, tiled=True, to="invarying"),
                P("data"),
                P(),
                jnp.ones(8 * N, dtype),
            ),
            m8,
        ),
        "all-gather",
    )
    assert (ag.operand_bytes, ag.result_bytes) == (local_bytes, 8 * local_bytes)


def test_all_to_all(m8):
    # XLA:CPU splits it into an 8-operand tuple all-to-all of f32[8,8] pieces: 8 *
    # 256 B = the 8x64 shard.
    text = compiled_text(
        m8,
        lambda a: lax.all_to_all(a, "data", split_axis=1, concat_axis=0, tiled=True),
        P("data", None),
        P(None, "data"),
        jnp.ones((64, 64)),
    )
    c = only(parse_collectives(text, m8), "all-to-all")
    assert (c.operand_bytes, c.result_bytes, c.group_size, c.axes) == (2048, 2048, 8, ("data",))
    assert c.wire_bytes() == 7 / 8 * 2048


def test_ppermute(m8):
    text = compiled_text(
        m8,
        lambda a: lax.ppermute(a, "data", [(i, (i + 1) % 8) for i in range(8)]),
        P("data"),
        P("data"),
        jnp.ones(8 * N),
    )
    c = only(parse_collectives(text, m8), "collective-permute")
    assert (c.operand_bytes, c.group_size, c.axes, c.wire_bytes()) == (4096, 8, ("data",), 4096.0)


def test_tuple_all_reduce(m8):
    text = compiled_text(
        m8,
        lambda a, b: lax.psum((a, b), "data"),
        (P("data"), P("data")),
        (P(), P()),
        jnp.ones(8 * N),
        jnp.ones(8 * 16),
    )
    c = only(parse_collectives(text, m8), "all-reduce")
    assert (c.operand_bytes, c.result_bytes) == (4096 + 64, 4096 + 64)
    assert c.wire_bytes() == 2 * 7 / 8 * 4160


def test_loops_count_trips(m8):
    x = jnp.ones(8 * N)

    def fori(a):  # the carry feeds the psum, so the loop cannot be hoisted or folded
        return lax.fori_loop(0, 5, lambda i, c: lax.psum(c * 1.5, "data") * 0.5 + a, a)

    def scan(a):
        return lax.scan(lambda c, _: (lax.psum(jnp.sin(c), "data") + a, None), a, None, length=5)[0]

    for f in (fori, scan):
        colls = parse_collectives(compiled_text(m8, f, P("data"), P("data"), x), m8)
        c = only(colls, "all-reduce")
        assert (c.count, c.trip_count_known, c.operand_bytes) == (5, True, 4096)
        assert c.wire_bytes() == 5 * 2 * 7 / 8 * 4096
        assert summarize(colls)["all-reduce"]["operand_bytes"] == 5 * 4096


def test_nested_loops_multiply(m8):
    def f(a):
        def outer(c, _):
            return lax.fori_loop(0, 3, lambda i, d: lax.psum(d, "data") * 0.5 + a, c), None

        return lax.scan(outer, a, None, length=4)[0]

    c = only(
        parse_collectives(compiled_text(m8, f, P("data"), P("data"), jnp.ones(8 * N)), m8),
        "all-reduce",
    )
    assert c.count == 12


# ---------------------------------------------------------- axis attribution, data=2,fsdp=2,model=2


@pytest.mark.parametrize(
    "axes,size", [(("data", "fsdp"), 4), (("model",), 2), (("data", "model"), 4), (("fsdp",), 2)]
)
def test_psum_axes(m222, axes, size):
    rest = tuple(a for a in ("data", "fsdp", "model") if a not in axes)
    text = compiled_text(
        m222, lambda a: lax.psum(a, axes), P(("data", "fsdp", "model")), P(rest), jnp.ones(8 * N)
    )
    c = only(parse_collectives(text, m222), "all-reduce")
    assert (c.axes, c.group_size, c.operand_bytes) == (axes, size, 4096)
    assert c.wire_bytes() == 2 * (size - 1) / size * 4096


def test_ids_are_mesh_positions_not_device_ids():
    # Mesh whose flat order is not device-id order: replica-group ids must be read as positions in
    # mesh.devices.flat. Read as Device.id, {0,4} would land on the 'model' axis here.
    devs = list(np.array(jax.devices()).reshape(2, 2, 2).transpose(2, 1, 0).reshape(-1))
    mesh = make_mesh("data=2,fsdp=2,model=2", devices=devs)
    assert [d.id for d in mesh.devices.flat] != list(range(8))
    text = compiled_text(
        mesh,
        lambda a: lax.psum(a, "data"),
        P(("data", "fsdp", "model")),
        P(("fsdp", "model")),
        jnp.ones(8 * N),
    )
    assert only(parse_collectives(text, mesh), "all-reduce").axes == ("data",)


def test_no_mesh_means_no_axes(m8):
    c = parse_collectives(
        compiled_text(m8, lambda a: lax.psum(a, "data"), P("data"), P(), jnp.ones(8 * N))
    )[0]
    assert (c.axes, c.group_size) == ((), 8)


# ------------------------------------------------------------------ hand-written formats


def test_iota_groups():
    assert iota_groups("[4,2]<=[8]").tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert iota_groups("[2,4]<=[4,2]T(1,0)").tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert iota_groups("[4,2]<=[2,2,2]T(0,2,1)").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert iota_groups("[4,2]<=[2,2,2]T(2,1,0)").tolist() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert explicit_groups("{{0,1},{2,3}}") == [[0, 1], [2, 3]]
    assert explicit_groups("{}") == []


def test_mesh_axes_groups():
    assert mesh_axes_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_1'}").tolist() == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]
    assert mesh_axes_groups("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}").tolist() == [
        [0, 2, 4, 6],
        [1, 3, 5, 7],
    ]
    assert mesh_axes_groups("mesh[a=8] {a:(1)2}").tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh_axes_groups("mesh[a=8] {a:(2)2}").tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh_axes_groups("mesh[x=4,y=2], device_ids=(6,3,0,1,5,2,7,4) {y}").tolist() == [
        [6, 3],
        [0, 1],
        [5, 2],
        [7, 4],
    ]
    assert mesh_axes_groups("mesh[a=2,b=2], device_ids=([2,2]T(1,0)) {b}").tolist() == [
        [0, 2],
        [1, 3],
    ]


def test_shape_bytes():
    assert shape_bytes("f32[8,4]{1,0}") == 128
    assert shape_bytes("(f32[8,4]{1,0}, f32[16]{0})") == 192
    assert (
        shape_bytes("(bf16[4]{0}, /*index=1*/s8[3], pred[2], f8e4m3fn[5], u64[1], f16[2,2])")
        == 8 + 3 + 2 + 5 + 8 + 8
    )
    assert (
        shape_bytes("s4[3]") == 2 and shape_bytes("f32[]") == 4 and shape_bytes("f32[<=6]{0}") == 24
    )
    assert shape_bytes("f32[8,128]{1,0:T(8,128)}") == 4096


def test_replica_group_forms_map_to_axes(m222):
    # spellings seen in XLA:CPU output (ids are flat positions in the data x fsdp x model mesh)
    lines = {
        "{{0,2},{4,6},{1,3},{5,7}}": (("fsdp",), 2),
        "[4,2]<=[2,2,2]T(2,1,0)": (("data",), 2),
        "[2,4]<=[4,2]T(1,0)": (("data", "fsdp"), 4),
        "mesh['axis_0'=4,'axis_1'=2] {'axis_1'}": (("model",), 2),
        "{}": (("data", "fsdp", "model"), 8),  # empty = every device (num_partitions)
    }
    for rg, (axes, size) in lines.items():
        text = (
            "  %ar = (f32[8,4]{1,0}, f32[16]{0}) all-reduce(%p, f32[16]{0} %q), channel_id=1, "
            f"replica_groups={rg}, use_global_device_ids=true, to_apply=%add\n"
        )
        table = "  %p = f32[8,4]{1,0} parameter(0)\n"
        (c,) = parse_collectives("HloModule m, num_partitions=8\n\n" + table + text, m222)
        assert (c.axes, c.group_size, c.operand_bytes, c.result_bytes) == (
            axes,
            size,
            128 + 64,
            192,
        ), rg


ASYNC_HLO = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_rs (p0: f32[1024]) -> f32[128] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %rs = f32[128]{0} reduce-scatter(%p0), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true, to_apply=%add
}

%branch (bp: f32[1024]) -> f32[1024] {
  %bp = f32[1024]{0} parameter(0)
  ROOT %bar = f32[1024]{0} all-reduce(%bp), channel_id=5, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add
}

%branch_empty (ep: f32[1024]) -> f32[1024] {
  ROOT %ep = f32[1024]{0} parameter(0)
}

%body (param: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %param = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = f32[1024]{0} get-tuple-element(%param), index=1
  %ags = (f32[1024]{0}, f32[8192]{0}) all-gather-start(f32[1024]{0} %x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
  %agd = f32[8192]{0} all-gather-done((f32[1024]{0}, f32[8192]{0}) %ags)
  %ars = f32[1024]{0} all-reduce-start(%x), channel_id=2, replica_groups={}, use_global_device_ids=true, to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %rss = ((f32[1024]{0}), f32[128]{0}) async-start(%x), calls=%wrapped_rs
  %rsd = f32[128]{0} async-done(%rss), calls=%wrapped_rs
  %cps = (f32[1024]{0}, f32[1024]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=4, source_target_pairs={{0,1},{1,0},{2,3},{3,2}}
  %cpd = f32[1024]{0} collective-permute-done(%cps)
  %pr = pred[] constant(true)
  %cnd = f32[1024]{0} conditional(%pr, %cpd, %ard), true_computation=%branch, false_computation=%branch_empty
  ROOT %t = (s32[], f32[1024]{0}) tuple(%i, %cnd)
}

%cond (cp: (s32[], f32[1024])) -> pred[] {
  %cp = (s32[], f32[1024]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%body2 (q: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %q = (s32[], f32[1024]{0}) parameter(0)
  %y = f32[1024]{0} get-tuple-element(%q), index=1
  %ar2 = f32[1024]{0} all-reduce(%y), channel_id=6, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  ROOT %t2 = (s32[], f32[1024]{0}) tuple(%y, %ar2)
}

ENTRY %main (p: f32[1024]) -> f32[1024] {
  %p = f32[1024]{0} parameter(0)
  %z = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%z, %p)
  %w = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %w2 = (s32[], f32[1024]{0}) while(%w), condition=%cond, body=%body2
  ROOT %out = f32[1024]{0} get-tuple-element(%w2), index=1
}
"""  # noqa: E501  (HLO as XLA prints it: one instruction per line, the parser's unit)


def test_async_pairs_conditionals_unknown_trips(m222):
    colls = {c.name: c for c in parse_collectives(ASYNC_HLO, m222)}
    assert set(colls) == {
        "ags",
        "ars",
        "rs",
        "cps",
        "bar",
        "ar2",
    }  # -done halves are not counted again
    ag, ar, rs, cp, bar, ar2 = (colls[k] for k in ("ags", "ars", "rs", "cps", "bar", "ar2"))
    assert (ag.kind, ag.operand_bytes, ag.result_bytes, ag.count, ag.is_async) == (
        "all-gather",
        4096,
        32768,
        3,
        True,
    )
    assert (ar.kind, ar.group_size, ar.axes, ar.is_async) == (
        "all-reduce",
        8,
        ("data", "fsdp", "model"),
        True,
    )
    assert (rs.kind, rs.operand_bytes, rs.result_bytes, rs.count, rs.is_async) == (
        "reduce-scatter",
        4096,
        512,
        3,
        True,
    )
    assert (cp.kind, cp.operand_bytes, cp.result_bytes, cp.group_size, cp.axes) == (
        "collective-permute",
        4096,
        4096,
        2,
        ("model",),
    )
    # a conditional branch counts once per execution of its caller (here the 3-trip loop body)
    assert (bar.count, bar.axes, bar.is_async) == (3, ("model",), False)
    assert (ar2.count, ar2.trip_count_known, ar2.axes) == (1, False, ("data", "fsdp"))
    assert ag.trip_count_known and rs.trip_count_known
    s = summarize(list(colls.values()))
    assert (
        s["all-gather"]["async"] == 3
        and s["all-reduce"]["async"] == 3
        and s["all-reduce"]["count"] == 3 + 3 + 1
    )


def test_summarize_totals():
    colls = [
        Collective("all-reduce", 4096, 4096, 8, ("data",), 5, False),
        Collective("all-reduce", 100, 100, 2, ("data", "fsdp"), 1, True),
        Collective("all-gather", 1000, 4000, 4, ("fsdp",), 2, False),
    ]
    s = summarize(colls)
    assert set(s) == set(KINDS)
    assert s["all-reduce"]["count"] == 6
    assert s["all-reduce"]["operand_bytes"] == 5 * 4096 + 100
    assert s["all-reduce"]["wire_bytes"] == 5 * 2 * 7 / 8 * 4096 + 2 * 1 / 2 * 100
    assert s["all-reduce"]["async"] == 1
    assert s["all-reduce"]["by_axes"] == {
        "data": {"count": 5, "operand_bytes": 5 * 4096, "wire_bytes": 5 * 2 * 7 / 8 * 4096},
        "data,fsdp": {"count": 1, "operand_bytes": 100, "wire_bytes": 100.0},
    }
    assert s["all-gather"]["wire_bytes"] == 2 * 3 / 4 * 4000
    assert s["reduce-scatter"] == {
        "count": 0,
        "operand_bytes": 0,
        "wire_bytes": 0.0,
        "by_axes": {},
        "async": 0,
    }
