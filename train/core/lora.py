"""LoRA fine-tuning (--lora.rank R): low-rank adapters trained on a frozen base, on any mesh.

For each targeted weight W (the layer stack's [L, in..., out...]) the adapters are A [L, in..., r]
(normal, std 1/sqrt(fan_in)) and B [L, r, out...] (zero), so that the model at step 0 is the base
exactly. The train state's `params` are the adapters alone, so the optimizer keeps state for them
only and a checkpoint holds them (and that state) only. The base is a third argument of the jitted
step, never differentiated. Inside the step each adapted weight is paired with its adapters
(`step_params`, models.quant.LoraWeight: a pytree with the base's leading dims and shardings, so
every mesh and schedule the base trains on runs its LoRA fine-tune unchanged), and each layer
computes x W + (alpha / r)(x A) B (models/adapters.py): the backward forms and reduces the adapters'
gradients only, never one of W's size. Eval, sampling and export use the merged weights
W + (alpha / r) A B (checkpoint.layout.merged). A's input dims take W's logical axis names and B's
output dims too; r is replicated.

The base comes in with --init-from (an HF import or a Brigade checkpoint); the run records its
fingerprint (checkpoint.layout.fingerprint) in the config it saves, and a resume reloads the base
from that pointer (or this run's --init-from) and refuses one whose fingerprint differs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from checkpoint import finite
from checkpoint.layout import fingerprint, merged
from checkpoint.manager import open_checkpoint
from errors import UserError
from mesh.rules import axis_rules
from mesh.shard import tree_shardings
from models import model
from models.config import ModelConfig
from train.core import qlora
from train.core.config import Config, LoraConfig

# --lora.targets name -> (module, weight, its input dims after the layer dim)
TARGET_WEIGHTS = {
    "q": ("attn", "wq_DNH", 1),
    "k": ("attn", "wk_DKH", 1),
    "v": ("attn", "wv_DKH", 1),
    "o": ("attn", "wo_NHD", 2),
    "gate": ("mlp", "w_gate_DF", 1),
    "up": ("mlp", "w_up_DF", 1),
    "down": ("mlp", "w_down_FD", 1),
}


def enabled(lora: LoraConfig | None) -> bool:
    return bool(lora is not None and lora.rank)


def scale(lora: LoraConfig) -> float:
    return lora.alpha / lora.rank


def _targets(cfg: ModelConfig, lora: LoraConfig) -> list[tuple[tuple[str, ...], tuple, int]]:
    """(path, W's logical axes, input dims) of every weight the targets name, in each layer stack
    that has it (dense `blocks`, the attention of `moe_blocks`); one line for a target that names
    no weight of this model."""
    axes, out = model.param_axes(cfg), []
    for name in lora.target_list():
        module, weight, n_in = TARGET_WEIGHTS[name]
        found = [
            ((stack, module, weight), node[module][weight], n_in)
            for stack, node in axes.items()
            if isinstance(node, dict)
            and isinstance(node.get(module), dict)
            and weight in node[module]
        ]
        if not found:
            raise UserError(
                f"--lora.targets: '{name}' adapts {module}/{weight}, which this model does not have"
                f" (MoE experts are not adapted); valid here: "
                + ", ".join(
                    t
                    for t, (m, w, _) in TARGET_WEIGHTS.items()
                    if any(isinstance(n, dict) and w in n.get(m, {}) for n in axes.values())
                )
            )
        out += found
    return out


def _nest(items: dict) -> dict:
    """{(a, b, c): leaf} -> {a: {b: {c: leaf}}}."""
    out: dict = {}
    for path, leaf in items.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def adapter_axes(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """The logical axis names of the adapters: A keeps W's layer and input names, B its layer and
    output names; the rank dim is replicated (None)."""
    return _nest(
        {
            path: {
                "lora_a": (w_axes[0], *w_axes[1 : 1 + n_in], None),
                "lora_b": (w_axes[0], None, *w_axes[1 + n_in :]),
            }
            for path, w_axes, n_in in _targets(cfg, lora)
        }
    )


def abstract_adapters(cfg: ModelConfig, lora: LoraConfig) -> dict:
    """ShapeDtypeStructs of the adapters (in the model's param_dtype), without allocating."""
    base, r = model.abstract_params(cfg), lora.rank
    out = {}
    for path, _, n_in in _targets(cfg, lora):
        shape = _at(base, path).shape
        out[path] = {
            "lora_a": jax.ShapeDtypeStruct((*shape[: 1 + n_in], r), cfg.param_dtype),
            "lora_b": jax.ShapeDtypeStruct((shape[0], r, *shape[1 + n_in :]), cfg.param_dtype),
        }
    return _nest(out)


def init_adapters(cfg: ModelConfig, lora: LoraConfig, key: jax.Array) -> dict:
    """Fresh adapters: A normal with std 1/sqrt(fan_in) (fan_in: the product of W's input dims), B
    zero, so that W + scale A B = W at step 0. Call under jit with out_shardings."""
    shapes = jax.tree_util.tree_flatten_with_path(abstract_adapters(cfg, lora))[0]
    keys = iter(jax.random.split(key, len(shapes)))
    out = {}
    for path, s in shapes:
        names = tuple(k.key for k in path)
        if names[-1] == "lora_a":
            fan_in = math.prod(s.shape[1:-1])
            out[names] = jax.random.normal(next(keys), s.shape, s.dtype) * fan_in**-0.5
        else:
            out[names] = jnp.zeros(s.shape, s.dtype)
    return _nest(out)


def _at(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def base_dtype(cfg: ModelConfig, lora: LoraConfig) -> str:
    return cfg.param_dtype if lora.base_dtype == "auto" else lora.base_dtype


def base_shardings(cfg: Config, mesh, rules) -> dict:
    """The frozen base's NamedShardings: exactly the parameters' of a full fine-tune (a quantised
    base: its codes so, its scales on the matching axes, train/core/qlora.py)."""
    full = tree_shardings(mesh, model.param_axes(cfg.model), rules)
    if qlora.enabled(cfg.lora):
        return qlora.shardings(cfg, TARGET_WEIGHTS, full, mesh)
    return full


def abstract_base(cfg: Config, shardings: dict) -> dict:
    """ShapeDtypeStructs of the base as the step takes it (--lora.base_dtype, the base's
    shardings)."""
    if qlora.enabled(cfg.lora):
        shapes = qlora.abstract_base(cfg, TARGET_WEIGHTS, model.abstract_params(cfg.model))
    else:
        dtype = base_dtype(cfg.model, cfg.lora)
        shapes = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, dtype), model.abstract_params(cfg.model)
        )
    return jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, shardings
    )


