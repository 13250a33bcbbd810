"""Packing: documents -> rows and back; segment ids, positions and loss mask at boundaries."""

import hashlib

import grain
import numpy as np
import pytest

from ndjax.data import BATCH_FIELDS
from ndjax.data.packing import pack_bins, packed_fields, segments_from_eos, unpack
from ndjax.data.streams import ChatRows, TextRows, shuffled
from ndjax.data.synthetic import SyntheticSource
from ndjax.ops.attention import runs_per_row

EOS, PAD = 0, 99


def test_fields_at_document_boundaries():
    # Documents [1 2 3] [4 5] [6 7 8 9], each followed by EOS; one row of 8 tokens.
    window = np.array([[1, 2, 3, EOS, 4, 5, EOS, 6, 7]])
    docs = segments_from_eos(window, EOS)
    np.testing.assert_array_equal(docs, [[0, 0, 0, 0, 1, 1, 1, 2, 2]])
    row = packed_fields(window, docs)
    assert set(row) == set(BATCH_FIELDS) and all(v.dtype == np.int32 for v in row.values())
    np.testing.assert_array_equal(row["inputs"], [[1, 2, 3, EOS, 4, 5, EOS, 6]])
    np.testing.assert_array_equal(row["targets"], [[2, 3, EOS, 4, 5, EOS, 6, 7]])
    np.testing.assert_array_equal(row["segment_ids"], [[1, 1, 1, 1, 2, 2, 2, 3]])
    np.testing.assert_array_equal(row["positions"], [[0, 1, 2, 3, 0, 1, 2, 0]])
    # Predicting EOS is learned; predicting the next document's first token is not.
    np.testing.assert_array_equal(row["loss_mask"], [[1, 1, 1, 0, 1, 1, 0, 1]])
    assert [d.tolist() for d in unpack({k: v[0] for k, v in row.items()})] == [
        [1, 2, 3, EOS], [4, 5, EOS], [6]]


def test_row_that_starts_mid_document_and_ends_on_eos():
    window = np.array([[7, 8, EOS, 5, EOS]])
    row = packed_fields(window, segments_from_eos(window, EOS))
    np.testing.assert_array_equal(row["segment_ids"], [[1, 1, 1, 2]])
    np.testing.assert_array_equal(row["positions"], [[0, 1, 2, 0]])
    np.testing.assert_array_equal(row["loss_mask"], [[1, 1, 0, 1]])  # 5 -> EOS is learned


def _docs(rng, n, low, high):
    return [rng.integers(1, 50, rng.integers(low, high)).astype(np.uint16) for _ in range(n)]


def test_one_row_per_epoch_gives_every_document_back():
    rng = np.random.default_rng(0)
    docs = _docs(rng, 7, 1, 9)
    seq_len = sum(len(d) + 1 for d in docs) - 1  # the whole share is exactly one window
    rows = TextRows(docs, seq_len, 1, seed=3, eos_id=EOS, pad_id=PAD)
    orders = []
    for step in range(3):  # each step is a new epoch with a new document order
        row = {k: v[0] for k, v in rows.rows(step, 0, 1).items()}
        pieces = unpack(row)
        pieces[-1] = np.append(pieces[-1], row["targets"][-1])  # the window's last token
        assert all(p[-1] == EOS for p in pieces)
        got = [p[:-1].tolist() for p in pieces]
        assert sorted(got) == sorted(d.tolist() for d in docs)
        orders.append(got)
    assert orders[0] != orders[1]


def test_windows_of_an_epoch_tile_the_shuffled_stream():
    rng = np.random.default_rng(1)
    docs, seq_len, seed = _docs(rng, 40, 1, 30), 16, 5
    rows = TextRows(docs, seq_len, 1, seed, EOS, PAD)
    total = sum(len(d) + 1 for d in docs)
    n_windows = (total - 1) // seq_len
    stream = np.full(n_windows * seq_len + 1, -1)
    offsets = shuffled(np.arange(n_windows), n_windows, rows.stream.row_seed, 0) * seq_len
    for step, offset in enumerate(offsets):
        row = {k: v[0] for k, v in rows.rows(step, 0, 1).items()}
        stream[offset:offset + seq_len] = row["inputs"]
        stream[offset + seq_len] = row["targets"][-1]
        # Inside a row, every segment but the first and the last is a whole document.
        for piece in unpack(row)[1:-1]:
            assert piece[-1] == EOS and any(np.array_equal(piece[:-1], d) for d in docs)
    assert (stream >= 0).all()  # every window of the epoch was visited once
    # Split at EOS: the documents, whole, in the epoch's order.
    ends = np.flatnonzero(stream == EOS)
    found = [stream[a + 1:b].tolist() for a, b in zip(np.r_[-1, ends[:-1]], ends)]
    order = shuffled(range(len(docs)), len(docs), rows.stream.doc_seed, 0)
    assert found == [docs[i].tolist() for i in order[:len(found)]]


