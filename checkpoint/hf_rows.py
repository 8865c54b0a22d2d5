"""The rows of models/hf.py's tables applied to a model config: every HF tensor name of a row (its
template over the stacked layer and expert dims), the HF shape of one slice, and the plan of an
import, every tensor checked present with the shape config.json implies before any is read.
checkpoint/hf_files.py moves the tensors along the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import numpy as np

from errors import UserError
from models.config import ModelConfig
from models.hf import IGNORED_SUFFIXES, LAYOUTS, ROWS, Row, expected_shapes
from models.hf_config import short_json
from models.hf_numbering import hf_layer, row_dim, shared_copies, with_tail


def hf_names(
    template: str, shape: tuple[int, ...], layer: Callable[[int], int] | None = None
) -> Iterator[tuple[tuple[int, ...], str]]:
    """Every (index into the Brigade array's stacked dims, HF name) of a row: the template's
    placeholders, layer then expert, enumerate the leading dims of `shape`; `layer` maps the
    stack's index to HF's layer number (models.hf_numbering.hf_layer; default: the same)."""
    keys = [k for k in ("l", "e") if "{" + k + "}" in template]
    layer = layer or (lambda j: j)

    def name(idx):
        values = dict(zip(keys, idx))
        if "l" in values:
            values["l"] = layer(values["l"])
        return template.format(**values)

    return ((idx, name(idx)) for idx in _indices(shape[: len(keys)]))


def _indices(dims: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """np.ndindex, lazily: a config.json claiming a billion layers fails at the first missing tensor
    (np.ndindex and itertools.product first build every range)."""
    if not dims:
        yield ()
        return
    for i in range(dims[0]):
        for rest in _indices(dims[1:]):
            yield (i, *rest)


def rows_for(model_type: str, cfg: ModelConfig) -> list[Row]:
    """The rows of the table whose Brigade parameter the config's model has (tied embeddings have
    no lm_head_DV, a model without a query latent no wq_a_DQ ...), a layer pattern's tail rows
    included."""
    have = expected_shapes(cfg)
    return [r for r in with_tail(ROWS[model_type], cfg) if r.brigade in have]


def set_path(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def get_path(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def _hf_shape(row: Row, shape: tuple[int, ...], head_dim: int) -> tuple[int, ...]:
    """The HF tensor shape of one slice of a Brigade array of `shape` (traced: nothing
    allocated)."""
    import jax

    stacked = sum("{" + k + "}" in row.hf for k in ("l", "e"))
    piece = jax.ShapeDtypeStruct(shape[stacked:], np.int8)
    return tuple(jax.eval_shape(lambda w: LAYOUTS[row.layout].to_hf(w, head_dim), piece).shape)


def plan_rows(
    source: str, shapes: Mapping[str, tuple[int, ...]], model_type: str, cfg: ModelConfig
) -> list[tuple[Row, tuple, list]]:
    """Every row with its Brigade shape and (index, HF name) pairs, each tensor checked present with
    the shape config.json implies from the tensor shapes alone (a file's header): nothing is
    allocated before the source is known to hold it."""
    want = expected_shapes(cfg)
    uncovered = sorted(set(want) - {r.brigade for r in rows_for(model_type, cfg)})
    if uncovered:  # a parameter the table does not fill would be left uninitialised
        raise UserError(
            f"the {model_type} conversion has no HF tensor for Brigade parameters"
            f" {', '.join(uncovered)}"
        )
    plan, used = [], set()
    for row in rows_for(model_type, cfg):
        shape = want[row.brigade]
        hf_shape, names = _hf_shape(row, shape, row_dim(row, cfg)), []
        for idx, name in hf_names(row.hf, shape, hf_layer(cfg, row)):
            if name not in shapes:
                raise UserError(f"'{source}': tensor {name} is missing (needed for {row.brigade})")
            if shapes[name] != hf_shape:
                raise UserError(
                    f"'{source}': tensor {name} has shape {shapes[name]},"
                    f" config.json implies {hf_shape}"
                )
            names.append((idx, name))
        used.update(name for _, name in names)
        plan.append((row, shape, names))
    copies = shared_copies(model_type, cfg)
    extra = sorted(
        n
        for n in shapes
        if n not in used
        and n not in copies
        and not n.endswith(IGNORED_SUFFIXES)
        and not (cfg.tie_embeddings and n == "lm_head.weight")
    )
    if extra:
        raise UserError(
            f"'{source}': {len(extra)} tensors this {model_type} conversion does not know: "
            + ", ".join(map(short_json, extra[:5]))
            + (" ..." if len(extra) > 5 else "")
        )
    return plan
