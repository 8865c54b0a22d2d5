"""A HuggingFace checkpoint directory on disk: config.json plus safetensors (one file, or shards and
an index), read and written without torch or transformers; its tensors <-> Brigade params by the
rows of models/hf.py's tables (`params_from_hf`, `hf_tensors`).

Every file is untrusted input: a safetensors header is checked against its file, and an index's
shard names against its directory, before a byte of tensor data is read; tensors are then read one
by one through safetensors' numpy API. Pickled `pytorch_model.bin` files are never loaded.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping

import numpy as np

from checkpoint import finite
from checkpoint.hf_rows import get_path, hf_names, plan_rows, rows_for, set_path
from errors import UserError
from models.config import ModelConfig
from models.hf import LAYOUTS, Model
from models.hf_config import is_int, short_json
from models.hf_numbering import hf_layer, row_dim, shared_copies

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"


def _safetensors():
    try:
        import safetensors.numpy

        return safetensors
    except ImportError:
        raise UserError(
            "the HuggingFace converter (checkpoint.hf) needs the safetensors package:"
            " pip install 'brigade[hf]'"
        ) from None


# Bytes per element of the safetensors dtypes this converter reads (all floating point).
ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's length


def read_json(file: str):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise UserError(f"{file}: not valid JSON ({e})") from None
    except OSError as e:
        raise UserError(f"{file}: cannot be read ({e.strerror or e})") from None


def read_header(file: str) -> dict[str, dict]:
    """A safetensors file's header {tensor: {dtype, shape, data_offsets}}, checked against the file
    before a byte of tensor data is read: what it claims must lie within the file, tightly
    packed."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
        if not 0 < n <= min(size - 8, _MAX_HEADER):
            raise UserError(
                f"{file}: not a safetensors file (its 8-byte header length says {n},"
                f" the file has {size} bytes)"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise UserError(f"{file}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise UserError(
            f"{file}: the safetensors header is not a JSON object of tensors"
            f" (got {short_json(header)})"
        )
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise UserError(
            f"{file}: the safetensors __metadata__ must be an object of strings,"
            f" got {short_json(meta)}"
        )
    data, spans = size - 8 - n, []
    for name, entry in header.items():
        spans.append((*_check_entry(f"{file}: tensor {short_json(name)}", entry, data), name))
    end = 0
    for start, stop, name in sorted(spans):
        if start != end:
            raise UserError(
                f"{file}: tensor {short_json(name)} starts at data byte {start}, expected {end}"
                f" (tensors must be packed without gaps or overlaps)"
            )
        end = stop
    if end != data:
        raise UserError(
            f"{file}: its tensors end at data byte {end} but the file holds {data} data bytes"
        )
    return header


def _check_entry(where: str, entry, data_bytes: int) -> tuple[int, int]:
    """One header entry's (start, stop) data offsets, after checking its dtype, shape and extent."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise UserError(
            f"{where}: expected {{dtype, shape, data_offsets}}, got {short_json(entry)}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in ST_DTYPES:
        raise UserError(
            f"{where}: dtype {short_json(dtype)} is not supported"
            f" (supported: {', '.join(ST_DTYPES)})"
        )
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise UserError(
            f"{where}: shape {short_json(shape)} is not a list of non-negative integers"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise UserError(
            f"{where}: data_offsets {short_json(offsets)} do not lie within the file's {data_bytes}"
            f" data bytes"
        )
    if offsets[1] - offsets[0] != math.prod(shape) * ST_DTYPES[dtype]:
        raise UserError(
            f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but {dtype}"
            f" {tuple(shape)} needs {math.prod(shape) * ST_DTYPES[dtype]}"
        )
    return offsets[0], offsets[1]


def _read_index(path: str) -> dict[str, str] | None:
    """The index's weight_map {tensor: shard file}, every shard a file inside `path`; None when the
    directory holds one model.safetensors instead."""
    index = os.path.join(path, INDEX)
    if not os.path.isfile(index):
        if os.path.isfile(os.path.join(path, SAFETENSORS)):
            return None
        found = ", ".join(sorted(os.listdir(path))) or "nothing"
        raise UserError(
            f"'{path}' has neither {SAFETENSORS} nor {INDEX} (found: {found}); pickled"
            f" pytorch_model.bin checkpoints are not read: re-save them with safetensors"
        )
    doc = read_json(index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise UserError(
            f'{index}: expected {{"weight_map": {{tensor: shard file, ...}}}},'
            f" got {short_json(doc)}"
        )
    for tensor, shard in weight_map.items():
        # the index names files to open: it may not point outside the directory it describes
        if not shard or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise UserError(
                f"{index}: weight_map[{short_json(tensor)}] = {short_json(shard)} is outside the"
                f" checkpoint directory (shard files are named relative to it, without '..')"
            )
        if not os.path.isfile(os.path.join(path, shard)):
            raise UserError(
                f"{index}: lists shard {short_json(shard)} (for {short_json(tensor)}),"
                f" which does not exist"
            )
    return weight_map


class HFTensors:
    """Lazy access to the safetensors of an HF directory (one file, or shards listed by an index);
    every file's header is checked first, so names and shapes are known before any data is read."""

    def __init__(self, path: str):
        self.path = path
        weight_map = _read_index(path)
        files = sorted(set(weight_map.values())) if weight_map is not None else [SAFETENSORS]
        headers = {name: read_header(os.path.join(path, name)) for name in files}
        if weight_map is None:
            weight_map = dict.fromkeys(headers[SAFETENSORS], SAFETENSORS)
        for tensor, name in weight_map.items():
            if tensor not in headers[name]:
                raise UserError(
                    f"{os.path.join(path, INDEX)}: lists {short_json(tensor)}"
                    f" in {short_json(name)}, which does not hold it"
                )
        self.file_of, self._open = weight_map, {}
        self.shapes = {
            tensor: tuple(headers[name][tensor]["shape"]) for tensor, name in weight_map.items()
        }

    def get(self, name: str) -> np.ndarray:
        file = self.file_of[name]
        safetensors = _safetensors()
        try:  # the header was checked; this guards only against a file changed since
            if file not in self._open:
                self._open[file] = safetensors.safe_open(
                    os.path.join(self.path, file), framework="numpy"
                )
            return self._open[file].get_tensor(name)
        except safetensors.SafetensorError as e:
            raise UserError(f"{os.path.join(self.path, file)}: {name}: {e}") from None


def read_config(path: str) -> dict:
    """The parsed config.json of the HF directory `path` (its keys' types are checked by
    config_from_hf)."""
    file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise UserError(f"'{path}': no such HuggingFace checkpoint directory")
    if not os.path.exists(file):
        raise UserError(
            f"'{path}' has no config.json (expected a HuggingFace checkpoint directory)"
        )
    return read_json(file)  # its types are checked by config_from_hf


# -- HF tensors <-> params: along the rows (checkpoint/hf_rows.py) ------------------------------
def params_from_hf(
    source: str,
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
    model_type: str,
    cfg: ModelConfig,
    allow_nonfinite: bool = False,
) -> dict:
    """HF tensors -> Brigade params (numpy, cfg.param_dtype), checking every name and shape first.
    `shapes`: every tensor `source` holds, {HF name: shape}; `read(name)` its data, called only
    after all names and shapes passed (`source` names it in errors, e.g. the HF directory). A tensor
    holding NaN or infinity (after the cast: a float32 beyond bfloat16's range becomes one) is
    refused naming it, unless `allow_nonfinite` (checkpoint/finite.py)."""
    dtype = np.dtype(_np_dtype(cfg.param_dtype))
    params = {}
    for row, shape, names in plan_rows(source, shapes, model_type, cfg):
        out = np.empty(shape, dtype)
        for idx, name in names:
            piece = LAYOUTS[row.layout].to_brigade(read(name), row_dim(row, cfg)).astype(dtype)
            finite.check_host(source, name, piece, allow_nonfinite)
            out[idx] = piece
        set_path(params, row.brigade, out)
    return params


def _np_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)  # bfloat16 via ml_dtypes