def test_positions_restart_and_mask_follows_segments():
    rng = np.random.default_rng(2)
    rows = TextRows(_docs(rng, 60, 1, 12), 24, 2, 0, EOS, PAD)
    batch = rows.rows(4, 0, 2)
    seg, pos, inputs = batch["segment_ids"], batch["positions"], batch["inputs"]
    new = np.concatenate([np.ones((2, 1), bool), seg[:, 1:] != seg[:, :-1]], 1)
    assert (pos[new] == 0).all() and (pos[~new] == np.roll(pos, 1, 1)[~new] + 1).all()
    assert (seg >= 1).all()
    # The only masked targets follow an EOS input (the next document's first token).
    np.testing.assert_array_equal(batch["loss_mask"] == 0, inputs == EOS)


def test_unpacked_rows_are_padded_pieces_of_one_document():
    docs = [np.arange(1, 4, dtype=np.uint16), np.arange(1, 41, dtype=np.uint16)]
    rows = TextRows(docs, 16, 1, 0, EOS, PAD, packing=False)
    # 4 tokens with EOS -> 1 piece; 41 tokens -> pieces [0,16], [16,32], [32,40].
    pieces = [{k: v[0] for k, v in rows.rows(t, 0, 1).items()} for t in range(4)]
    short = next(p for p in pieces if p["inputs"][0] == 1 and p["inputs"][3] == PAD)
    np.testing.assert_array_equal(short["inputs"][:4], [1, 2, 3, PAD])
    np.testing.assert_array_equal(short["targets"][:3], [2, 3, EOS])
    np.testing.assert_array_equal(short["segment_ids"], [1] * 3 + [0] * 13)
    np.testing.assert_array_equal(short["loss_mask"], short["segment_ids"])
    np.testing.assert_array_equal(short["positions"], list(range(3)) + [0] * 13)
    # The long document's pieces, put back together, are the document and its EOS.
    long = sorted((p for p in pieces if p is not short), key=lambda p: p["inputs"][0])
    rebuilt = np.concatenate([unpack(p)[0] for p in long] + [long[-1]["targets"][[7]]])
    np.testing.assert_array_equal(rebuilt, np.append(docs[1], EOS))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_shuffled_is_a_bijection_and_grains_shuffle_of_each_epoch(n):
    out = shuffled(np.arange(n), n, 7, 0)
    np.testing.assert_array_equal(np.sort(out), np.arange(n))
    if n > 8:
        assert (out != np.arange(n)).mean() > 0.5
        assert (shuffled(np.arange(n), n, 7, 1) != out).mean() > 0.5  # a fresh epoch order
    # What docs/data.md says the order is: Grain's MapDataset.shuffle, reseeded each epoch.
    grains = grain.MapDataset.range(n).shuffle(seed=7).repeat()
    epochs = np.concatenate([shuffled(range(n), n, 7, e) for e in range(3)])
    np.testing.assert_array_equal(epochs, [grains[i] for i in range(3 * n)])


# ----- rows within a bound on runs per row (an attention kernel's, Kernel.max_runs) ------------


def digest(batches) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for k in BATCH_FIELDS:
            h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()[:16]


def test_without_a_bound_rows_are_as_before_the_bound_existed():
    """The digests of rows without a bound: synthetic rows and pack_bins as made before
    packers took a bound; text and chat rows as the one stream over the whole corpus
    makes them (issue 48 changed them from one stream per batch row), in Grain's shuffles
    (which changed their order again; a Grain whose shuffle differs fails here)."""
    rng = np.random.default_rng(4)
    text = TextRows(_docs(rng, 40, 1, 12) + _docs(rng, 40, 1, 30), 16, 4, 2, EOS, PAD)
    convs = [(d, np.arange(len(d)) % 2) for d in _docs(rng, 30, 2, 14)]
    chat = ChatRows(convs, 16, 2, 1, PAD)
    synthetic = SyntheticSource(300, 64, 5)
    steps = (0, 1, 7, 50)
    got = [digest(text.rows(t, 0, 1) for t in steps), digest(text.rows(t, 3, 1) for t in steps),
           digest(chat.rows(t, 0, 2) for t in steps),
           digest(synthetic.rows(t, 1, 3) for t in steps),
           str(pack_bins([5, 3, 9, 2, 7, 7, 1, 4], 10, [3, 1, 0, 7, 2, 6, 5, 4]))]
    assert got == ["a5d182ab15bbfddf", "684e0a5c380fc0ca", "c50795560cb3a8b1",
                   "4515080d3363b582", "[[3, 1, 0], [7, 6], [2], [5], [4]]"], got


def _numbered_docs(rng, n, low, high):
    """Documents of distinct tokens (100, 101, ...): every token says where it came from."""
    cuts = np.cumsum(rng.integers(low, high, n))
    return np.split(np.arange(100, 100 + cuts[-1]), cuts[:-1])


