"""A run's pieces, computed once and in order from the config and the mesh: the rules, the
batch sharding, the data-parallel axes, the sync layout, the optimizer, the state shardings;
and the one jitted train step built from them. The Trainer, `plan` and the benchmarks all start
here, so what they compile is what a run compiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from errors import expect
from mesh.rules import axis_rules, head_layout, logical_to_spec, make_rules, sequence_parallel
from mesh.shard import data_parallel_axes, tree_shardings
from mesh.spec import mesh_text
from models import context, model
from train.core import comm, grpo_loss, lora, memory, optim, pair_loss
from train.core import state as train_state
from train.core.comm import SyncLayout
from train.core.config import Config
from train.core.shapes import expert_rules, validate_run
from train.core.step import local_sgd_step, train_step
from train.data import abstract_batch as data_abstract_batch
from train.data.pairs import abstract_pairs


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """Everything a step needs besides the state and the batch. Build it with `setup()`."""

    cfg: Config
    mesh: Mesh
    rules: dict
    batch_sharding: NamedSharding  # [batch, seq] token arrays
    dp_axes: tuple[str, ...]  # plain data-parallel mesh axes: where the gradient sync runs
    sync: SyncLayout  # what the sync keeps per replica (residuals, DiLoCo drift)
    local_clip: float  # > 0: each replica clips before a compressed sync
    tx: optax.GradientTransformation
    lr: optax.Schedule
    state_shardings: train_state.TrainState
    compute_dtype: Any
    # Trainer(loss=): per-token loss replacing cross-entropy (train/core/batch_loss.py)
    loss_fn: Callable | None = None
    # Trainer(optimizer=): replaces AdamW inside `tx`
    optimizer: optax.GradientTransformation | None = None
    # --lora.rank > 0: the frozen base's, the step's third argument (train/core/lora.py)
    base_shardings: Any = None
    # --objective dpo|ipo without LoRA: the frozen reference's, the step's third argument
    # (train/core/pair_loss.py; with LoRA the base is the reference)
    ref_shardings: Any = None

    @property
    def model_cfg(self):
        return self.cfg.model

    def tx_with(self, clip: bool) -> optax.GradientTransformation:
        """This run's optimizer with clipping in the chain or not (a checkpoint of another --comm
        layout holds the other form)."""
        return optim.make(self.cfg.train, clip=clip, lr=self.lr, optimizer=self.optimizer)


def run_rules(cfg: Config, sizes: Mapping[str, int], compute_dtype: str) -> dict:
    """The rule table of a run on a mesh of these axis sizes: the defaults, the user's overrides,
    the MoE experts' layout that --parallelism.experts_over_fsdp picks (mesh/expert_layout.py) and
    the LM head's layout that --parallelism.vocab_parallel picks (mesh.rules.head_layout)."""
    p, m, t = cfg.parallelism, cfg.model, cfg.train
    rules = sequence_parallel(make_rules(p.rules)) if p.sequence_parallel else make_rules(p.rules)
    act_bytes = jnp.dtype(compute_dtype).itemsize
    rules = expert_rules(rules, p.experts_over_fsdp, sizes, m, t, act_bytes, jax.default_backend())
    return head_layout(
        rules,
        p.vocab_parallel,
        sizes,
        vocab=m.vocab_size,
        batch_tokens=t.batch_size // t.micro_batches * t.seq_len,
        act_bytes=act_bytes,
        param_bytes=jnp.dtype(m.param_dtype).itemsize,
    )


