"""`python -m checkpoint inspect PATH [--json]`,
`python -m checkpoint export PATH --params-only OUT` and `python -m checkpoint hf import|export`
(HuggingFace <-> Brigade, checkpoint/hf.py).

PATH is one step's directory (`runs/x/checkpoints/40`), a checkpoint directory (its latest step),
a run directory (its `checkpoints/`) or a --checkpoint.local_dir (its first process's copy).
`inspect` reads only metadata, never the arrays. `export` reads only the parameters (into host
memory, no device needed) and writes them as a checkpoint of the same layout,
`OUT/<step>/{state/, meta/}`, whose state is `{"params": ...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from checkpoint import hf
from checkpoint.layout import FORMAT_VERSION, PARAMS_ONLY, is_params_only
from errors import ArgParser, UserError, one_line_errors


def _parser() -> argparse.ArgumentParser:
    p = ArgParser(
        prog="python -m checkpoint",
        description="Inspect or export Brigade checkpoints, or convert them"
        " to and from HuggingFace.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=ArgParser)
    i = sub.add_parser(
        "inspect", help="step, config, mesh and every array (name, shape, dtype, size)"
    )
    i.add_argument(
        "path", metavar="PATH", help="a step directory, a checkpoint directory or a run directory"
    )
    i.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    e = sub.add_parser("export", help="write a parameters-only checkpoint (inference, conversion)")
    e.add_argument(
        "path", metavar="PATH", help="a step directory, a checkpoint directory or a run directory"
    )
    e.add_argument("out", metavar="OUT", help="new directory for the exported checkpoint")
    e.add_argument(
        "--params-only",
        action="store_true",
        help="export the parameters only (required: the only mode)",
    )
    hf.add_commands(sub)
    return p


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def describe(path: str) -> dict:
    """What `inspect` prints, as a dict (`path` as open_checkpoint takes it)."""
    from checkpoint.manager import open_checkpoint

    ck, step = open_checkpoint(path)
    meta = ck.meta(step)
    arrays = [
        {
            "name": n,
            "shape": list(shape),
            "dtype": str(dt),
            "bytes": int(dt.itemsize) * _prod(shape),
        }
        for n, shape, dt in ck.arrays(step)
    ]
    return {
        "path": ck.step_dir(step),
        "step": step,
        "steps_in_dir": ck.all_steps(),
        "meta": meta,
        "arrays": arrays,
    }


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def inspect_text(info: dict) -> str:
    from mesh.spec import mesh_text

    meta, arrays = info["meta"], info["arrays"]
    data = meta.get("data", {})
    lines = [
        f"checkpoint {info['path']}",
        f"step: {info['step']}"
        f" (steps in this directory: {', '.join(map(str, info['steps_in_dir']))})"
        + ("; parameters only" if is_params_only(meta) else ""),
        f"mesh: {mesh_text(meta.get('mesh', {}))} ({meta.get('devices', '?')} devices,"
        f" {meta.get('processes', '?')} process{'' if meta.get('processes') == 1 else 'es'})",
        f"data: next step {data.get('next_step', '?')}, seed {data.get('seed', '?')},"
        f" source {data.get('source', '?')}",
        *(
            [
                f"local tier: process {meta['local']['process']}'s own copy"
                " (the shards it held of the mesh above; restores only onto that layout)"
            ]
            if "local" in meta
            else []
        ),
        f"saved: {meta.get('saved_at', '?')} with "
        + ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items()),
        "config:",
    ]
    for section, values in meta.get("config", {}).items():
        fields = (
            " ".join(f"{k}={v}" for k, v in values.items()) if isinstance(values, dict) else values
        )
        lines.append(f"  {section}: {fields}")
    total = sum(a["bytes"] for a in arrays)
    lines.append(f"arrays: {len(arrays)}, {_size(total)}")
    w = max((len(a["name"]) for a in arrays), default=4)
    lines.append(f"  {'name':<{w}}  {'shape':<18} {'dtype':<9} size")
    for a in arrays:
        lines.append(
            f"  {a['name']:<{w}}  {str(tuple(a['shape'])):<18} {a['dtype']:<9} {_size(a['bytes'])}"
        )
    return "\n".join(lines)


def export_params(path: str, out: str) -> str:
    from checkpoint.manager import Checkpointer, open_checkpoint
    from errors import UserError

    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UserError(
            f"export: '{out}' already exists and is not empty; choose a new OUT directory"
        )
    ck, step = open_checkpoint(path)
    params = ck.restore_params_to_host(step)
    saved = {
        k: v for k, v in ck.meta(step).items() if k != "local"
    }  # an export is no local-tier copy
    meta = {
        **saved,
        "format": FORMAT_VERSION,
        "contents": PARAMS_ONLY,
        "exported_from": ck.step_dir(step),
    }
    dst = Checkpointer(out, keep=0, async_save=False)
    dst.save(step, {"params": params}, meta)
    dst.close()
    return dst.step_dir(step)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)  # Orbax's info/warnings are noise for a CLI
    if args.command == "inspect":
        info = describe(args.path)
        print(json.dumps(info, indent=2) if args.json else inspect_text(info))
    elif args.command == "hf":
        hf.run(args)
    else:
        if not args.params_only:
            raise UserError(
                "export: pass --params-only (parameters-only export is the only mode so far)"
            )
        print(f"exported the parameters of {args.path} to {export_params(args.path, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