def _learned(batches):
    """The (input, target) pairs the loss counts, sorted."""
    pairs = [(int(i), int(t)) for b in batches
             for i, t in zip(b["inputs"][b["loss_mask"] > 0], b["targets"][b["loss_mask"] > 0])]
    return sorted(pairs)


@pytest.mark.parametrize("bound", [2, 3, 5])
def test_packed_rows_within_a_bound_hold_every_token_once(bound):
    rng = np.random.default_rng(3)
    docs = _numbered_docs(rng, 80, 1, 8)  # 2-8 tokens with EOS: ~8 documents in a row of 32
    rows = TextRows(docs, 32, 1, 4, EOS, PAD, max_runs=bound)
    n = len(rows.stream.layout(0))
    epoch = [rows.rows(t, 0, 1) for t in range(n)]
    assert max(runs_per_row(b["segment_ids"]).max() for b in epoch) == bound
    inputs = np.concatenate([b["inputs"][b["segment_ids"] > 0] for b in epoch])
    # Every token of the epoch an input once (the stream's last, an EOS, perhaps not) ...
    np.testing.assert_array_equal(np.sort(inputs[inputs != EOS]), np.concatenate(docs))
    assert (inputs == EOS).sum() in (len(docs) - 1, len(docs))
    # ... and every pair of a document (its EOS included) learned once.
    assert _learned(epoch) == sorted((int(a), int(b)) for d in docs
                                     for a, b in zip(d, np.append(d[1:], EOS)))
    for b in epoch:  # padding only at the end, and as before: segment 0, nothing learned
        seg = b["segment_ids"][0]
        assert (np.diff((seg == 0).astype(int)) >= 0).all()
        assert (b["loss_mask"][0][seg == 0] == 0).all() and (b["inputs"][0][seg == 0] == PAD).all()
    # Random access: a step three epochs on, asked first, is the one reached by walking there.
    far = [rows.rows(t, 0, 1) for t in range(3 * n + 5)][-1]
    fresh = TextRows(docs, 32, 1, 4, EOS, PAD, max_runs=bound).rows(3 * n + 4, 0, 1)
    assert digest([far]) == digest([fresh])


def test_conversations_and_synthetic_rows_within_a_bound():
    rng = np.random.default_rng(5)
    convs = [(d, np.ones(len(d), np.uint8)) for d in _numbered_docs(rng, 60, 2, 6)]
    rows = ChatRows(convs, 32, 1, 1, PAD, max_runs=3)
    bins = rows.epoch(0)
    assert max(len(b) for b in bins) == 2  # and the padding after them: 3 runs
    assert sorted(c for b in bins for c in b) == list(range(len(convs)))
    epoch = [rows.rows(t, 0, 1) for t in range(len(bins))]
    assert max(runs_per_row(b["segment_ids"]).max() for b in epoch) <= 3
    synthetic = SyntheticSource(300, 512, 0, mean_doc_len=8, max_runs=6).rows(0, 0, 4)
    np.testing.assert_array_equal(runs_per_row(synthetic["segment_ids"]), [6] * 4)


def test_an_epoch_visits_every_conversation_once_whichever_batch_row_it_lands_in():
    # 50 conversations, batches of 4 rows: the rows of epoch 0, wherever they fall in the
    # batches, hold each conversation once (not a fixed share per batch row), packed
    # best-fit; epoch 1 holds them all again, in another order.
    rng = np.random.default_rng(6)
    convs = [(d, np.ones(len(d), np.uint8)) for d in _numbered_docs(rng, 50, 2, 12)]
    batch = 4
    rows = ChatRows(convs, 32, batch, 1, PAD)
    sizes = [len(rows.epoch(e)) for e in range(2)]
    flat = [{k: v[j] for k, v in rows.rows(step, 0, batch).items()}
            for step in range(-(-sum(sizes) // batch)) for j in range(batch)]
    firsts = sorted(int(c[0][0]) for c in convs)
    epochs = [flat[:sizes[0]], flat[sizes[0]:sum(sizes)]]
    seen = [[int(piece[0]) for row in epoch for piece in unpack(row)] for epoch in epochs]
    assert sorted(seen[0]) == firsts and sorted(seen[1]) == firsts
    assert seen[0] != seen[1]
    assert sizes[0] < len(convs) / 2  # packed: several conversations to a row
    assert rows.epoch_at(0) == 0 and rows.epoch_at(sizes[0]) == 1.0
    assert rows.epoch_at(sizes[0] // 2) == pytest.approx((sizes[0] // 2) / sizes[0])
    # A process feeding rows 1..2 of each batch gets exactly those rows of the stream.
    part = rows.rows(3, 1, 2)
    np.testing.assert_array_equal(part["inputs"], rows.rows(3, 0, batch)["inputs"][1:3])