def model_params(cfg: Config, base: dict, adapters: dict) -> dict:
    """What the model evaluates with (eval, sampling, export): the base with every adapted weight
    merged, in param_dtype (a quantised base: each adapted weight paired with its adapters, as
    `step_params`, since a merged one would be the stack at full precision)."""
    if qlora.enabled(cfg.lora):
        return step_params(cfg, base, adapters)
    return merged(base, adapters, scale(cfg.lora), dtype=cfg.model.param_dtype)


def step_params(cfg: Config, base: dict, adapters: dict) -> dict:
    """What the train step's loss computes with: the base with each adapted weight paired with its
    adapters (models.quant.LoraWeight), which every layer multiplies by factored, x W + s (x A) B
    (models/adapters.py), so that the step reduces the adapters' gradients over the batch's axes,
    not a gradient of W's size. Jittable: the step calls it inside the traced loss."""
    return qlora.attach(base, adapters, scale(cfg.lora))


def check_run(cfg: Config) -> None:
    """One line for a LoRA run that cannot work: with DiLoCo (replicas keep whole-model drift),
    with the MoE router bias that the step updates in the (frozen) base, with a registered model,
    with a rank larger than a targeted weight's input or output size."""
    if not enabled(cfg.lora):
        return
    if cfg.comm.sync_every > 1:
        raise UserError(
            f"--lora.rank {cfg.lora.rank}: not with --comm.sync_every {cfg.comm.sync_every}"
            " (DiLoCo); use --comm.sync_every 1"
        )
    if cfg.model.n_experts and cfg.model.router_bias_rate > 0:
        raise UserError(
            f"--lora.rank {cfg.lora.rank}: the router bias (--model.router_bias_rate"
            f" {cfg.model.router_bias_rate}) would update the frozen base; set it to 0"
        )
    if getattr(cfg.model, "arch", ""):  # only a registered model's config has the field
        raise UserError(
            f"--lora.rank {cfg.lora.rank}: LoRA adapts the built-in decoder's projections; model"
            f" '{cfg.model.arch}' is a registered one"
        )
    if qlora.enabled(cfg.lora):
        qlora.check(cfg, TARGET_WEIGHTS)
    base = model.abstract_params(cfg.model)
    # a rank above min(in, out) adds no expressiveness
    for path, _, n_in in _targets(cfg.model, cfg.lora):
        shape = _at(base, path).shape
        fan_in, fan_out = math.prod(shape[1 : 1 + n_in]), math.prod(shape[1 + n_in :])
        if cfg.lora.rank > min(fan_in, fan_out):
            raise UserError(
                f"--lora.rank {cfg.lora.rank} is larger than {'/'.join(path[1:])}'s smaller dim"
                f" ({fan_in} in, {fan_out} out); use a rank <= {min(fan_in, fan_out)}, or drop that"
                f" target from --lora.targets"
            )


