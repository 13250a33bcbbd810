"""Token windows -> the batch fields: inputs, targets, positions, segment_ids, loss_mask.

Packed rows are windows of ``seq_len + 1`` tokens of a stream of documents, each
document followed by EOS (the EOS belongs to the document it ends). Inputs are
the first ``seq_len`` tokens, targets the last ``seq_len``. In each row,
segment ids number the documents from 1, so attention never crosses documents,
and positions restart at 0 with each document (and at the row start), so RoPE
sees every document from its beginning. Predicting a document's EOS is learned;
predicting the first token of the next document is not (the loss mask drops
it). Unpacked rows hold one piece of one document each, padded with segment 0
and a zero loss mask.

Chat rows (``pack_bins``, ``chat_fields``) hold whole conversations, never a
piece of one: each row is up to ``seq_len + 1`` tokens of conversations laid
end to end (no EOS between them: the template's end-of-turn token ends each),
padded at the end with segment 0, and the loss mask is also 0 wherever the
target is not the assistant's.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


def segments_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """A document key per token of windows ``(n, L+1)`` where only EOS marks boundaries:
    the number of EOS tokens strictly before it in the window."""
    ends = (tokens == eos_id).astype(np.int32)
    return np.concatenate([np.zeros_like(ends[:, :1]), np.cumsum(ends[:, :-1], axis=1)], 1)


def packed_fields(tokens: np.ndarray, docs: np.ndarray) -> dict[str, np.ndarray]:
    """Batch fields of windows ``tokens`` ``(n, L+1)``; ``docs`` has the same shape and
    any integer key per token that changes exactly where a new document starts."""
    seq_len = tokens.shape[1] - 1
    first = np.concatenate([np.ones_like(docs[:, :1], bool), docs[:, 1:] != docs[:, :-1]], 1)
    segments = np.cumsum(first, axis=1, dtype=np.int32)
    seg_in, seg_tgt = segments[:, :-1], segments[:, 1:]
    starts = np.where(first[:, :-1], np.arange(seq_len), 0)
    positions = np.arange(seq_len) - np.maximum.accumulate(starts, axis=1)
    tokens = tokens.astype(np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": positions.astype(np.int32),
        "segment_ids": seg_in,
        "loss_mask": (seg_in == seg_tgt).astype(np.int32),
    }


def padded_fields(pieces: Sequence[np.ndarray], seq_len: int, pad_id: int
                  ) -> dict[str, np.ndarray]:
    """One row per document piece of 2..``seq_len + 1`` tokens, padded at the end."""
    n = len(pieces)
    inputs = np.full((n, seq_len), pad_id, np.int32)
    targets = np.full((n, seq_len), pad_id, np.int32)
    real = np.zeros((n, seq_len), np.int32)
    for i, piece in enumerate(pieces):
        m = len(piece) - 1
        inputs[i, :m], targets[i, :m], real[i, :m] = piece[:-1], piece[1:], 1
    return {
        "inputs": inputs,
        "targets": targets,
        "positions": np.where(real, np.arange(seq_len), 0).astype(np.int32),
        "segment_ids": real,
        "loss_mask": real.copy(),
    }


def pack_bins(lengths: Sequence[int], capacity: int, order: Sequence[int],
              max_items: int | None = None) -> list[list[int]]:
    """Items of ``lengths`` (each <= ``capacity``) taken in ``order`` into bins of
    ``capacity``, best fit: each goes into the fullest bin it fits in, or a new one.
    A bin of ``max_items`` items takes no more. Deterministic for a given order."""
    room: list[tuple[int, int]] = []  # (space left, bin), sorted; bins with space for 2+ tokens
    bins: list[list[int]] = []
    for i in order:
        n = int(lengths[i])
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            left, b = room.pop(k)
            bins[b].append(int(i))
        else:
            left, b = capacity, len(bins)
            bins.append([int(i)])
        # A conversation of fewer than 2 tokens has no target.
        if left - n >= 2 and (max_items is None or len(bins[b]) < max_items):
            bisect.insort(room, (left - n, b))
    return bins


def bounded_rows(ends: Sequence[int], seq_len: int, max_runs: int) -> np.ndarray:
    """Rows ``(n, 2)`` of ``[start, stop)`` offsets (at most ``seq_len + 1`` tokens) of a
    stream of documents ending at ``ends`` (increasing; the last is the stream's
    length), each row's inputs (all its tokens but a full row's last) holding at
    most ``max_runs`` >= 2 runs: documents, or pieces of them, and the padding after
    a short row. Windows at stride ``seq_len``, as without a bound, except that a
    window touching too many documents ends after ``max_runs - 1`` of them (then
    padded) and the next row starts at the next document. Every token but the
    stream's last is an input once, and every target a window would learn is
    learned once (the first token of a document is never one), the stream's tail
    included, in a padded row."""
    ends = [int(x) for x in ends]
    total, rows, at = ends[-1], [], 0
    while total - at >= 2:  # a row needs a target
        stop = min(at + seq_len + 1, total)
        inputs = min(stop - at, seq_len)
        first = bisect.bisect_right(ends, at)
        runs = bisect.bisect_right(ends, at + inputs - 1) - first + 1 + (inputs < seq_len)
        if runs <= max_runs:
            rows.append((at, stop))
            at += inputs
        else:  # room for max_runs - 1 documents and the padding after them
            stop = ends[first + max_runs - 2]
            rows.append((at, stop))
            at = stop
    return np.array(rows, np.int64).reshape(-1, 2)


def chat_fields(tokens: np.ndarray, docs: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
    """Batch fields of rows of whole conversations ``tokens`` ``(n, L+1)``: ``docs`` keys
    the conversation of each token (-1 on the padding at the end), ``mask`` is 1 on the
    tokens that are learned as targets."""
    fields = packed_fields(tokens, docs)
    pad = docs[:, :-1] < 0
    fields["segment_ids"] = np.where(pad, 0, fields["segment_ids"]).astype(np.int32)
    fields["positions"] = np.where(pad, 0, fields["positions"]).astype(np.int32)
    fields["loss_mask"] = (fields["loss_mask"] * (mask[:, 1:] > 0) * ~pad).astype(np.int32)
    return fields


def unpack(row: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The documents of one row (its input tokens per segment, in order, padding dropped):
    the inverse of packing, for tests and for looking at what a model was fed."""
    seg, inputs = np.asarray(row["segment_ids"]), np.asarray(row["inputs"])
    ids = seg[seg > 0]
    order = ids[np.concatenate([[True], ids[1:] != ids[:-1]])] if ids.size else ids
    return [inputs[seg == s] for s in order]
