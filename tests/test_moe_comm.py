"""models/moe_comm.py: the MoE's collectives on CPU. bfloat16 rows and weights travel as their
uint16 bits (XLA:CPU would convert a bfloat16 collective to float32 on both sides): the values
arrive bit for bit, the expert ids ride in the same all-to-all, the gradients are the transposes
(the all-to-all's own, and a float32 reduce-scatter for the gather), and the compiled program
holds no floating-point all-to-all or all-gather."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.moe_comm import exchange, gather_weight

AXES = ("fsdp", "expert")


def _mesh():
    return jax.make_mesh((4, 2), AXES)


def _on_mesh(mesh, f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def test_exchange_moves_bits_and_ids_and_transposes():
    mesh = _mesh()
    rows = P(AXES)
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (8 * 6, 16)).astype(jnp.bfloat16)
    ids = jax.random.randint(k[1], (8 * 6,), 0, 5).astype(jnp.int32)
    probe = jax.random.normal(k[2], (8 * 6, 16)).astype(jnp.bfloat16)
    x, ids, probe = (jax.device_put(a, NamedSharding(mesh, rows)) for a in (x, ids, probe))

    def ours(x, ids, probe):
        y, got = exchange(x, ("expert",), ids)
        _, vjp = jax.vjp(lambda x: exchange(x, ("expert",), ids)[0], x)
        return y, got, vjp(probe)[0]

    def plain(x, ids, probe):
        a2a = lambda a: lax.all_to_all(a, "expert", 0, 0, tiled=True)  # noqa: E731
        return a2a(x.astype(jnp.float32)), a2a(ids), a2a(probe.astype(jnp.float32))

    with jax.set_mesh(mesh):
        f = _on_mesh(mesh, ours, (rows,) * 3, (rows,) * 3)
        got = f(x, ids, probe)
        ref = _on_mesh(mesh, plain, (rows,) * 3, (rows,) * 3)(x, ids, probe)
        hlo = f.lower(x, ids, probe).compile().as_text()
    for a, b in zip(got, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert got[1].dtype == jnp.int32
    # one all-to-all per direction, of 16-bit integers: no float one, no separate one for the ids
    a2a = re.findall(r"= \(?(\w+)\[[^=]*? all-to-all\(", hlo)
    assert a2a and set(a2a) == {"u16"}, a2a
    assert len(a2a) == 2, a2a


def test_gather_weight_sends_bits_and_reduces_gradients_in_float32():
    mesh = _mesh()
    spec = P("expert", "fsdp")  # [X, D, F], D split over fsdp: gathered along dim 1
    k = jax.random.split(jax.random.key(1), 2)
    w = jax.device_put(jax.random.normal(k[0], (4, 16, 6)), NamedSharding(mesh, spec))
    # each device's own cotangent for the whole gathered weight (as the tokens' gradients are)
    probe = jax.random.normal(k[1], (8, 2, 16, 6)).astype(jnp.bfloat16)
    probe = jax.device_put(probe, NamedSharding(mesh, P(AXES)))

    def ours(w, probe):
        full, vjp = jax.vjp(lambda w: gather_weight(w, ("fsdp",), 1, jnp.bfloat16), w)
        return full[None], vjp(probe[0])[0]

    def plain(w, probe):
        full = lax.all_gather(w.astype(jnp.bfloat16), "fsdp", axis=1, tiled=True)
        grad = lax.psum_scatter(
            probe[0].astype(jnp.float32), "fsdp", scatter_dimension=1, tiled=True
        )
        return full[None], grad

    outs = (P(AXES), spec)
    with jax.set_mesh(mesh):
        f = _on_mesh(mesh, ours, (spec, P(AXES)), outs)
        got = f(w, probe)
        ref = _on_mesh(mesh, plain, (spec, P(AXES)), outs)(w, probe)
        hlo = f.lower(w, probe).compile().as_text()
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(ref[0], np.float32))
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)
    gathers = re.findall(r"= (\w+)\[[^=]*? all-gather\(", hlo)
    scatters = re.findall(r"= (\w+)\[[^=]*? reduce-scatter\(", hlo)
    assert gathers == ["u16"], gathers
    assert scatters == ["f32"], scatters