def check_start(cfg: Config, resuming: bool) -> None:
    """A fresh LoRA run needs a base to adapt: --init-from, or --lora.allow_random_base true."""
    if (
        enabled(cfg.lora)
        and not resuming
        and not cfg.checkpoint.init_from
        and not cfg.lora.allow_random_base
    ):
        raise UserError(
            f"--lora.rank {cfg.lora.rank} without --init-from: the adapters would train on random"
            " base weights; pass --init-from PATH (an HF import or a Brigade checkpoint), or"
            " --lora.allow_random_base true"
        )


def load_base(cfg: Config, mesh, rules, shardings: dict, meta: dict) -> tuple[dict, str, str, str]:
    """The frozen base, sharded for the step -> (base, its fingerprint, the pointer to record: its
    step directory, "" for a random base; a line for the log). From this run's --init-from, else
    the pointer the resumed checkpoint's config (`meta`) holds; a random one from the seed when
    neither names one. Refused in one line when its fingerprint
    differs from the one recorded (by the checkpoint, or --lora.base_fingerprint)."""
    saved = meta.get("config", {})
    path = cfg.checkpoint.init_from or saved.get("checkpoint", {}).get("init_from", "")
    want = saved.get("lora", {}).get("base_fingerprint", "") or cfg.lora.base_fingerprint
    # read (and fingerprinted) at full precision, sharded as a full fine-tune's parameters
    full_sh = tree_shardings(mesh, model.param_axes(cfg.model), rules)
    full = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        model.abstract_params(cfg.model),
        full_sh,
    )
    if path:
        src, step = open_checkpoint(path)
        params, where = src.restore_params(step, full), src.step_dir(step)
        finite.check_params(params, f"--init-from {where}")  # NaN weights: loss nan (LoRA base)
        pointer = where
    else:
        seed = saved.get("train", {}).get("seed", cfg.train.seed)
        with jax.set_mesh(mesh), axis_rules(rules):
            params = jax.jit(
                lambda k: model.init(cfg.model, jax.random.fold_in(k, 1)), out_shardings=full_sh
            )(jax.random.key(seed))
        where, pointer = f"a random init (seed {seed})", ""
    got = fingerprint(params)
    if want and got != want:
        raise UserError(
            f"LoRA base {where}: its fingerprint {got} differs from the {want} this run's adapters"
            " were trained on; the base changed: pass --init-from the original base, or start a"
            " new --run-dir"
        )
    dtype = base_dtype(cfg.model, cfg.lora)
    if qlora.enabled(cfg.lora):  # quantised once (the codes cannot reuse the full base's buffers)
        params = jax.jit(
            lambda p: qlora.quantize_base(cfg, TARGET_WEIGHTS, p), out_shardings=shardings
        )(params)
    elif dtype != cfg.model.param_dtype:
        params = jax.jit(
            lambda p: jax.tree.map(lambda x: x.astype(dtype), p),
            out_shardings=shardings,
            donate_argnums=(0,),
        )(params)
    held = f", held {dtype}" if qlora.enabled(cfg.lora) else ""
    note = (
        f"LoRA: rank {cfg.lora.rank} adapters on the frozen base from {where} (fingerprint"
        f" {got}{held})"
    )
    return params, got, pointer, note


def with_base_recorded(cfg: Config, found: str, pointer: str) -> Config:
    """`cfg` with its base recorded where every save carries it: the base's fingerprint `found`,
    and its step directory `pointer` as --init-from (the pointer a resume or an export follows)."""
    return dataclasses.replace(
        cfg,
        lora=dataclasses.replace(cfg.lora, base_fingerprint=found),
        checkpoint=dataclasses.replace(cfg.checkpoint, init_from=pointer),
    )
