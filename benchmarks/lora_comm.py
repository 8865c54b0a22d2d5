"""The collectives of a LoRA/QLoRA train step, read from its compiled HLO (8 fake CPU devices), next
to a full fine-tune's: bytes per device per step by kind and mesh axes, the gradient reductions
(all-reduce, reduce-scatter) against the adapters' size and the adapted weights' size, and the
compiled step's temporary bytes.

    python benchmarks/lora_comm.py [--preset default] [--meshes "fsdp=8;data=2,fsdp=4"]
        [--modes full,lora-float32,lora-bfloat16,qlora-nf4] [--rank 16] [--batch 16] [--seq 128]

Compile only (plan.report.analyze): nothing is allocated or trained. float32 compute; LoRA on
q,k,v,o,gate,up,down at --rank (alpha 16), NF4 in blocks of 64 with double quantisation.

    python benchmarks/lora_comm.py --variants

compiles the gradient of one projection, x [64, 128, 512] sharded over 8 devices, W [512, 2048],
rank 16, three ways: autodiff through the merged weight x (W + s A B), a custom_vjp on the merge
whose backward contracts dW_eff into dA = s dW_eff B^T and dB = s A^T dW_eff, and the factored
x W + s (x A) B; and prints each one's collective bytes.
"""

import argparse
import json
import math

import common  # noqa: F401  (8 fake devices, repo on sys.path)
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mesh.build import make_mesh
from models import model
from plan.hlo import parse_collectives, summarize
from plan.report import analyze
from train.core import lora
from train.core.config import build
from train.core.setup import setup

MODES = {
    "full": {},
    "lora-float32": {"lora.base_dtype": "float32"},
    "lora-bfloat16": {"lora.base_dtype": "bfloat16"},
    "qlora-nf4": {"lora.base_dtype": "nf4"},
}
MIB = 2**20


def _bytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def measure(preset: str, mesh: str, mode: str, rank: int, batch: int, seq: int) -> dict:
    over = {
        "model.preset": preset,
        "model.dtype": "float32",
        "parallelism.mesh": mesh,
        "train.batch_size": batch,
        "train.seq_len": seq,
        **MODES[mode],
    }
    if mode != "full":
        over |= {"lora.rank": rank, "lora.allow_random_base": True}
    cfg = build(over)
    r = analyze(setup(cfg, make_mesh(mesh)))
    full_lora = cfg.lora if mode != "full" else build({**over, "lora.rank": rank}).lora
    adapters = lora.abstract_adapters(cfg.model, full_lora)
    base = model.abstract_params(cfg.model)
    adapted = [base[s][m][w] for s in adapters for m in adapters[s] for w in adapters[s][m]]
    detail = r["collectives_detail"]
    return {
        "preset": preset,
        "mesh": mesh,
        "mode": mode,
        "by_kind_axes_MiB": {
            f"{kind}@{axes}": round(v["operand_bytes"] / MIB, 3)
            for kind, c in detail.items()
            for axes, v in c["by_axes"].items()
            if v["operand_bytes"]
        },
        "reductions_MiB": round(
            sum(detail[k]["operand_bytes"] for k in ("all-reduce", "reduce-scatter")) / MIB, 3
        ),
        "adapters_MiB": round(_bytes(adapters) / MIB, 3),
        "adapted_weights_MiB": round(_bytes(adapted) / MIB, 3),
        "temp_MiB": round(r["memory"]["temp_bytes"] / MIB, 2),
    }


def variants() -> None:
    """The three ways to differentiate one adapted projection (module docstring)."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    d, f, r, s = 512, 2048, 16, 2.0

    @jax.custom_vjp
    def merge(w, a, b):
        return w + s * a @ b

    def merge_bwd(res, g_DF):  # dW_eff contracted onto the adapters (W is frozen)
        a, b = res
        return None, s * g_DF @ b.T, s * a.T @ g_DF

    merge.defvjp(lambda w, a, b: (merge(w, a, b), (a, b)), merge_bwd)
    forms = {
        "merged (autodiff)": lambda w, a, b, x: x @ (w + s * a @ b),
        "custom_vjp on the merge": lambda w, a, b, x: x @ merge(w, a, b),
        "factored": lambda w, a, b, x: x @ w + s * (x @ a) @ b,
    }
    sharded = lambda shape, spec: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.float32, sharding=NamedSharding(mesh, spec)
    )
    x, w = sharded((64, 128, d), P("fsdp")), sharded((d, f), P("fsdp"))
    ab = (sharded((d, r), P("fsdp")), sharded((r, f), P()))
    for name, form in forms.items():
        loss = lambda ab, w, x, form=form: jnp.sum(jnp.tanh(form(w, *ab, x)))  # noqa: E731
        grad = jax.jit(jax.grad(loss), out_shardings=tuple(a.sharding for a in ab))
        got = summarize(parse_collectives(grad.lower(ab, w, x).compile().as_text(), mesh))
        row = {k: got[k]["operand_bytes"] for k in ("all-reduce", "all-gather") if got[k]["count"]}
        print(json.dumps({"form": name, **row, "W": d * f * 4, "adapters": (d + f) * r * 4}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="default")
    ap.add_argument("--meshes", default="fsdp=8;data=2,fsdp=4")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--variants", action="store_true")
    a = ap.parse_args()
    if a.variants:
        return variants()
    for mesh in a.meshes.split(";"):
        for mode in a.modes.split(","):
            print(json.dumps(measure(a.preset, mesh, mode, a.rank, a.batch, a.seq)), flush=True)


if __name__ == "__main__":
    main()
