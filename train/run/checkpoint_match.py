"""Whether a checkpoint fits what a run brings to it: the tokenizer its token ids mean (against the
data's, for --init-from, eval sets and `eval`) and the settings that changed since it was saved
(one warning line on resume)."""

from __future__ import annotations

import os

from checkpoint import storage
from checkpoint.layout import tokenizer_record
from checkpoint.manager import open_checkpoint
from errors import UserError
from train.core.setup import RunSetup
from train.data.index import INDEX, read_index
from train.data.sources import REPREPARE, parse_mixture
from train.run.named_runs import changed_settings


def saved_tokenizer(meta: dict) -> dict | None:
    """The tokenizer record of a checkpoint (checkpoint.layout.tokenizer_record); for one that
    predates the record, that of the data its config names: the prepared dataset's index (the
    first source: a mixture shares one tokenizer) while it still exists, the byte-level record for
    the stdlib, synthetic and text sources; None when nothing tells (an older HF import)."""
    record = tokenizer_record(meta)
    data = meta.get("config", {}).get("data") if isinstance(meta.get("config"), dict) else None
    if record or not isinstance(data, dict) or not isinstance(data.get("source"), str):
        return record
    try:
        first = parse_mixture(data["source"])[0][0]
        if storage.isfile(storage.join(first, INDEX)):
            return read_index(first, f"the checkpoint's --data {first}", REPREPARE)["tokenizer"]
    except UserError:  # a mixture or index that no longer reads: nothing to compare against
        return None
    return (
        {"kind": "byte", "id": "byte"}
        if first in ("default", "synthetic") or os.path.exists(first)
        else None
    )


def check_tokenizer(
    meta: dict, data_tokenizer: dict, allow: bool, what: str, whose: str = "the checkpoint's"
) -> None:
    """UserError (one line naming both) when data prepared with `data_tokenizer` (a dataset's
    record) meets a checkpoint (`meta`) that records another tokenizer: its ids would be other
    tokens to the model. `allow`: --data.allow_tokenizer_mismatch. A checkpoint recording none
    passes. `whose`: what the line calls `meta`'s tokenizer (a run's eval sets compare with its
    training data's)."""
    saved = saved_tokenizer(meta)
    if allow or saved is None or saved["id"] == data_tokenizer.get("id"):
        return
    named = lambda r: r["id"] + (f" ({r['path']})" if r.get("path") else "")  # noqa: E731
    raise UserError(
        f"{what}: {whose} tokenizer is {named(saved)} but the data's is {named(data_tokenizer)},"
        f" so its token ids would be other tokens to the model; prepare the data with"
        f" `python -m train.data prepare --tokenizer {saved.get('path') or saved['kind']}`, or pass"
        f" --data.allow_tokenizer_mismatch true"
    )


def check_init_tokenizer(run: RunSetup, data) -> None:
    """--init-from PATH meeting data of another tokenizer: one line (check_tokenizer), before the
    compile. `data`: the run's opened pipeline; a user's iterable (Trainer(data=...)) has no
    recorded tokenizer to compare."""
    path, sources = run.cfg.checkpoint.init_from, getattr(data, "sources", None)
    if not path or not sources:
        return
    src, step = open_checkpoint(path)
    check_tokenizer(
        src.meta(step),
        sources[0].tokenizer,
        run.cfg.data.allow_tokenizer_mismatch,
        f"--init-from {path}",
    )


def warn_changed_settings(meta: dict, config: dict, data, log) -> None:
    """One warning line listing the settings (`config`: this run's, as Config.to_dict()) and the
    data sources (`data`: the run's pipeline) that differ from the checkpoint's."""
    changed = changed_settings(meta.get("config", {}), config)
    # the data itself (sources, windows) as well as the settings
    if "loader" in meta.get("data", {}):
        changed = list(dict.fromkeys(changed + data.check_state(meta["data"]["loader"])))
    if changed:
        log.print(
            "warning: resuming with settings that differ from the checkpoint's:"
            f" {', '.join(changed)}"
            + (
                " (the learning-rate schedule spans train.steps)"
                if any(c.startswith("train.steps ") for c in changed)
                else ""
            )
        )
