"""Ring attention equals dense attention (forward and gradients) and skips masked blocks.

Tolerance: max abs diff <= 1e-5 in float32. Both sides compute the same
softmax; the ring sums its exponentials tile by tile with running-max
rescaling instead of in one pass, which moves results by a few float32 ulps
(~1e-7 relative; gradients of order 1 come out within ~3e-6 here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ndjax.ops import ring_attention as ra
from ndjax.ops.attention import AttentionSpec
from ndjax.ops.attention import dense as dot_product_attention
from ndjax.parallel.mesh import ParallelDims, build_mesh

# (context, layout, seq_len, n_heads, n_kv_heads, kv_tile, packed documents). Together:
# both layouts at context 2, 4 and 8; kv heads = heads, fewer, and 1; with and
# without segment ids; lengths that are not powers of two; tiles smaller than a
# block (several tiles per ring step) and larger (one tile).
CASES = [
    (1, "zigzag", 24, 4, 2, 4, True),        # one shard: the tiled kernel, no ring
    (2, "zigzag", 48, 4, 4, 512, True),      # 4 chunks of 12 tokens
    (2, "contiguous", 48, 4, 1, 8, False),
    (4, "zigzag", 64, 4, 2, 4, False),
    (4, "contiguous", 40, 4, 4, 5, True),    # blocks of 10, tiles of 5
    (8, "zigzag", 48, 4, 1, 512, True),      # 16 chunks of 3 tokens
    (8, "contiguous", 64, 4, 2, 4, True),
]


def random_inputs(seq_len, heads, kv_heads, packed, b=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, seq_len, heads, d)).astype(np.float32)
    k = rng.normal(size=(b, seq_len, kv_heads, d)).astype(np.float32)
    v = rng.normal(size=(b, seq_len, kv_heads, d)).astype(np.float32)
    dout = rng.normal(size=(b, seq_len, heads, d)).astype(np.float32)
    if packed:  # documents of random lengths, crossing chunk and shard boundaries
        seg = np.cumsum(rng.random((b, seq_len)) < 0.15, axis=1).astype(np.int32)
        seg[0, 5] = seg[0, 4] + 1  # a one-token document
        seg[0, 6:] += 2
    else:
        seg = np.zeros((b, seq_len), np.int32)
    return q, k, v, seg, dout


def output_and_grads(attend, q, k, v, seg, dout):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg), q, k, v)
    return out, vjp(dout)


@pytest.mark.parametrize("context, layout, seq_len, heads, kv_heads, tile, packed", CASES)
def test_ring_matches_dense(context, layout, seq_len, heads, kv_heads, tile, packed):
    q, k, v, seg, dout = random_inputs(seq_len, heads, kv_heads, packed)
    ref_out, ref_grads = jax.jit(output_and_grads, static_argnums=0)(
        dot_product_attention, q, k, v, seg, dout)

    mesh = build_mesh(ParallelDims(fsdp=8 // context, context=context)) if context > 1 else None
    kw = dict(mesh=mesh, layout=layout, kv_tile=tile)

    @jax.jit
    def ring(q, k, v, seg, dout):
        out, grads = output_and_grads(
            lambda *a: ra.ring_attention(*a, **kw), q, k, v, seg, dout)
        return out, grads, ra.ring_attention_blocks(q, k, v, seg, **kw)[1]

    perm = ra.layout_permutation(layout, seq_len, context)
    perm = np.arange(seq_len) if perm is None else perm
    out, grads, blocks = ring(*(x[:, perm] for x in (q, k, v, seg, dout)))
    undo = np.argsort(perm)
    np.testing.assert_allclose(np.asarray(out)[:, undo], ref_out, rtol=0, atol=1e-5)
    for name, g, ref in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g)[:, undo], ref, rtol=0, atol=1e-5, err_msg=name)

    # Work: zigzag gives every shard 2c+1 blocks, contiguous gives shard i i+1;
    # either way the total is exactly the blocks on or below the diagonal, so
    # no causally masked block was computed. On packed rows, the blocks whose
    # documents cannot meet are skipped too: exactly those of a count by hand.
    blocks = np.asarray(blocks).tolist()
    pieces = ra.PIECES[layout] * context
    scheduled = ra.blocks_per_shard(layout, context)
    assert sum(scheduled) == pieces * (pieces + 1) // 2
    expected = [2 * context + 1] * context if layout == "zigzag" else list(range(1, context + 1))
    assert scheduled == expected
    meeting = _blocks_that_meet(seg[:, perm], layout, context, ra.tile_len(
        ra.piece_len(layout, seq_len, context), tile))
    assert blocks == meeting
    assert meeting == scheduled if not packed else sum(meeting) <= sum(scheduled)


def test_packed_rows_skip_the_blocks_of_other_documents():
    """Documents of 4 tokens, none crossing a chunk of 8 (64 tokens, 4 shards, zigzag):
    of the 9 blocks each shard schedules, only its 2 diagonal ones hold a query and a
    key of one document. It computes those 2 and the result is still dense's; one
    document across the row computes all 9."""
    q, k, v, _, dout = random_inputs(64, 4, 2, packed=False, b=1)
    mesh = build_mesh(ParallelDims(fsdp=2, context=4))
    kw = dict(mesh=mesh, layout="zigzag", kv_tile=4)
    perm = ra.layout_permutation("zigzag", 64, 4)
    docs = (np.arange(64) // 4)[None].astype(np.int32)
    for seg, want in ((docs, [2] * 4), (np.zeros_like(docs), [9] * 4)):
        ref = dot_product_attention(q, k, v, seg)
        out, blocks = jax.jit(lambda *a: ra.ring_attention_blocks(*a, **kw))(
            *(x[:, perm] for x in (q, k, v, seg)))
        np.testing.assert_allclose(np.asarray(out)[:, np.argsort(perm)], ref, rtol=0, atol=1e-5)
        assert np.asarray(blocks).tolist() == want == _blocks_that_meet(seg[:, perm], "zigzag",
                                                                         4, 4)


def test_each_device_skips_by_its_own_rows():
    """fsdp=2 x context=2 x tensor=2, each device holding one row and half the heads
    (rows="fsdp", heads="tensor": the shard_map manual over every axis): outputs and
    gradients equal dense's, and each context shard's block count is its busiest
    device's, each device counting the blocks its own row's documents meet."""
    q, k, v, seg, dout = random_inputs(48, 4, 2, packed=True)
    seg[0] = np.arange(48) // 3  # row 0: documents of 3 tokens, row 1's are longer
    ref_out, ref_grads = jax.jit(output_and_grads, static_argnums=0)(
        dot_product_attention, q, k, v, seg, dout)
    mesh = build_mesh(ParallelDims(fsdp=2, context=2, tensor=2))
    kw = dict(mesh=mesh, layout="zigzag", kv_tile=4, rows="fsdp", heads="tensor")

    @jax.jit
    def ring(q, k, v, seg, dout):
        out, grads = output_and_grads(lambda *a: ra.ring_attention(*a, **kw), q, k, v, seg, dout)
        return out, grads, ra.ring_attention_blocks(q, k, v, seg, **kw)[1]

    perm = ra.layout_permutation("zigzag", 48, 2)
    out, grads, blocks = ring(*(x[:, perm] for x in (q, k, v, seg, dout)))
    undo = np.argsort(perm)
    # test_ring_matches_dense's float32 tolerance: online softmax vs dense's one pass.
    np.testing.assert_allclose(np.asarray(out)[:, undo], ref_out, rtol=0, atol=1e-5)
    for name, g, ref in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g)[:, undo], ref, rtol=0, atol=1e-5, err_msg=name)
    rows = [_blocks_that_meet(seg[r:r + 1, perm], "zigzag", 2, 4) for r in range(2)]
    assert sum(rows[0]) < sum(rows[1])  # the second device's row decides
    assert np.asarray(blocks).tolist() == np.max(rows, axis=0).tolist()


@pytest.mark.parametrize("context, window", [(1, None), (2, 7)])
def test_skipping_changes_no_bit(context, window, monkeypatch):
    """A skipped tile adds nothing to the online softmax: outputs and gradients with
    document-aware skipping are the very bits of the kernel that computes every
    scheduled tile (its meet table all true), on packed rows (tiled, ring, a window)."""
    q, k, v, seg, dout = random_inputs(48, 4, 2, packed=True)
    mesh = build_mesh(ParallelDims(fsdp=4, context=2)) if context > 1 else None
    kw = dict(mesh=mesh, kv_tile=4, window=window)
    perm = ra.layout_permutation("zigzag", 48, context)
    args = [x[:, perm] for x in (q, k, v, seg, dout)]

    def run():
        return jax.jit(lambda q, k, v, seg, dout: (
            *output_and_grads(lambda *a: ra.ring_attention(*a, **kw), q, k, v, seg, dout),
            ra.ring_attention_work(q, k, v, seg, **kw)[2]))(*args)

    out, grads, tiles = run()
    meet = ra._meet_table
    monkeypatch.setattr(ra, "_meet_table", lambda seg, sh: jnp.ones_like(meet(seg, sh)))
    every_out, every_grads, every_tiles = run()
    assert int(tiles.sum()) < int(every_tiles.sum())  # it did skip
    np.testing.assert_array_equal(out, every_out)
    for g, every in zip(grads, every_grads):
        np.testing.assert_array_equal(g, every)


def _blocks_that_meet(seg, layout, context, tile):
    """Per shard, the scheduled (query piece, key piece) blocks in which some row has a
    key tile whose segment ids overlap the query piece's range: what document-aware
    skipping must compute, counted plainly on the host (``seg`` in the layout's order)."""
    n_pieces = ra.PIECES[layout]
    piece = seg.shape[1] // (context * n_pieces)

    def chunk(shard, p):
        return shard if p == 0 else 2 * context - 1 - shard

    def part(shard, p):
        start = (shard * n_pieces + p) * piece
        return seg[:, start:start + piece]

    out = []
    for me in range(context):
        count = 0
        for owner in range(context):
            for a in range(n_pieces):
                for p in range(n_pieces):
                    if chunk(owner, p) > chunk(me, a):
                        continue  # after every query: never scheduled
                    q, k = part(me, a), part(owner, p).reshape(seg.shape[0], -1, tile)
                    lo = np.maximum(q.min(1)[:, None], k.min(2))
                    hi = np.minimum(q.max(1)[:, None], k.max(2))
                    count += bool((lo <= hi).any())
        out.append(count)
    return out


def test_zigzag_permutation():
    # 12 tokens, 3 shards: 6 chunks of 2; shard i holds chunks i and 5 - i.
    perm = ra.zigzag_permutation(12, 3)
    assert perm.tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert sorted(perm.tolist()) == list(range(12))
    assert ra.layout_permutation("contiguous", 12, 3) is None
    with pytest.raises(ValueError, match="not divisible by 2 \\* context = 6"):
        ra.zigzag_permutation(10, 3)


def test_memory_is_tiled_not_quadratic():
    """Forward + backward of one shard at 2048 tokens with 128-token key tiles holds
    far less than one (seq x seq) score matrix per head; dense holds several."""
    s, h, d = 2048, 4, 8
    q = jax.ShapeDtypeStruct((1, s, h, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, s, h, d), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, s), jnp.int32)

    def temp_bytes(attend):
        step = jax.jit(lambda q, k, v, seg, dout: output_and_grads(attend, q, k, v, seg, dout))
        return step.lower(q, kv, kv, seg, q).compile().memory_analysis().temp_size_in_bytes

    scores = s * s * h * 4  # one float32 score matrix over all heads: 64 MiB
    ring = temp_bytes(lambda *a: ra.ring_attention(*a, mesh=None, kv_tile=128))
    dense = temp_bytes(dot_product_attention)
    assert dense >= scores, (dense, scores)
    # Score tiles are (s/2 x 128) per head here; the rest is O(s). A quarter of
    # one score matrix is a loose bound that quadratic memory could not meet.
    assert ring < scores / 4, (ring, scores)


