"""Data pipeline throughput: `prepare` (MB/s of input text) and the loader (tokens/s, one
process) next to what the default training run consumes.

    python benchmarks/data.py [--mb 16] [--train-steps 20]

1. prepare: the first --mb MB of this interpreter's stdlib .py files, byte tokenizer and a 4k-token
   HuggingFace BPE (trained here on 2 MB of the same text), --workers 1 and 2.
2. loader: batches of the default run's shape (16 x 128) and a long-context shape (8 x 2048) from
   the prepared dataset: host rows (numpy, what each process builds), and placed on 8 fake devices
   (make_array_from_callback), against Grain's MapDataset doing the same index mapping
   (range -> shuffle -> repeat, same numpy gather) through to_iter_dataset with 2 read threads.
3. with --train-steps N: the default model's train step fed by the pipeline's prefetch thread,
   reporting data_wait_s as a share of the step time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import numpy as np

# BENCHMARKS.md, the default run (`python -m train`): 16 x 128 tokens per 0.84 s step
TRAIN_TOKENS_PER_S = 2428


def stdlib_sample(directory: str, mb: int) -> list[str]:
    """Copies of stdlib .py files (sorted) up to `mb` MB, so the input is real code, not one
    repeated file."""
    root, files, total = sysconfig.get_paths()["stdlib"], [], 0
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("site-packages", "__pycache__", "test")
        )
        for n in sorted(names):
            if n.endswith(".py") and total < mb << 20:
                src = os.path.join(dirpath, n)
                dst = os.path.join(directory, f"{len(files):06d}.py")
                shutil.copyfile(src, dst)
                files.append(dst)
                total += os.path.getsize(dst)
    return files


def train_bpe(path: str, files: list[str]) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts, size = [], 0
    for f in files:
        if size > 2 << 20:
            break
        texts.append(open(f, encoding="utf-8", errors="replace").read())
        size += len(texts[-1])
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=4096,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok.save(path)
    return path


def hf_alone(path: str, files: list[str]) -> float:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    texts = [open(f, encoding="utf-8").read() for f in files[:200]]
    t0 = time.perf_counter()
    tok.encode_batch(texts, add_special_tokens=False)
    return sum(len(t.encode()) for t in texts) / (time.perf_counter() - t0) / 1e6


def bench_prepare(work: str, files: list[str], tokenizer: str, workers: int) -> tuple[float, int]:
    from train.data.prepare import prepare

    out = os.path.join(work, f"ds-{os.path.basename(tokenizer)}-{workers}")
    t0 = time.perf_counter()
    index = prepare(files, out, tokenizer, workers=workers, progress=False)
    dt = time.perf_counter() - t0
    return index["input_bytes"] / dt / 1e6, index["n_tokens"]


def rate(fn, tokens_per_call: int, min_s: float = 2.0) -> float:
    fn(0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn(n + 1)
        n += 1
    return n * tokens_per_call / (time.perf_counter() - t0)


def grain_rate(pipe, B: int, min_s: float = 2.0) -> float:
    """The same windows through Grain: MapDataset.range(n).shuffle(seed).repeat() -> gather ->
    batch."""
    import grain

    win = pipe.train[0]
    ds = (
        grain.MapDataset.range(win.n)
        .shuffle(seed=0)
        .repeat()
        .map(lambda w: win.rows(np.array([w]), False)["inputs"][0])
        .batch(B, drop_remainder=True)
    )
    it = iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)))
    next(it)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        next(it)
        n += 1
    return n * B * pipe.T / (time.perf_counter() - t0)


def prepare_table(work: str, mb: int) -> None:
    """`prepare`'s throughput over a sample of the standard library's sources, byte and BPE
    tokenizers, 1 and 2 workers (the byte run with 2 workers is what `loader_table` reads)."""
    os.makedirs(os.path.join(work, "txt"))
    files = stdlib_sample(os.path.join(work, "txt"), mb)
    bpe = train_bpe(os.path.join(work, "bpe.json"), files)
    print(
        f"prepare: {len(files)} files, {sum(map(os.path.getsize, files)) / 1e6:.1f} MB,"
        f" {os.cpu_count()} cores"
    )
    print("| tokenizer | workers | MB/s | tokens |\n|---|---|---|---|")
    for tok, label in (("byte", "byte"), (bpe, "HF BPE 4k")):
        for workers in (1, 2):
            mbs, n = bench_prepare(work, files, tok, workers)
            print(f"| {label} | {workers} | {mbs:.1f} | {n / 1e6:.1f}M |")
    print(
        "| HF BPE 4k, the library alone (`encode_batch`, all threads, no I/O) | -"
        f" | {hf_alone(bpe, files):.1f} | |"
    )


def loader_rows(pipe, tag: str, B: int, T: int, mask: bool) -> None:
    """One pipeline's rates: host rows, on the 8 devices, and (unmasked) Grain's."""
    import jax

    r = rate(pipe.global_batch, B * T)
    print(f"| {tag} | host rows (numpy) | {r / 1e6:.2f}M | {r / TRAIN_TOKENS_PER_S:,.0f} |")
    # rate() calls it before the loop moves on; the default binds this pipeline
    r = rate(lambda s, pipe=pipe: jax.block_until_ready(pipe.device_batch(s)), B * T)
    print(f"| {tag} | on 8 devices | {r / 1e6:.2f}M | {r / TRAIN_TOKENS_PER_S:,.0f} |")
    if not mask:
        r = grain_rate(pipe, B)
        print(
            f"| {tag} | Grain MapDataset, 2 threads | {r / 1e6:.2f}M"
            f" | {r / TRAIN_TOKENS_PER_S:,.0f} |"
        )


def loader_table(work: str) -> None:
    """The loader's tokens/s on the prepared byte dataset against what the default run
    consumes."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mesh.build import make_mesh
    from train.core.config import DataConfig
    from train.data.pipeline import make_pipeline

    data = os.path.join(work, "ds-byte-2")
    mesh = make_mesh("data=8")
    sharding = NamedSharding(mesh, P(("data", "fsdp", "expert"), None))
    print(
        f"\nloader (1 process, {jax.device_count()} fake devices); the default run consumes"
        f" {TRAIN_TOKENS_PER_S} tokens/s"
    )
    print("| batch | variant | tokens/s | x training |\n|---|---|---|---|")
    for B, T in ((16, 128), (8, 2048)):
        for mask in (False, True):
            pipe = make_pipeline(
                DataConfig(source=data, packing_mask=mask),
                batch_size=B,
                seq_len=T,
                seed=0,
                batch_sharding=sharding,
            )
            loader_rows(pipe, f"{B}x{T}" + (" +mask" if mask else ""), B, T, mask)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=16, help="MB of input text for prepare")
    ap.add_argument(
        "--train-steps", type=int, default=0, help="also run the default model this many steps"
    )
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="brigade-data-bench-")
    try:
        prepare_table(work, args.mb)
        loader_table(work)
        if args.train_steps:
            train_wait(args.train_steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def train_wait(steps: int) -> None:
    """The default run's model and shapes on 1 device, fed by the pipeline's prefetch thread."""
    import jax

    from train.core.config import build
    from train.core.setup import compile_step, create_state
    from train.data.pipeline import make_pipeline
    from train.run.loop import Trainer

    cfg = build({"train.steps": steps, "logging.progress": False})
    tr = Trainer(cfg, devices=jax.devices()[:1])
    t = cfg.train
    pipe = make_pipeline(
        cfg.data,
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        seed=t.seed,
        batch_sharding=tr.setup.batch_sharding,
        vocab_size=tr.setup.model_cfg.vocab_size,
    )
    state = create_state(tr.setup)
    batch, _ = pipe.next()
    step_fn = compile_step(tr.setup, state, batch)
    waits = []
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
        batch, waited = pipe.next()
        waits.append(waited)
    dt = (time.perf_counter() - t0) / steps
    pipe.close()
    print(
        f"\ndefault model, {steps} steps of {t.batch_size}x{t.seq_len} on 1 device:"
        f" {dt:.3f} s/step, data_wait_s {np.mean(waits) * 1e3:.2f} ms/step"
        f" = {100 * np.mean(waits) / dt:.3f}% of the step"
    )


if __name__ == "__main__":
    sys.exit(main())
