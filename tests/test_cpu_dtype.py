"""`--model.dtype auto` on CPU (models/cpu_dtype.py): the rule on faked facts, the detection of
the facts, and what the config and the start line make of them."""

import dataclasses
import warnings

import jax
import pytest

from mesh.build import make_mesh
from models import cpu_dtype
from models import model as model_lib
from models.presets import PRESETS

AVX512_BF16 = frozenset({"fpu", "avx512f", "avx512_bf16"})


@pytest.mark.parametrize(
    "flags, keeps, want",
    [
        (AVX512_BF16, True, "bfloat16"),
        (frozenset({"amx_bf16", "amx_tile"}), True, "bfloat16"),
        (frozenset({"fp", "asimd", "bf16"}), True, "bfloat16"),  # Arm
        (AVX512_BF16, False, "float32"),  # an XLA:CPU that upcasts bf16 matmuls
        (frozenset({"fpu", "avx2", "avx512f"}), True, "float32"),  # no bf16 instructions
        (frozenset(), True, "float32"),  # flags unknown
    ],
)
def test_the_rule(flags, keeps, want):
    dtype, why = cpu_dtype.choose(flags, keeps)
    assert dtype == want and why.startswith("auto: ")


def test_flags_are_read_from_cpuinfo(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nflags\t\t: fpu sse avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_dtype.cpu_flags(str(path)) == {"fpu", "sse", "avx512_bf16"}
    assert cpu_dtype.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_the_probe_reads_this_jaxlib():
    """Whatever this jaxlib does, the probe answers it, through no deprecated jax argument (one
    that a later jax drops would break `auto` on every CPU), and the same inside a jit trace under
    a mesh of 8 devices, where a model is first built."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        alone = cpu_dtype.xla_keeps_bf16_dots()
        assert isinstance(alone, bool)
        seen = []
        with jax.set_mesh(make_mesh("data=8")):
            jax.jit(lambda x: (seen.append(cpu_dtype.xla_keeps_bf16_dots()), x)[1])(1.0)
        assert seen == [alone]


@pytest.mark.parametrize("keeps, want", [(True, "bfloat16"), (False, "float32")])
def test_auto_follows_the_detection_on_cpu_only(monkeypatch, keeps, want):
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: AVX512_BF16)
    monkeypatch.setattr(cpu_dtype, "xla_keeps_bf16_dots", lambda: keeps)
    cpu_dtype.auto.cache_clear()
    try:
        cfg = PRESETS["tiny"]
        assert cfg.compute_dtype("cpu") == want
        assert cfg.compute_dtype("gpu") == "bfloat16"
        assert dataclasses.replace(cfg, dtype="float32").compute_dtype("cpu") == "float32"
        text = model_lib.compute_dtype_text(cfg)
        assert text.startswith(f"{want} compute (auto: ")
        assert model_lib.compute_dtype_text(dataclasses.replace(cfg, dtype="float32")) == (
            "float32 compute"
        )
    finally:
        cpu_dtype.auto.cache_clear()
