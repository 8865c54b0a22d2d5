"""Which storage Orbax can keep checkpoint arrays on.

Brigade's own files (the run directory's records, a step's `meta` JSON, prepared datasets) go
through checkpoint/storage.py and so reach any fsspec scheme. A checkpoint's arrays do not:
Orbax hands them to tensorstore, building the tensorstore path itself, and orbax-checkpoint
0.12.8 maps only local paths and `gs://` (tensorstore's gcs driver) there. An `s3://` (or
`az://`, `hf://`) directory becomes the path `s3:/bucket/...`, which Orbax refuses ("Checkpoint
path should be absolute") after it has already written part of the step to a local directory
named `s3:` under the working directory, at the first save, hours into a run. tensorstore's own
s3 driver works (it is what an Orbax that maps s3:// would use); Orbax does not use it.

`check_array_store` asks Orbax itself (the function that builds that path) rather than a list
of schemes, so an Orbax that learns a scheme is let through without a change here.
"""

from __future__ import annotations

import importlib.metadata

from checkpoint import storage
from errors import UserError


def check_array_store(directory: str, flag: str = "--checkpoint.dir") -> None:
    """UserError (one line, naming `flag`) when Orbax cannot keep checkpoint arrays in
    `directory`; a local path always passes, and so does any URL when the probe itself is not
    there (another Orbax: its first save then tells)."""
    if storage.is_local(directory):
        return
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils
    except ImportError:
        return
    try:
        tensorstore_utils.build_kvstore_tspec(storage.join(directory, "0"), use_ocdbt=True)
    except ValueError as e:
        scheme = directory.split("://", 1)[0]
        raise UserError(
            f"{flag} {directory}: orbax-checkpoint {_version()} cannot keep checkpoint arrays on"
            f" {scheme}:// (its tensorstore path for it is refused: {e}); put the checkpoints on a"
            f" local path, a mounted bucket or gs:// with --checkpoint.dir (the run directory"
            f" itself may stay on {scheme}://)"
        ) from None
    except Exception:  # noqa: BLE001  (a probe that fails otherwise proves nothing)
        return


def _version() -> str:
    try:
        return importlib.metadata.version("orbax-checkpoint")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"