def setup(
    cfg: Config,
    mesh: Mesh,
    *,
    loss: Callable | None = None,
    optimizer: optax.GradientTransformation | None = None,
    schedule: Any = None,
) -> RunSetup:
    """Each value from the ones before it; one line (UserError) for shapes the mesh cannot split.
    `loss`, `optimizer`, `schedule`: the Trainer's extension points (train/run/loop.py)."""
    expect("setup", "cfg", cfg, Config, "a train.core.config.Config (from train.core.config.build)")
    expect("setup", "mesh", mesh, Mesh, "a jax Mesh (mesh.build.make_mesh)")
    if optimizer is not None:
        optim.check_optimizer(optimizer, schedule)
    lr = optim.schedule(cfg.train) if schedule is None else optim.as_schedule(schedule)
    rules = run_rules(cfg, dict(mesh.shape), model.compute_dtype(cfg.model))
    validate_run(mesh, rules, cfg.model, cfg.train, cfg.pipeline)
    memory.check_host_offload(cfg, list(mesh.devices.flat))
    lora.check_run(cfg)
    pair_loss.check_run(cfg, mesh, loss)
    param_shardings = tree_shardings(mesh, model.param_axes(cfg.model), rules)
    dp_axes = data_parallel_axes(
        mesh, rules["batch"], [sh.spec for sh in jax.tree.leaves(param_shardings)]
    )
    sync, local_clip = comm.sync_layout(cfg.comm, dp_axes, cfg.train.grad_clip)
    # a compressed sync clips per replica
    tx = optim.make(cfg.train, clip=not local_clip, lr=lr, optimizer=optimizer)
    return RunSetup(
        cfg=cfg,
        mesh=mesh,
        rules=rules,
        batch_sharding=NamedSharding(mesh, logical_to_spec(("batch", "seq"), rules)),
        dp_axes=dp_axes,
        sync=sync,
        local_clip=local_clip,
        tx=tx,
        lr=lr,
        state_shardings=train_state.with_loss_window(  # --train.spike_factor's window, if on
            train_state.shardings(cfg.model, tx, mesh, rules, sync, warn=_say, lora_cfg=cfg.lora),
            cfg.train.spike_factor,
            mesh,
        ),
        compute_dtype=model.compute_dtype(cfg.model),
        loss_fn=loss,
        optimizer=optimizer,
        base_shardings=lora.base_shardings(cfg, mesh, rules) if lora.enabled(cfg.lora) else None,
        # the reference is held as the parameters are
        ref_shardings=param_shardings
        if cfg.post.needs_reference and not lora.enabled(cfg.lora)
        else None,
    )


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, flush=True)


def abstract_state(s: RunSetup) -> train_state.TrainState:
    """ShapeDtypeStructs with shardings of the run's state (with --train.spike_factor's window
    when it is on): what compiles and restores use."""
    state = train_state.abstract(s.cfg.model, s.tx, s.mesh, s.rules, s.sync, lora_cfg=s.cfg.lora)
    return train_state.with_loss_window(state, s.cfg.train.spike_factor, s.mesh)


def create_state(s: RunSetup) -> train_state.TrainState:
    """A fresh state of the run (step 0, --train.seed's parameters, a fresh optimizer), created
    sharded: every device only ever holds its own shards."""
    c = s.cfg
    state = train_state.create(
        c.model, s.tx, s.mesh, s.rules, c.train.seed, s.sync, lora_cfg=c.lora
    )
    return train_state.with_loss_window(state, c.train.spike_factor, s.mesh)


def abstract_batch(s: RunSetup) -> dict:
    """ShapeDtypeStructs of one global batch, as the step reads it (pairs for a preference
    objective: train/data/pairs.py; grpo's B x G rollouts: train/core/grpo_loss.py)."""
    t = s.cfg.train
    if s.cfg.post.grpo:
        rows = t.batch_size * s.cfg.post.group_size
        several = s.cfg.post.updates_per_rollout > 1  # the batch carries pi_old's log-probs
        return grpo_loss.abstract_rollouts(rows, t.seq_len, s.batch_sharding, several)
    if s.cfg.post.preference:
        return abstract_pairs(s.cfg.train.batch_size, s.cfg.train.seq_len, s.batch_sharding)
    return data_abstract_batch(
        s.cfg.data, s.cfg.train.batch_size, s.cfg.train.seq_len, s.batch_sharding
    )


