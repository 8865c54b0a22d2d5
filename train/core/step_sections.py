"""The sections the step and its data read: `train` (the optimizer and its schedule, the batch,
evaluation, sampling, recovery), `parallelism` (the mesh and the multi-process job) and `data`."""

from __future__ import annotations

import dataclasses
import functools

from errors import UserError
from models.config import CONTEXT_STRATEGIES
from models.fields import check_ranges, option, ranged
from train.core.flags import public_flag

# train/core/optim.py builds each from optax; named here so that parsing flags needs no JAX
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd", "muon")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The `train` section: the optimizer and its schedule, the batch, evaluation, sampling and
    recovery."""

    steps: int = ranged(120, ">=1", help="optimizer steps to run")
    batch_size: int = ranged(16, ">=1", help="global batch, in sequences")
    seq_len: int = ranged(128, ">=1", help="tokens per sequence; at most model.max_seq_len")
    micro_batches: int = ranged(
        1,
        ">=1",
        help="gradient accumulation inside the jitted step: the batch is split"
        " into this many micro-batches; must divide --batch-size",
    )
    lr: float = ranged(
        3e-3, ">0", help="peak learning rate: linear warmup to it, then a cosine decay"
    )
    min_lr_ratio: float = ranged(0.1, "[0, 1]", help="the cosine decays to lr * min_lr_ratio")
    warmup_steps: int = ranged(
        12,
        ">=0",
        help="steps of linear warmup; more than --steps is allowed (short smoke"
        " runs keep the default): the warmup is cut to steps - 1",
    )
    optimizer: str = option(
        "adamw",
        f"{' | '.join(OPTIMIZERS)} (flag --optim.name): optax's optimizer of that"
        " name, inside the same guards (train/core/optim.py); adafactor's --lr is relative"
        " to each weight's RMS, lion's 3-10x below adamw's",
    )
    weight_decay: float = ranged(
        0.1, ">=0", help="decoupled weight decay (AdamW's), whatever the optimizer"
    )
    decay_embeddings: bool = option(False, "weight decay on the embeddings too (norms never decay)")
    b1: float = ranged(
        0.9, "[0, 1)", help="decay of the gradient's running mean: the momentum (sgd: 0 = none)"
    )
    b2: float = ranged(
        0.95, "[0, 1)", help="decay of the squared gradient's running mean (lion: of the momentum)"
    )
    eps: float = ranged(
        1e-8, ">0", help="AdamW/Muon epsilon; > 0: all-zero gradients would divide 0 by 0"
    )
    grad_clip: float = ranged(1.0, ">=0", help="global-norm gradient clipping; 0 disables")
    offload_optimizer: bool = option(
        False,
        "keep the optimizer state in pinned host memory between steps; the"
        " step brings it to the device for the update and back (saves device"
        " memory, costs host-link traffic each step)",
    )
    seed: int = ranged(
        0,
        f"[0, {2**63 - 1}]",
        help="seed of the initial parameters, the data order and"
        " sampling; jax.random.key takes a signed 64-bit seed",
    )
    max_bad_steps: int = ranged(
        5,
        ">=0",
        help="skipped steps in a row (non-finite gradients or loss spikes) before"
        " reloading the last checkpoint; 0 = never",
    )
    spike_factor: float = ranged(
        0.0,
        ">=0",
        help="skip the update of a step whose loss exceeds this many times the"
        " median of the last 32 applied steps' losses (from 8 on); 0 = off,"
        " else >= 1",
    )
    step_timeout: float = ranged(
        900.0,
        ">=0",
        help="watchdog: seconds without progress (after the first compile)"
        " before exiting 4; 0 = off",
    )
    max_restarts: int = ranged(
        0, ">=0", help="supervisor: restart a crashed run up to N times from its last checkpoint"
    )
    elastic: bool = option(
        False,
        "with --max-restarts: when a process is lost, continue on the processes that remain"
        " (the mesh re-planned, the global batch kept) and grow back when it returns"
        " (train/run/elastic.py)",
    )
    elastic_wait: float = ranged(
        30.0,
        ">0",
        help="--train.elastic: seconds the processes that remain wait for the others to rejoin"
        " before they continue without them",
    )
    elastic_hardware: str = option(
        "",
        "--train.elastic: re-plan a smaller mesh with `plan --search` on this hardware profile"
        " (h100, h200, a100, tpu-v5p, cpu); empty = the --mesh axes shrunk on data, then fsdp",
    )
    skip_memory_check: bool = option(
        False,
        "skip the start-up check of the step's per-device memory against what the machine has",
    )
    eval_every: int = ranged(60, ">=0", help="steps between evaluations; 0 disables")
    eval_batches: int = ranged(
        4, ">=0", help="batches per evaluation; at least 1 while eval_every > 0"
    )
    sample_tokens: int = ranged(
        160, ">=0", help="tokens generated from --train.prompt at the end of training; 0 disables"
    )
    prompt: str = option("def ", "the text that sampling at the end of training continues")

    def validate(self) -> TrainConfig:
        check_ranges(self, functools.partial(public_flag, "train"))
        if self.batch_size % self.micro_batches:
            raise UserError(
                f"--batch-size {self.batch_size} is not divisible by --micro-batches"
                f" {self.micro_batches}; valid micro-batch counts:"
                f" {[m for m in range(1, self.batch_size + 1) if self.batch_size % m == 0]}"
            )
        if self.eval_every and not self.eval_batches:
            raise UserError(
                f"--train.eval_batches 0: must be >= 1 while --eval-every {self.eval_every}"
                " evaluates (--eval-every 0 turns evaluation off)"
            )
        if self.optimizer not in OPTIMIZERS:
            raise UserError(f"--optim.name '{self.optimizer}': valid: {', '.join(OPTIMIZERS)}")
        if self.elastic and not self.max_restarts:
            raise UserError(
                "--train.elastic true: needs the supervisor, which re-plans and restarts the"
                " processes; add --max-restarts N (N >= 1)"
            )
        if 0 < self.spike_factor < 1:
            raise UserError(
                f"--train.spike_factor {self.spike_factor}: must be 0 (off) or >= 1 (every loss"
                " above the running median would be a spike below 1)"
            )
        return self


VOCAB_PARALLEL = ("auto", "on", "off")
EXPERTS_OVER_FSDP = ("auto", "on", "off")  # mesh/expert_layout.py


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """The `parallelism` section: the device mesh, the rule-table overrides and the multi-process
    job."""

    mesh: str = option(
        "",
        "mesh axis sizes, e.g. data=2,fsdp=2,model=2 (one may be -1: the rest); empty = all"
        " devices on data",
    )
    mesh_dcn: str = option("", "the part of each axis that spans hosts/slices, e.g. data=4")
    rules: str = option(
        "", "logical-axis overrides of the rule table, e.g. embed=fsdp+model,vocab=none"
    )
    vocab_parallel: str = option(
        "auto",
        "auto | on | off: shard the embedding and LM head on the vocabulary over"
        " the FSDP axes and gather the head's input instead of its weights; auto:"
        " where that moves fewer bytes (fewer tokens per FSDP group than vocab)",
    )
    experts_over_fsdp: str = option(
        "auto",
        "auto | on | off: shard the MoE experts over the FSDP axes as well as"
        " expert (each device keeps whole experts and the tokens travel to them)"
        " instead of slicing every expert over FSDP and gathering its weights"
        " per layer; auto: where that moves fewer bytes and the devices divide"
        " n_experts",
    )
    context_strategy: str = option(
        "all_gather",
        "all_gather | ring: how attention reaches the keys of other"
        " sequence shards on the context axis: K/V gathered over it, or"
        " passed round a ring of collective-permutes, one block at a time",
    )
    sequence_parallel: bool = option(
        False,
        "split the residual stream's sequence over the model axis between"
        " blocks (Megatron sequence parallelism): each tensor-parallel"
        " all-reduce becomes a reduce-scatter + all-gather, and norms and"
        " residuals take 1/model of the memory",
    )
    coordinator: str = option("", "HOST:PORT of process 0 (multi-process); empty = auto-detect")
    num_processes: int = ranged(1, ">=1", help="processes in the job")
    process_id: int = ranged(0, ">=0", help="this process's rank; below num_processes")
    peer_timeout: float = ranged(
        45.0,
        ">0",
        help="seconds before a lost peer process is declared (heartbeats; CPU collectives)",
    )

    def validate(self) -> ParallelismConfig:
        check_ranges(self, functools.partial(public_flag, "parallelism"))
        if self.vocab_parallel not in VOCAB_PARALLEL:
            raise UserError(
                f"--parallelism.vocab_parallel '{self.vocab_parallel}': valid:"
                f" {', '.join(VOCAB_PARALLEL)}"
            )
        if self.experts_over_fsdp not in EXPERTS_OVER_FSDP:
            raise UserError(
                f"--parallelism.experts_over_fsdp '{self.experts_over_fsdp}': valid:"
                f" {', '.join(EXPERTS_OVER_FSDP)}"
            )
        if self.context_strategy not in CONTEXT_STRATEGIES:
            raise UserError(
                f"--parallelism.context_strategy '{self.context_strategy}': valid:"
                f" {', '.join(CONTEXT_STRATEGIES)}"
            )
        if self.process_id >= self.num_processes:
            raise UserError(
                f"--process-id {self.process_id}: must be in [0, {self.num_processes - 1}]"
                f" for --num-processes {self.num_processes}"
            )
        return self


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `data` section: where the tokens come from and how batches are made of them."""

    source: str = option(
        "default",
        "default (stdlib corpus) | synthetic | DIR (prepared: DIR/index.json) | PATH"
        " (text file/dir, byte tokens) | a mixture SRC:WEIGHT,SRC:WEIGHT (e.g."
        " dirA:0.7,dirB:0.3) | FILE.yaml (a list of {source, weight})",
    )
    eval_fraction: float = ranged(
        0.02,
        "[0, 1)",
        help="the share of documents held out for eval",
        why="the share of documents held out for eval; 1 would leave nothing to train on",
    )
    prefetch: int = ranged(2, ">=1", help="batches prepared ahead on a background thread")
    packing: bool = option(
        True, "documents end to end in seq_len windows; false: one document chunk per row, padded"
    )
    packing_mask: bool = option(
        False, "also segment_ids/positions so that attention stays inside a document"
    )
    verify: bool = option(
        True, "check every shard's sha256 against the prepared dataset's index at start"
    )
    allow_tokenizer_mismatch: bool = option(
        False,
        "use data prepared with another tokenizer than the one the"
        " --init-from (or evaluated) checkpoint records; refused"
        " otherwise: its token ids would mean other text",
    )
    eval_source: str = option(
        "",
        "[NAME=]DIR[,[NAME=]DIR ...]: prepared datasets also evaluated at every eval"
        " (--eval-every), each on its eval split (--data.eval_fraction) for"
        " --train.eval_batches batches, logged as eval/NAME/loss and eval/NAME/perplexity;"
        " NAME defaults to DIR's base name; empty = none",
    )

    def validate(self) -> DataConfig:
        check_ranges(self, functools.partial(public_flag, "data"))
        # the syntax here; the directories are opened (and checked) when a run starts
        if self.eval_source:
            from train.data.evalsets import parse_source

            parse_source(self.eval_source)
        return self
