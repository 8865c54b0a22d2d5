"""HuggingFace conversion speed: save_pretrained, from_pretrained, import to a Brigade checkpoint,
export back, and transformers loading the export; the largest logit difference on the way.

    python benchmarks/hf.py [--preset 125m] [--dir /tmp/brigade_hf_bench]

It needs torch and transformers.
"""

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from checkpoint import hf
from models import model
from models.hf import Model
from models.presets import preset


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(getattr(out, "params", None))
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "brigade_hf_bench"))
    args = ap.parse_args()
    out = args.dir
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cfg = dataclasses.replace(preset(args.preset), dtype="float32", param_dtype="float32")
    params = jax.jit(lambda k: model.init(cfg, k))(jax.random.key(0))
    n = sum(x.size for x in jax.tree.leaves(params))
    _, t_save = timed(lambda: hf.save_pretrained(Model(cfg, params), f"{out}/hf"))
    loaded, t_load = timed(lambda: hf.from_pretrained(f"{out}/hf"))
    _, t_import = timed(lambda: hf.import_checkpoint(f"{out}/hf", f"{out}/ck"))
    _, t_export = timed(lambda: hf.save_pretrained(hf.load_checkpoint(f"{out}/ck"), f"{out}/hf2"))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 32)).astype(np.int32)
    ours = np.asarray(loaded(tokens))
    import torch
    import transformers

    theirs, t_hf = timed(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(f"{out}/hf2").eval()
    )
    with torch.no_grad():
        ref = theirs(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    size = sum(os.path.getsize(os.path.join(out, "hf", f)) for f in os.listdir(f"{out}/hf"))
    print(
        f"{n / 1e6:.1f}M params, {size / 2**20:.0f} MiB safetensors: save_pretrained {t_save:.1f}s,"
        f" from_pretrained {t_load:.1f}s, import {t_import:.1f}s, export {t_export:.1f}s,"
        f" transformers loads the export {t_hf:.1f}s;"
        f" max |logit diff| vs transformers {np.abs(ours - ref).max():.2e}"
    )
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