# ----- sliding windows ---------------------------------------------------------------------

# (context, layout, seq_len, heads, kv heads, kv_tile, window, scale): windows within
# one piece (3, 7) and across several (12, 20), none a divisor of the tile; packed rows.
WINDOW_CASES = [
    (1, "zigzag", 48, 4, 2, 4, 7, None),       # one shard: the tiled kernel
    (2, "zigzag", 48, 4, 2, 4, 7, None),       # pieces of 12
    (2, "contiguous", 48, 4, 1, 8, 20, 0.3),   # pieces of 24
    (4, "zigzag", 64, 4, 2, 4, 12, None),      # pieces of 8: the window spans 2 shards
    (4, "contiguous", 64, 4, 4, 8, 3, 0.2),    # pieces of 16
]


def _tiles_needed(seq_len, tile, window):
    """(query tile, key tile) pairs of the unpermuted sequence with some query and key
    at 0 <= q - k < window: the least any kernel that skips by tiles can compute."""
    first = np.arange(seq_len // tile) * tile
    q_lo, k_lo = first[:, None], first[None, :]
    return int(((k_lo <= q_lo + tile - 1) & (q_lo - (k_lo + tile - 1) < window)).sum())


def _blocks_needed(layout, context, seq_len, window):
    """Per shard, the (query piece, key piece) blocks with a key in some query's window."""
    piece = ra.piece_len(layout, seq_len, context)
    chunks = ([[i, 2 * context - 1 - i] for i in range(context)] if layout == "zigzag"
              else [[i] for i in range(context)])
    all_chunks = range(seq_len // piece)
    return [sum(k <= q and q * piece - (k * piece + piece - 1) < window
                for q in mine for k in all_chunks) for mine in chunks]


@pytest.mark.parametrize("context, layout, seq_len, heads, kv_heads, tile, window, scale",
                         WINDOW_CASES)
def test_windowed_ring_matches_dense(context, layout, seq_len, heads, kv_heads, tile, window,
                                     scale):
    """Outputs and gradients equal dense's with the same window and scale (packed rows);
    on one document the kernel computes exactly the tiles and blocks that reach into
    the window, no others (packed rows skip more: test_ring_matches_dense)."""
    spec = AttentionSpec(window=window, scale=scale)
    q, k, v, seg, dout = random_inputs(seq_len, heads, kv_heads, packed=True)
    ref_out, ref_grads = jax.jit(output_and_grads, static_argnums=0)(
        lambda *a: dot_product_attention(*a, spec), q, k, v, seg, dout)

    mesh = build_mesh(ParallelDims(fsdp=8 // context, context=context)) if context > 1 else None
    kw = dict(mesh=mesh, layout=layout, kv_tile=tile, window=window, scale=scale)

    @jax.jit
    def ring(q, k, v, seg, dout):
        out, grads = output_and_grads(lambda *a: ra.ring_attention(*a, **kw), q, k, v, seg, dout)
        return out, grads, *ra.ring_attention_work(q, k, v, jnp.zeros_like(seg), **kw)[1:]

    perm = ra.layout_permutation(layout, seq_len, context)
    perm = np.arange(seq_len) if perm is None else perm
    out, grads, blocks, tiles = ring(*(x[:, perm] for x in (q, k, v, seg, dout)))
    undo = np.argsort(perm)
    np.testing.assert_allclose(np.asarray(out)[:, undo], ref_out, rtol=0, atol=1e-5)
    for name, g, ref in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g)[:, undo], ref, rtol=0, atol=1e-5, err_msg=name)
    assert int(np.sum(tiles)) == _tiles_needed(seq_len, tile, window)
    assert np.asarray(blocks).tolist() == _blocks_needed(layout, context, seq_len, window)


def test_windowed_work_is_linear_in_the_sequence():
    """Tiles computed, counted as the kernel runs (the tiled kernel: one shard, 4-token
    tiles, window 10): twice the tokens, twice the tiles but for the first few. Without
    a window it computes (s/2/4)^2 x 3 tile pairs: 4x as many at twice the tokens."""
    def tiles(seq_len):
        q, k, v, seg, _ = random_inputs(seq_len, 2, 1, packed=False, b=1, d=4)
        work = jax.jit(lambda *a: ra.ring_attention_work(*a, mesh=None, kv_tile=4, window=10))
        return int(work(q, k, v, seg)[2].sum())

    short, long = tiles(64), tiles(128)
    assert (short, long) == (_tiles_needed(64, 4, 10), _tiles_needed(128, 4, 10)) == (58, 122)
    assert long - short == 16 * 4  # 16 more query tiles, 4 key tiles each


def test_a_window_as_long_as_the_sequence_is_the_causal_kernel():
    q, k, v, seg, _ = random_inputs(24, 4, 2, packed=True)
    kw = dict(mesh=None, kv_tile=4)
    np.testing.assert_array_equal(ra.ring_attention(q, k, v, seg, **kw, window=24),
                                  ra.ring_attention(q, k, v, seg, **kw))