def hf_tensors(model: Model, dtype: str | None = None) -> dict[str, np.ndarray]:
    """Brigade params -> {HF name: array} (host memory)."""
    import jax

    cfg = model.cfg
    dt = np.dtype(_np_dtype(dtype or cfg.param_dtype))
    out = {}
    for row in rows_for(model.model_type, cfg):
        arr = np.asarray(jax.device_get(get_path(model.params, row.brigade)))
        for idx, name in hf_names(row.hf, arr.shape, hf_layer(cfg, row)):
            out[name] = np.ascontiguousarray(
                LAYOUTS[row.layout].to_hf(arr[idx], row_dim(row, cfg)).astype(dt)
            )
    for copy, original in shared_copies(model.model_type, cfg).items():
        out[copy] = out[original]
    return out


def load_params(
    path: str, model_type: str, cfg: ModelConfig, allow_nonfinite: bool = False
) -> dict:
    """The HF directory's tensors -> Brigade params (numpy, cfg.param_dtype), every name and shape
    checked against the file headers first, every value for finiteness as it is read."""
    tensors = HFTensors(path)
    return params_from_hf(path, tensors.shapes, tensors.get, model_type, cfg, allow_nonfinite)


def write_files(
    folder: str, config: dict, tensors: dict[str, np.ndarray], max_shard_bytes: int
) -> None:
    """config.json and the tensors into `folder`: one model.safetensors, or shards of at most
    `max_shard_bytes` (a tensor larger than that alone in its shard) and their index."""
    save_file = _safetensors().numpy.save_file
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shards, size = [{}], 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    meta = {"format": "pt"}  # transformers refuses safetensors without it
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, SAFETENSORS), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata=meta)
        weight_map.update({k: name for k in shard})
    with open(os.path.join(folder, INDEX), "w") as f:
        json.dump(
            {
                "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                "weight_map": weight_map,
            },
            f,
            indent=2,
        )
