"""What moved out of models.hf, kept for one release. The file reading and writing and the
conversion of checkpoints moved to checkpoint.hf_files and checkpoint.hf, config.json <->
ModelConfig to models.hf_config, and `python -m models.hf import|export` became `python -m
checkpoint hf import|export`. The old names still import from models.hf, with a
DeprecationWarning naming their new home; the old command fails in one line naming the new one
(exiting 0 having done nothing would hide that it moved)."""

from __future__ import annotations

import shlex
import sys
import warnings

MOVED = {  # name -> the module it lives in now
    **dict.fromkeys(
        (
            "from_pretrained",
            "save_pretrained",
            "import_checkpoint",
            "load_checkpoint",
            "config_from_meta",
        ),
        "checkpoint.hf",
    ),
    **dict.fromkeys(
        (
            "SAFETENSORS",
            "INDEX",
            "ST_DTYPES",
            "read_header",
            "load_params",
            "read_config",
            "hf_tensors",
        ),
        "checkpoint.hf_files",
    ),
    **dict.fromkeys(
        (
            "DTYPES",
            "ARCHITECTURES",
            "is_int",
            "is_number",
            "short_json",
            "check_config_types",
            "config_from_hf",
            "config_to_hf",
            "model_type_of",
        ),
        "models.hf_config",
    ),
}


def moved(name: str):
    """models.hf's module __getattr__: the moved `name` from its new module, with a warning. The
    import is here, run only when an old name is asked for: at module level, models/ importing
    checkpoint/ (which imports models/) would turn the layering upside down (tests/test_house.py
    lists this one exception)."""
    if name not in MOVED:
        raise AttributeError(f"module 'models.hf' has no attribute {name!r}")
    warnings.warn(
        f"models.hf.{name} moved to {MOVED[name]}.{name}; import it from there (the alias in"
        f" models.hf goes in the next release)",
        DeprecationWarning,
        stacklevel=3,  # the line that asked models.hf for the name
    )
    if MOVED[name] == "checkpoint.hf":
        from checkpoint import hf as new_home
    elif MOVED[name] == "checkpoint.hf_files":
        from checkpoint import hf_files as new_home
    else:
        from models import hf_config as new_home
    return getattr(new_home, name)


def moved_command(argv: list[str]) -> int:
    """`python -m models.hf ARGS`: one line naming the command it became; status 2."""
    args = shlex.join(argv) if argv else "import|export ..."
    print(
        f"error: python -m models.hf moved; the command is now: python -m checkpoint hf {args}",
        file=sys.stderr,
    )
    return 2
