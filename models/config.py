"""ModelConfig and the named presets (Llama shapes)."""
from __future__ import annotations

import dataclasses

from mesh.errors import UserError

REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 264          # 256 bytes + specials, padded to a multiple of 8 (shards on model<=8)
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 768
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "auto"            # compute dtype; auto = bfloat16 on GPU/TPU, float32 on CPU (measured faster there)
    param_dtype: str = "float32"   # parameters and optimizer state
    remat: str = "full"            # none | full | dots (save matmul outputs, recompute the rest)
    scan_layers: bool = True       # lax.scan over the layer stack: compile time independent of depth
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self) -> "ModelConfig":
        def need(ok: bool, msg: str):
            if not ok:
                raise UserError(f"model: {msg}")
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            need(getattr(self, f) > 0, f"{f} must be positive, got {getattr(self, f)}")
        need(self.d_model % self.n_heads == 0, f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        need(self.head_dim % 2 == 0, f"head_dim=d_model/n_heads={self.head_dim} must be even for rotary embeddings")
        need(self.n_heads % self.n_kv_heads == 0,
             f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads} (grouped-query attention);"
             f" valid n_kv_heads: {[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]}")
        need(self.remat in REMAT_POLICIES, f"remat '{self.remat}' is not one of {', '.join(REMAT_POLICIES)}")
        need(self.dtype in DTYPES, f"dtype '{self.dtype}' is not one of {', '.join(DTYPES)}")
        need(self.param_dtype in DTYPES[1:], f"param_dtype '{self.param_dtype}' is not one of {', '.join(DTYPES[1:])}")
        return self

    def compute_dtype(self, platform: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if platform == "cpu" else "bfloat16"


def _llama(vocab, d, layers, heads, kv, ff, seq, theta=500000.0) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv, d_ff=ff,
                       max_seq_len=seq, rope_theta=theta, dtype="auto")


PRESETS: dict[str, ModelConfig] = {
    # tests: small enough that a step compiles in about a second on CPU
    "tiny": ModelConfig(vocab_size=264, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=256),
    # CPU demo: 3.3M parameters, byte-level vocabulary; activations of this size fit easily, so no remat
    "default": ModelConfig(remat="none"),
    # Llama shapes (https://arxiv.org/abs/2302.13971, Llama 2/3 GQA)
    "125m": _llama(32000, 768, 12, 12, 12, 2048, 2048, theta=10000.0),
    "1b": _llama(128256, 2048, 16, 32, 8, 8192, 4096),
    "7b": _llama(32000, 4096, 32, 32, 32, 11008, 4096, theta=10000.0),
    "70b": _llama(128256, 8192, 80, 64, 8, 28672, 4096),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise UserError(f"--model: unknown preset '{name}'; valid presets: {', '.join(PRESETS)}")
    return PRESETS[name]
