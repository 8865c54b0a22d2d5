"""A source's stream cut into fixed windows of seq_len + 1 tokens (documents end to end with
packing, else one chunk of one document per window, padded) and the batch rows they make:
inputs, targets and loss weights, and with --data.packing_mask the segment ids and positions."""

from __future__ import annotations

import numpy as np

from train.data.sources import Stream


class Windows:
    """The fixed windows of one stream: seq_len + 1 tokens each (inputs and shifted targets)."""

    def __init__(self, stream: Stream, seq_len: int, packing: bool, eos_id: int):
        self.stream, self.T, self.packing, self.eos_id = stream, seq_len, packing, eos_id
        if packing:
            self.n = max(0, (stream.n_tokens - 1) // seq_len)
        else:  # chunks of each document: ceil((len - 1) / T) windows, the last one padded
            lengths = np.diff(stream.doc_vstart)
            self._chunk_end = np.cumsum(np.maximum(lengths - 1 + seq_len - 1, 0) // seq_len)
            self.n = int(self._chunk_end[-1]) if len(lengths) else 0

    def bounds(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Window ids -> (virtual start, end of its valid tokens)."""
        if self.packing:
            start = w * self.T
            return start, start + self.T + 1
        doc = np.searchsorted(self._chunk_end, w, side="right")
        first = np.concatenate([[0], self._chunk_end])[doc]
        start = self.stream.doc_vstart[doc] + (w - first) * self.T
        return start, np.minimum(start + self.T + 1, self.stream.doc_vstart[doc + 1])

    def rows(self, w: np.ndarray, packing_mask: bool) -> dict[str, np.ndarray]:
        """Window ids [R] -> inputs, targets (int32), weights (float32) [R, T]; with packing_mask
        also segment_ids (1, 2, ... per document in the row; 0 = padding) and positions (0 at
        each document's start and at the row's start). A target's weight is its loss mask (0 on
        the prompt and user tokens of supervised data, else 1), and 0 past the valid tokens."""
        start, end = self.bounds(np.asarray(w, np.int64))
        v = start[:, None] + np.arange(self.T + 1)
        valid = v < end[:, None]
        inside = np.where(valid, v, start[:, None])
        tokens = np.where(valid, self.stream.gather(inside), self.eos_id)
        weights = valid[:, 1:] * self.stream.gather_mask(inside[:, 1:])
        out = {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "weights": weights.astype(np.float32),
        }
        if packing_mask:
            doc = self.stream.doc_of(v)
            # a target in the next document is not predictable
            out["weights"] *= doc[:, 1:] == doc[:, :-1]
            seg = (doc[:, :-1] - doc[:, :1] + 1).astype(np.int32)
            pos = (
                v[:, :-1] - np.maximum(self.stream.doc_vstart[doc[:, :-1]], start[:, None])
            ).astype(np.int32)
            out["segment_ids"] = np.where(valid[:, :-1], seg, 0)
            out["positions"] = np.where(valid[:, :-1], pos, 0)
        return out


def batch_keys(packing_mask: bool) -> dict[str, type]:
    keys = {"inputs": np.int32, "targets": np.int32, "weights": np.float32}
    return {**keys, "segment_ids": np.int32, "positions": np.int32} if packing_mask else keys