def jit_step(s: RunSetup):
    """The train step, jitted with the state's shardings: (state, batch) -> (state, metrics). The
    state is donated: its buffers become the new state's. A LoRA run's takes the frozen base as
    well: (state, batch, base) -> (state, metrics); a dpo or ipo run without LoRA its frozen
    reference model: (state, batch, reference) (train/core/pair_loss.py)."""
    # One function on purpose (~60 lines): the two step closures (DiLoCo's local step, the synced
    # step) read the same setup, and jax.jit below wraps whichever this run takes.
    cfg, t = s.cfg, s.cfg.train
    if s.sync.outer_tx is not None:  # local SGD / DiLoCo: replicas step alone, sync every H steps

        def step(state, batch):
            with context.strategy(cfg.parallelism.context_strategy):
                return local_sgd_step(
                    cfg.model,
                    s.tx,
                    s.sync.outer_tx,
                    s.lr,
                    t.micro_batches,
                    s.dp_axes,
                    cfg.comm.sync_every,
                    state,
                    batch,
                    pipeline=cfg.pipeline,
                    loss_fn=s.loss_fn,
                )
    else:
        param_specs = jax.tree.map(lambda sh: sh.spec, s.state_shardings.params)

        # frozen: a LoRA run's base, paired with the adapters in the loss, or the reference model
        def step(state, batch, *frozen):
            lora_on = s.base_shardings is not None
            merge = (
                (lambda adapters: lora.step_params(cfg, frozen[0], adapters)) if lora_on else None
            )
            if t.offload_optimizer:  # host -> device for the update; XLA schedules the copies
                state = state.replace(
                    opt_state=jax.device_put(state.opt_state, jax.memory.Space.Device)
                )
            with context.strategy(cfg.parallelism.context_strategy):  # read while tracing
                state, metrics = train_step(
                    cfg.model,
                    s.tx,
                    s.lr,
                    t.micro_batches,
                    s.dp_axes,
                    state,
                    batch,
                    comm_cfg=cfg.comm,
                    param_specs=param_specs,
                    pipeline=cfg.pipeline,
                    local_clip=s.local_clip,
                    loss_fn=s.loss_fn,
                    param_fn=merge,
                    terms_fn=_pair_terms(cfg, frozen),
                )
            if t.offload_optimizer:
                state = state.replace(
                    opt_state=jax.device_put(state.opt_state, jax.memory.Space.Host)
                )
            return state, metrics

    frozen = [sh for sh in (s.base_shardings, s.ref_shardings) if sh is not None]
    return jax.jit(
        step,
        in_shardings=(s.state_shardings, s.batch_sharding, *frozen),
        out_shardings=(s.state_shardings, None),
        donate_argnums=(0,),
    )


def _pair_terms(cfg: Config, frozen: tuple):
    """The post-training objective's terms for the step (None for --objective lm), its reference
    from the step's frozen argument (train/core/pair_loss.py, grpo_loss.py)."""
    if cfg.post.objective == "lm":
        return None
    ref = pair_loss.reference_params(cfg, frozen[0]) if cfg.post.needs_reference else None
    terms = grpo_loss.grpo_terms if cfg.post.grpo else pair_loss.pair_terms
    return lambda params, mb: terms(cfg.model, cfg.post, params, mb, ref)


def frozen_args(s: RunSetup) -> tuple:
    """The abstract frozen arguments of the step: a LoRA run's base, or the reference model."""
    if s.base_shardings is not None:
        return (lora.abstract_base(s.cfg, s.base_shardings),)
    if s.ref_shardings is not None:
        return (
            jax.tree.map(
                lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                model.abstract_params(s.cfg.model),
                s.ref_shardings,
            ),
        )
    return ()


def compile_step(s: RunSetup, state=None, batch=None):
    """The step compiled for `state` and `batch` (abstract ones by default: nothing allocated)."""
    with jax.set_mesh(s.mesh), axis_rules(s.rules):
        base = frozen_args(s)
        return (
            jit_step(s)
            .lower(
                abstract_state(s) if state is None else state,
                abstract_batch(s) if batch is None else batch,
                *base,
            )
            .compile()
        )


def compile_checked(s: RunSetup, state=None, batch=None):
    """-> (the step compiled for `state` and `batch`, abstract ones by default; its predicted peak
    bytes per device). Checked against the devices' memory unless --train.skip_memory_check:
    compiled before any state exists, the check comes before the allocation that a machine too
    small for the model would not survive."""
    compiled = compile_step(s, state, batch)
    peak = memory.step_bytes_per_device(compiled).get("peak")
    if not s.cfg.train.skip_memory_check:
        memory.check_fits(compiled, list(s.mesh.devices.flat), mesh_text(s.mesh.shape))
    return compiled, peak
