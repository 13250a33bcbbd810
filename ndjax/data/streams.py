"""Row sources: the rows of any global batch, as a pure function of (data, seed, step, row).

Every source has ``rows(step, start, count)``: rows ``start .. start+count`` of
the global batch of ``step``. Nothing depends on which process asks or on what
was asked before, so batches are the same for any mesh layout or number of
processes, and resuming is just asking for the next step.

Each source is one stream of rows over the whole corpus: global row ``g`` (``step x
batch_size + j``) is row ``g`` of the stream, and an epoch is one pass over every
document, in a fresh seeded order. A process holds the whole corpus (every process
reads and tokenizes it all) and builds only the rows it feeds.

- ``TextRows``: the documents of epoch ``e``, each followed by EOS, in a seeded order;
  the epoch's stream is cut into its ``W`` windows of ``L+1`` tokens at stride ``L``,
  visited in a seeded order: global row ``g`` is window ``shuffled(g mod W)`` of epoch
  ``g // W``.
- ``ChatRows``: rows of whole conversations (chat data). Epoch ``e`` takes every
  conversation once, in a seeded order, packed best-fit into rows of at most ``L+1``
  tokens (``pack_bins``, as Axolotl's multipack; one per row without packing), and
  visits those rows in a seeded order. How many rows an epoch has depends on its
  order; a step finds its epoch by counting the rows of the epochs before it.
- ``PairRows``: rows of whole preference pairs, as ``ChatRows`` lays conversations out;
  a pair is its chosen sequence then its rejected one, in one row.
- ``KTORows``: rows of KTO examples, as ``PairRows``: an example is its sequence then
  its KL sequence, in one row; the rows add a ``desirable`` field.
- ``PromptRows``: prompts (GRPO's, ``data.format=prompt``), one a row: global row ``g``
  is prompt ``shuffled(g mod n)`` of epoch ``g // n``, so every prompt is seen once per
  epoch; its rows are the prompts' ids, right-padded, their lengths and which prompt
  each is (their records, for the reward functions, by that index).
- ``TokenRows``: windows of ``L+1`` tokens of pre-tokenized files at stride
  ``L``; global row ``g = step*batch_size + j`` is window ``shuffled(g mod n)``
  of epoch ``g // n``, a seeded bijection, so every window is seen once per epoch.

Every seeded order is Grain's shuffle (``shuffled``): epoch ``e`` of an order of ``n``
items is what ``grain.MapDataset.range(n).shuffle(seed).repeat()`` holds at ``e*n ..
e*n + n``, computed per index, with a seed per order (``grain_seed``). Grain's packers and
iterators are not used here: they run per process, on its share, so their rows would
depend on the process count (docs/data.md).

Every source also says where a row stands in the epochs (``epoch_at``): the epochs
done before it and the fraction of its own.

With ``max_runs`` (an attention kernel's bound, ``Kernel.max_runs``) every row holds
at most that many runs of one segment id, its padding counted as one: text streams
are laid out per epoch by ``bounded_rows`` (a row ends after ``max_runs - 1``
documents and is padded where the window would touch more), conversations go
``max_runs - 1`` to a bin at most (preference pairs, two runs each,
``(max_runs - 1) // 2``), token files' windows that touch too many
documents are split into such rows when the source is built, and synthetic rows
let their last document fill the row. Without it the rows are as they always were.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Protocol

import numpy as np
from grain.experimental import index_shuffle

from ndjax.data.packing import (
    bounded_rows,
    chat_fields,
    pack_bins,
    packed_fields,
    padded_fields,
    segments_from_eos,
)
from ndjax.data.sources import TokenFile
from ndjax.runtime.errors import ConfigError


class RowSource(Protocol):
    def rows(self, step: int, start: int, count: int) -> dict[str, np.ndarray]: ...


class EpochSource(RowSource, Protocol):
    """A source over a finite corpus (all but the synthetic one)."""

    def epoch_at(self, row: int) -> float:
        """Global row ``row``'s place in the epochs: epochs before it + the share of its
        own epoch before it."""
        ...

    def rows_per_epoch(self) -> int:
        """The rows of the first epoch (later ones may differ by a few where packing
        depends on the epoch's order)."""
        ...


# What each seeded order is of (the second half of its key, ``grain_seed``).
_DOCUMENTS, _ROWS, _CONVERSATIONS, _BINS, _WINDOWS, _PAIRS, _PROMPTS = 1, 2, 3, 4, 5, 6, 7


def grain_seed(*key: int) -> int:
    """The 32-bit seed Grain's shuffles take, from ndjax's key: train.seed and which order
    it seeds (documents, windows, bins), so no two orders share a seed."""
    return int(np.random.SeedSequence(list(key)).generate_state(1)[0])


def shuffled(index: Sequence[int] | np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch ``epoch`` of Grain's seeded shuffle of ``n`` items, at positions ``index``:
    what ``grain.MapDataset.range(n).shuffle(seed).repeat()`` holds at ``epoch * n + i``
    for each ``i`` of ``index``.

    Grain's ``index_shuffle`` (with Grain's per-epoch seed, ``seed + epoch``) is a Feistel
    bijection of ``[0, n)`` computed per index in O(1) memory: a full shuffle of ``n``
    windows would need ``8n`` bytes, ~1 GiB for a 10B-token file at L=64. It takes one
    index a call, ~6 us (a million documents' order: ~6 s; docs/data.md).
    """
    index = np.asarray(index, np.int64).tolist()
    epoch_seed = (seed + epoch) % 2**32
    return np.fromiter(map(index_shuffle, index, repeat(n - 1), repeat(epoch_seed), repeat(4)),
                       np.int64, count=len(index))


def one_shuffled(i: int, n: int, seed: int, epoch: int) -> int:
    """``shuffled`` at the one position ``i``."""
    return index_shuffle(i, max_index=n - 1, seed=(seed + epoch) % 2**32, rounds=4)


class _EpochStarts:
    """Where each epoch starts in a stream whose epochs hold ``rows_in(e)`` rows (packing
    makes them differ), laid out as far as asked, once. ``lock`` is the source's, which
    also guards its cache of laid-out epochs: the loader thread asks for rows while the
    training loop asks where a step stands (``epoch_at``)."""

    def __init__(self, rows_in: Callable[[int], int], lock: threading.RLock):
        self.rows_in, self.firsts, self.lock = rows_in, [0], lock

    def locate(self, t: int) -> tuple[int, int]:
        """(the epoch of global row ``t``, its row within that epoch)."""
        with self.lock:
            while self.firsts[-1] <= t:
                self.firsts.append(self.firsts[-1] + self.rows_in(len(self.firsts) - 1))
            e = bisect.bisect_right(self.firsts, t) - 1
            return e, t - self.firsts[e]

    def position(self, t: int) -> float:
        e, i = self.locate(t)
        return e + i / self.rows_in(e)


class _Slot:
    """The infinite stream of rows over a corpus's documents (see the module docstring)."""

    packed = True

    def __init__(self, docs: Sequence[np.ndarray], seed: int, eos_id: int):
        self.doc_seed, self.row_seed = grain_seed(seed, _DOCUMENTS), grain_seed(seed, _ROWS)
        dtype = np.result_type(*(d.dtype for d in docs), np.min_scalar_type(eos_id))
        self.lengths = np.array([len(d) + 1 for d in docs], np.int64)   # + EOS
        self.starts = np.cumsum(self.lengths) - self.lengths
        self.flat = np.empty(int(self.lengths.sum()), dtype)
        for d, s, n in zip(docs, self.starts, self.lengths):
            self.flat[s:s + n - 1], self.flat[s + n - 1] = d, eos_id
        self.total = len(self.flat)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._lock = threading.RLock()  # the cache, read by the loader thread and epoch_at

    def epoch(self, e: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The shuffled order of ``n`` items in epoch ``e``, and the end offset of each
        document in that order. Only the latest two epochs are kept: steps move forward."""
        with self._lock:
            cached = self._epochs.get(e)
            if cached is None:
                for old in sorted(self._epochs)[:-1]:
                    self._epochs.pop(old, None)
                order = shuffled(np.arange(n), n, self.doc_seed, e)
                ends = np.cumsum(self.lengths[order]) if self.packed else order[:0]
                cached = self._epochs[e] = order, ends
            return cached

    def row(self, t: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``t``: a window of ``seq_len + 1`` tokens at a multiple of ``seq_len`` in the
        stream of epoch ``t // W`` (``W`` windows fit in one epoch), and a document key per
        token. Windows are visited in a seeded order, once each per epoch: consecutive
        steps read unrelated parts of the share, not the next lines of the same file."""
        n_windows = (self.total - 1) // seq_len
        e, i = divmod(t, n_windows)
        order, ends = self.epoch(e, len(self.lengths))
        offset = one_shuffled(i, n_windows, self.row_seed, e) * seq_len
        return self.take(order, ends, offset, seq_len + 1)

    def epoch_at(self, t: int, seq_len: int) -> float:
        return t / ((self.total - 1) // seq_len)

    def rows_per_epoch(self, seq_len: int) -> int:
        return (self.total - 1) // seq_len

    def take(self, order: np.ndarray, ends: np.ndarray, offset: int, width: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """``width`` tokens of the stream in ``order`` from ``offset``, and a document key
        (its place in the order) per token."""
        first = int(np.searchsorted(ends, offset, side="right"))
        tokens, docs = [], []
        for k in range(first, len(order)):  # the documents the window overlaps, in order
            d = order[k]
            within = max(offset - (ends[k] - self.lengths[d]), 0)
            take = int(min(self.lengths[d] - within, width))
            start = self.starts[d] + within
            tokens.append(self.flat[start:start + take])
            docs.append(np.full(take, k, np.int64))
            width -= take
            if width == 0:
                break
        return np.concatenate(tokens), np.concatenate(docs)


class _BoundedSlot(_Slot):
    """Packed rows of at most ``max_runs`` runs (``bounded_rows``): each epoch's stream is
    laid out into rows, which visit in a seeded order as windows do. How many rows an
    epoch has depends on its document order, so a step finds its epoch by counting
    the rows of the epochs before it (once; a resumed run lays those out again)."""

    def __init__(self, docs: Sequence[np.ndarray], seed: int, eos_id: int,
                 seq_len: int, max_runs: int, pad_id: int):
        super().__init__(docs, seed, eos_id)
        self.seq_len, self.max_runs, self.pad_id = seq_len, max_runs, pad_id
        self._layouts: dict[int, np.ndarray] = {}
        self._starts = _EpochStarts(lambda e: len(self.layout(e)), self._lock)

    def layout(self, e: int) -> np.ndarray:
        with self._lock:
            cached = self._layouts.get(e)
            if cached is None:
                for old in sorted(self._layouts)[:-1]:
                    self._layouts.pop(old, None)
                ends = self.epoch(e, len(self.lengths))[1]
                cached = self._layouts[e] = bounded_rows(ends, self.seq_len, self.max_runs)
            return cached

    def epoch_at(self, t: int, seq_len: int) -> float:
        return self._starts.position(t)

    def rows_per_epoch(self, seq_len: int) -> int:
        return len(self.layout(0))

    def row(self, t: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Row ``t``, padded to ``seq_len + 1`` tokens; the padding's key is -1."""
        e, i = self._starts.locate(t)
        rows = self.layout(e)
        i = one_shuffled(i, len(rows), self.row_seed, e)
        start, stop = (int(x) for x in rows[i])
        order, ends = self.epoch(e, len(self.lengths))
        tokens, docs = self.take(order, ends, start, stop - start)
        pad = seq_len + 1 - len(tokens)
        return (np.concatenate([tokens, np.full(pad, self.pad_id, tokens.dtype)]),
                np.concatenate([docs, np.full(pad, -1, np.int64)]))


class _PaddedSlot(_Slot):
    """Without packing: each row is one piece (at most L+1 tokens) of one document."""

    packed = False

    def __init__(self, docs: Sequence[np.ndarray], seed: int, eos_id: int,
                 seq_len: int):
        super().__init__(docs, seed, eos_id)
        self.seq_len = seq_len
        # Piece k of a document (with its EOS) is tokens [k*L, k*L+L]: consecutive
        # pieces overlap by one token, so every token is a target exactly once.
        counts = (self.lengths - 1 + seq_len - 1) // seq_len
        self.piece_doc = np.repeat(np.arange(len(counts)), counts)
        self.piece_k = np.arange(len(self.piece_doc)) - np.repeat(np.cumsum(counts) - counts,
                                                                  counts)

    def epoch_at(self, t: int, seq_len: int) -> float:
        return t / len(self.piece_doc)

    def rows_per_epoch(self, seq_len: int) -> int:
        return len(self.piece_doc)

    def piece(self, t: int) -> np.ndarray:
        e, i = divmod(t, len(self.piece_doc))
        p = self.epoch(e, len(self.piece_doc))[0][i]
        d = self.piece_doc[p]
        a = self.starts[d] + self.piece_k[p] * self.seq_len
        return self.flat[a:min(a + self.seq_len + 1, self.starts[d] + self.lengths[d])]


class TextRows:
    """Rows of tokenized documents, one stream over all of them (see the module docstring).

    ``docs``: every document of the corpus (token arrays without EOS; at least one, and
    at least ``seq_len + 1`` tokens in all when packing).
    """

    def __init__(self, docs: Sequence[np.ndarray], seq_len: int, batch_size: int, seed: int,
                 eos_id: int, pad_id: int, packing: bool = True, max_runs: int | None = None):
        self.seq_len, self.batch_size, self.pad_id, self.packing = (seq_len, batch_size,
                                                                    pad_id, packing)
        # Only packed rows need the bound: an unpacked row holds a piece and its padding.
        self.bounded = packing and max_runs is not None
        if not packing:
            self.stream: _Slot = _PaddedSlot(docs, seed, eos_id, seq_len)
        elif max_runs is None:
            self.stream = _Slot(docs, seed, eos_id)
        else:
            self.stream = _BoundedSlot(docs, seed, eos_id, seq_len, max_runs, pad_id)

    def epoch_at(self, row: int) -> float:
        return self.stream.epoch_at(row, self.seq_len)

    def rows_per_epoch(self) -> int:
        return self.stream.rows_per_epoch(self.seq_len)

    def rows(self, step: int, start: int, count: int) -> dict[str, np.ndarray]:
        g = range(step * self.batch_size + start, step * self.batch_size + start + count)
        if not self.packing:
            return padded_fields([self.stream.piece(t) for t in g], self.seq_len, self.pad_id)
        windows = [self.stream.row(t, self.seq_len) for t in g]
        tokens, docs = np.stack([w[0] for w in windows]), np.stack([w[1] for w in windows])
        if self.bounded:  # rows may end in padding, keyed -1
            return chat_fields(tokens, docs, (docs >= 0).astype(np.uint8))
        return packed_fields(tokens, docs)


class _WholeRows:
    """Rows of whole items (conversations, preference pairs), one stream over all of
    them: epoch ``e`` takes every item once, in a seeded order (``shuffled``), packed
    best-fit into rows of ``seq_len + 1`` tokens (one a row without packing), visited in
    a seeded order. Subclasses say what an item is: its length, the sequences it lays
    out (``_pieces``), how many fit a row under ``max_runs`` and which order it seeds."""

    _ORDER = _CONVERSATIONS  # the seeded order's key (``grain_seed``)

    def __init__(self, lengths: Sequence[int], seq_len: int, batch_size: int, seed: int,
                 pad_id: int, packing: bool, dropped: int, most: int | None):
        self.seq_len, self.batch_size, self.pad_id = seq_len, batch_size, pad_id
        self.item_seed, self.bin_seed = grain_seed(seed, self._ORDER), grain_seed(seed, _BINS)
        self.packing, self.dropped, self.most = packing, dropped, most
        self.lengths = np.array(lengths, np.int64)
        self._epochs: dict[int, list[list[int]]] = {}
        self._lock = threading.RLock()  # the cache, read by the loader thread and epoch_at
        self._starts = _EpochStarts(lambda e: len(self.epoch(e)), self._lock)

    def _pieces(self, i: int) -> Sequence[tuple[np.ndarray, np.ndarray]]:
        """The ``(ids, mask)`` sequences item ``i`` lays out in a row, in order."""
        raise NotImplementedError

    def epoch(self, e: int) -> list[list[int]]:
        """Epoch ``e``'s rows: every item once, in a seeded order, packed. Only the latest
        two epochs are kept: steps move forward."""
        with self._lock:
            cached = self._epochs.get(e)
            if cached is None:
                for old in sorted(self._epochs)[:-1]:
                    self._epochs.pop(old, None)
                n = len(self.lengths)
                order = shuffled(np.arange(n), n, self.item_seed, e)
                cached = self._epochs[e] = (
                    pack_bins(self.lengths, self.seq_len + 1, order, self.most) if self.packing
                    else [[int(i)] for i in order])
            return cached

    def epoch_at(self, row: int) -> float:
        return self._starts.position(row)

    def rows_per_epoch(self) -> int:
        return len(self.epoch(0))

    def _row(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Row ``g``'s tokens, a key per token (each sequence its own, in order; -1 on
        the padding), mask, and the item of each token (-1 on the padding)."""
        e, i = self._starts.locate(g)
        bins = self.epoch(e)
        b = bins[one_shuffled(i, len(bins), self.bin_seed, e)]
        width = self.seq_len + 1
        tokens = np.full(width, self.pad_id, np.int64)
        docs, mask = np.full(width, -1, np.int64), np.zeros(width, np.uint8)
        items = np.full(width, -1, np.int64)
        at, k = 0, 0
        for item in b:
            for ids, m in self._pieces(item):
                tokens[at:at + len(ids)], docs[at:at + len(ids)], mask[at:at + len(ids)] = ids, k, m
                items[at:at + len(ids)] = item
                at, k = at + len(ids), k + 1
        return tokens, docs, mask, items

    def _stacked(self, step: int, start: int, count: int) -> tuple[np.ndarray, ...]:
        first = step * self.batch_size + start
        rows = [self._row(g) for g in range(first, first + count)]
        return tuple(np.stack([r[k] for r in rows]) for k in range(4))

    def rows(self, step: int, start: int, count: int) -> dict[str, np.ndarray]:
        return chat_fields(*self._stacked(step, start, count)[:3])


class ChatRows(_WholeRows):
    """Rows of whole conversations, one stream over all of them (see the module docstring).

    ``convs``: every conversation kept, ``(ids, mask)`` pairs of at most ``seq_len + 1``
    tokens (``chat.fit`` has cut or dropped the others), at least one. ``dropped``
    counts the conversations left out for length; it is reported, not used.
    """

    def __init__(self, convs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int,
                 batch_size: int, seed: int, pad_id: int, packing: bool = True,
                 dropped: int = 0, max_runs: int | None = None):
        self.convs = list(convs)
        # max_runs - 1 conversations leave a run for the padding after them.
        super().__init__([len(ids) for ids, _ in self.convs], seq_len, batch_size, seed,
                         pad_id, packing, dropped, None if max_runs is None else max_runs - 1)

    def _pieces(self, i: int) -> Sequence[tuple[np.ndarray, np.ndarray]]:
        return (self.convs[i],)


class PairRows(_WholeRows):
    """Rows of whole preference pairs, one stream over all of them (see the module
    docstring): each pair is two consecutive sequences of one row, chosen then
    rejected, so the ``k``-th pair of a row has segment ids ``2k + 1`` (chosen) and
    ``2k + 2`` (rejected), and a row's first pair starts at its first token.

    ``pairs``: every pair kept, ``((ids, mask), (ids, mask))`` of chosen and rejected,
    at most ``seq_len + 1`` tokens together (``preference.fit``), at least one.
    ``dropped`` counts the pairs left out for length; it is reported, not used.
    """

    _ORDER = _PAIRS

    _WHAT = "a preference pair"  # what an item is, in errors

    def __init__(self, pairs: Sequence[tuple[tuple[np.ndarray, np.ndarray],
                                              tuple[np.ndarray, np.ndarray]]],
                 seq_len: int, batch_size: int, seed: int, pad_id: int, packing: bool = True,
                 dropped: int = 0, max_runs: int | None = None):
        if max_runs is not None and max_runs < 3:
            raise ConfigError(
                f"model.attn_max_docs={max_runs}: the attention kernel's bound on a row's runs "
                f"of one segment id leaves no room for {self._WHAT} (two sequences) and "
                "the padding after it; set model.attn_max_docs >= 3.")
        self.pairs = list(pairs)
        # A pair is two runs; the padding after the last one more.
        super().__init__([len(c[0]) + len(r[0]) for c, r in self.pairs], seq_len, batch_size,
                         seed, pad_id, packing, dropped,
                         None if max_runs is None else (max_runs - 1) // 2)

    def _pieces(self, i: int) -> Sequence[tuple[np.ndarray, np.ndarray]]:
        return self.pairs[i]


class KTORows(PairRows):
    """Rows of KTO examples (``data.format=unpaired_preference``), laid out as
    ``PairRows`` lays out pairs: each example is two consecutive sequences of one row, its
    own (prompt + completion) then its KL sequence (its prompt + its KL partner's
    completion), so the ``k``-th example of a row has segment ids ``2k + 1`` and ``2k +
    2``. Its rows add the field ``desirable``: 1 on every input position of a desirable
    example's two sequences, 0 elsewhere (undesirable examples, padding).

    ``units``: every example kept, ``((ids, mask), (ids, mask))`` of its sequence and its
    KL sequence, at most ``seq_len + 1`` tokens together (``preference.fit_unit``), at
    least one; ``desirable``: each one's label.
    """

    _WHAT = "a KTO example (its sequence and its KL sequence)"

    def __init__(self, units: Sequence[tuple[tuple[np.ndarray, np.ndarray],
                                              tuple[np.ndarray, np.ndarray]]],
                 desirable: Sequence[bool], seq_len: int, batch_size: int, seed: int,
                 pad_id: int, packing: bool = True, dropped: int = 0,
                 max_runs: int | None = None):
        super().__init__(units, seq_len, batch_size, seed, pad_id, packing, dropped, max_runs)
        self.desirable = np.asarray(desirable, bool)
        assert len(self.desirable) == len(self.pairs), "a label per example"

    def rows(self, step: int, start: int, count: int) -> dict[str, np.ndarray]:
        tokens, docs, mask, items = self._stacked(step, start, count)
        fields = chat_fields(tokens, docs, mask)
        inputs = items[:, :-1]
        fields["desirable"] = ((inputs >= 0) & self.desirable[np.maximum(inputs, 0)]
                               ).astype(np.int32)
        return fields


class PromptRows:
    """Prompts, one a row (see the module docstring): ``batch_size`` is the prompts of a
    step (GRPO's train.batch_size // grpo.num_generations), ``seq_len`` the prompt
    budget (train.seq_len less the completion's tokens), which every kept prompt fits.

    ``prompt_ids``: every prompt kept, its token ids (at least one);
    ``records``: each one's record (every column, as read); ``prompts``: each one's
    prompt (a string, or a list of ``{role, content}`` messages), as the reward
    functions are given it. ``dropped`` counts the prompts left out for length; it is
    reported, not used.

    ``rows(step, start, count)``: ``prompt_ids`` ``(count, seq_len)`` int32, right-padded
    with ``pad_id``; ``prompt_len`` ``(count,)`` int32; ``index`` ``(count,)`` int64, the
    prompt's place in the kept list (``records(index)``, ``prompts(index)``). With
    ``repeat`` (GRPO's num_iterations) each batch serves that many steps: step s reads
    batch s // repeat.
    """

    FIELDS = ("prompt_ids", "prompt_len", "index")

    def __init__(self, prompt_ids: Sequence[np.ndarray], records: Sequence[dict],
                 prompts: Sequence[str | list[dict]], seq_len: int, batch_size: int, seed: int,
                 pad_id: int, dropped: int = 0, repeat: int = 1):
        if not len(prompt_ids):
            raise ValueError("PromptRows needs a prompt")
        assert len(records) == len(prompt_ids) == len(prompts), "a record per prompt"
        self.seq_len, self.batch_size, self.pad_id, self.dropped = (seq_len, batch_size, pad_id,
                                                                    dropped)
        self.repeat = repeat
        self.prompt_seed = grain_seed(seed, _PROMPTS)
        self.lengths = np.array([len(x) for x in prompt_ids], np.int32)
        longest = int(self.lengths.max())
        if longest > seq_len:
            raise ValueError(f"a prompt of {longest} tokens exceeds seq_len={seq_len}")
        self.ids = [np.asarray(x, np.int32) for x in prompt_ids]
        self._records, self._prompts = list(records), list(prompts)

    def __len__(self) -> int:
        return len(self.lengths)

    def order(self, g: np.ndarray) -> np.ndarray:
        """The prompt (its index in the kept list) of each global row ``g``."""
        g = np.asarray(g, np.int64)
        n = len(self)
        epoch, at = g // n, g % n
        index = np.empty_like(at)
        for e in np.unique(epoch):
            sel = epoch == e
            index[sel] = shuffled(at[sel], n, self.prompt_seed, int(e))
        return index

    def rows(self, step: int, start: int, count: int) -> dict[str, np.ndarray]:
        g = step // self.repeat * self.batch_size + np.arange(start, start + count,
                                                              dtype=np.int64)
        index = self.order(g)
        ids = np.full((count, self.seq_len), self.pad_id, np.int32)
        for r, i in enumerate(index):
            ids[r, :self.lengths[i]] = self.ids[i]
        return {"prompt_ids": ids, "prompt_len": self.lengths[index], "index": index}

    def records(self, indices: Sequence[int] | np.ndarray) -> list[dict]:
        """The records of the kept prompts ``indices`` (``rows()['index']``): every
        column, as read (the same dicts: do not change them)."""
        return [self._records[int(i)] for i in indices]

    def prompts(self, indices: Sequence[int] | np.ndarray) -> list[str | list[dict]]:
        """The prompts (strings, or lists of messages) of the kept prompts ``indices``."""
        return [self._prompts[int(i)] for i in indices]

    def epoch_at(self, row: int) -> float:
        return row / self.repeat / len(self)

    def rows_per_epoch(self) -> int:
        return len(self) * self.repeat


class TokenRows:
    """Packed rows from pre-tokenized files (see the module docstring).

    Windows never straddle two files. Every window is checked against the
    model's vocabulary as it is read: a bad id is an error naming the file and
    the token's offset, never silent garbage.
    """

    def __init__(self, files: Sequence[TokenFile], seq_len: int, batch_size: int, seed: int,
                 eos_id: int, vocab_size: int, field: str, max_runs: int | None = None,
                 pad_id: int = 0):
        self.files, self.seq_len, self.batch_size = list(files), seq_len, batch_size
        self.eos_id, self.vocab_size, self.field = eos_id, vocab_size, field
        self.window_seed = grain_seed(seed, _WINDOWS)
        self.arrays = [f.array() for f in self.files]  # memory maps: nothing read yet
        per_file = np.array([(f.n_tokens - 1) // seq_len for f in self.files], np.int64)
        self.ends = np.cumsum(per_file)
        self.per_file = per_file
        self.n_windows = int(self.ends[-1])
        # With a bound, the windows are split up front (file, start, stop per row): this
        # reads every file once, here, where the documents are known only by their EOS.
        self.pad_id = pad_id
        self.split = None if max_runs is None else self._split(max_runs)
        self.n_rows = self.n_windows if self.split is None else len(self.split)

    def _split(self, max_runs: int) -> np.ndarray:
        """Each window whose inputs touch more than ``max_runs`` documents split into rows
        of ``bounded_rows`` (the window's tokens, the target-only last one included, as
        its stream); the others whole."""
        L, out = self.seq_len, []
        block = max(1, (1 << 24) // L)  # windows read at a time
        for f, (arr, n) in enumerate(zip(self.arrays, self.per_file)):
            for k0 in range(0, int(n), block):
                k1 = min(int(n), k0 + block)
                eos = np.asarray(arr[k0 * L:k1 * L + 1]) == self.eos_id
                runs = 1 + eos[:(k1 - k0) * L].reshape(-1, L)[:, :L - 1].sum(1)
                at = np.arange(k0, k1, dtype=np.int64) * L
                whole = np.stack([np.full_like(at, f), at, at + L + 1], 1)
                done = 0
                for w in np.flatnonzero(runs > max_runs):
                    ends = np.union1d(np.flatnonzero(eos[w * L:w * L + L + 1]) + 1, [L + 1])
                    rows = bounded_rows(ends, L, max_runs) + at[w]
                    out += [whole[done:w], np.concatenate([np.full((len(rows), 1), f), rows], 1)]
                    done = w + 1
                out.append(whole[done:])
        return np.concatenate(out).astype(np.int64)

    def epoch_at(self, row: int) -> float:
        return row / self.n_rows

    def rows_per_epoch(self) -> int:
        return self.n_rows

    def rows(self, step: int, start: int, count: int) -> dict[str, np.ndarray]:
        g = step * self.batch_size + np.arange(start, start + count, dtype=np.int64)
        epoch, index = g // self.n_rows, g % self.n_rows
        window = np.empty_like(index)
        for e in np.unique(epoch):
            sel = epoch == e
            window[sel] = shuffled(index[sel], self.n_rows, self.window_seed, int(e))
        if self.split is not None:
            return self._split_rows(self.split[window])
        file = np.searchsorted(self.ends, window, side="right")
        local = window - (self.ends[file] - self.per_file[file])
        L = self.seq_len
        tokens = np.stack([np.asarray(self.arrays[f][k * L:k * L + L + 1], np.int64)
                           for f, k in zip(file, local)])
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise ConfigError(
                f"{self.field}: {self.files[file[r]].path}: token id {tokens[r, c]} at token "
                f"{local[r] * L + c} is not below model.vocab_size={self.vocab_size}; the file "
                "was made with another tokenizer, or model.vocab_size is too small.")
        return packed_fields(tokens, segments_from_eos(tokens, self.eos_id))

    def _split_rows(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The fields of rows ``(file, start, stop)``, padded after ``stop``."""
        width = self.seq_len + 1
        tokens = np.full((len(rows), width), self.pad_id, np.int64)
        docs = np.full((len(rows), width), -1, np.int64)
        for r, (f, a, z) in enumerate(rows):
            real = np.asarray(self.arrays[f][a:z], np.int64)
            bad = np.flatnonzero((real < 0) | (real >= self.vocab_size))
            if bad.size:
                raise ConfigError(
                    f"{self.field}: {self.files[f].path}: token id {real[bad[0]]} at token "
                    f"{a + bad[0]} is not below model.vocab_size={self.vocab_size}; the file "
                    "was made with another tokenizer, or model.vocab_size is too small.")
            tokens[r, :z - a] = real
            docs[r, :z - a] = segments_from_eos(real[None], self.eos_id)[0]
        return chat_fields(tokens, docs, (docs >= 0).astype(np.uint8))
