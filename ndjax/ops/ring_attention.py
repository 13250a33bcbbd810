"""Ring attention over the ``context`` mesh axis: causal, load-balanced, packed documents,
optionally within a sliding window, with a score scale and with attention sinks.

Each context shard keeps its queries. Key/value blocks (kv heads only: grouped-query
attention is not expanded before the ring) travel around the ring with
``lax.ppermute``, one hop per ring step, and are combined with an online
(flash-style) softmax in float32. Inside a ring step each block is tiled over
keys (``kv_tile``), so the per-device score buffer is (local queries x tile) per
head, never (local x local): a 128k sequence on 8 shards never holds a 16k x 16k
score matrix.

The op is a ``jax.shard_map`` manual over every mesh axis: the sequence split
over the context axis, batch rows and heads as the caller says (``rows``,
``heads``: the rule table's split, ``ndjax.ops.attention.Ring``), so each device
attends on its own rows and heads; XLA's partitioner never sees the kernel's
conditionals (left to it, it gathered their operands on GPUs). Ring steps
1 .. c-2 run in a ``fori_loop``, so compile time and program size do not grow
with the number of shards.

Layouts: the sequence is cut into chunks; the layout says which chunks a shard holds.

* ``zigzag`` (balanced): 2c chunks; shard i holds chunks i and 2c-1-i, as two
  pieces. Under the causal mask every shard then computes the same number of
  piece x piece blocks, 2c+1. The batch's sequence must be permuted on the host
  with ``zigzag_permutation`` (``Experiment.device_batch`` does it).
* ``contiguous``: c chunks; shard i holds chunk i, no permutation. Shard i
  computes i+1 blocks, so the last shard does c times the work of the first.

Skipping: a (query piece, key piece) block whose key chunk comes after the query
chunk is entirely masked, and never computed. Which blocks are needed depends
only on whether the keys' owner is this shard, an earlier or a later one
(``OWN_BLOCKS``, ``_zigzag_blocks``): with zigzag every step after the first is
two blocks picked by index, with no branch; with contiguous a ``lax.cond``
skips a later shard's block. The mask inside a block is built from global
token indices (from the layout and the owner's index) and segment ids (which
travel with the keys), so it is exactly the dense mask: causal by index in the
unpermuted sequence, never across documents. Positions are not needed.

Documents (packed rows): a block, and each key tile in it, whose segment ids cannot
meet the query piece's (their ranges, in every row the device holds, do not overlap)
is all masked and is skipped too (``_meet_table``: one small gather of the tiles'
ranges per call, none per block). On rows of many short documents that leaves
little more than the diagonal blocks; on one long document it skips nothing. Each
skipped tile is a ``lax.cond``, the results are the same bits.

Windows (``window``: a query at p sees keys p - window < k <= p): a block is also
cut into query tiles, and each query tile visits only the key tiles its window
reaches, at most ``_reach(window, tile)`` of them, each under a ``lax.cond`` that
skips tiles past the block's edge; a block whose keys all lie beyond every
query's window (a ring step's, or zigzag's far own block) is skipped whole. Work
is then O(seq x (window + tile)) and memory stays O(local_len x tile); the ring
still makes every hop (the blocks travel on). ``ring_attention_work`` counts the
blocks and tile pairs each shard computed. Without a window the kernel runs the
same operations as before windows existed.

Backward: a ``jax.custom_vjp`` that runs the ring a second time, as
FlashAttention-2 and the ring-flash-attention reference do. The forward saves
only its inputs, the output and the rows' log-sum-exp (all O(local_len)); the
backward recomputes each block's probabilities tile by tile, accumulates dQ
locally and sends dK/dV around the ring with their key/value block, one last
hop bringing them home. Autodiff through a scan over ring steps would instead
save every step's key/value block (memory growing with the number of steps)
and every tile's probabilities (O(local_len^2) in all), which is what this op
exists to avoid.

Collective-permutes executed per call with c shards
(``expected_collective_permutes``): forward 3(c-1) (keys, values, segment ids);
backward 2(c-1) + c (keys and values stacked, segment ids, and the stacked
dK/dV, which make c hops to come home). Segment ids (4 bytes a token) are the
same in every layer and in both passes, so XLA may hoist their sends out of
the layer loop and share them between the passes (BENCHMARKS.md); keys and
values it cannot share (see ``_backward_local``).

Sinks (``sinks``, GPT-OSS: a logit per head that joins each row's softmax as a
column whose value is zero): folded into each row's running statistics once, after
every ring step and key tile, so that the log-sum-exp the forward saves includes
it. The backward of q, k and v is then exact as it is (delta_i = dout_i . out_i
sums P dP over the sink's column too, whose value is zero); the sink's own
gradient, -sum over rows and queries of exp(sink - lse_i) delta_i, is computed
from the output, log-sum-exp and output gradient on the whole arrays, outside the
shard_maps (``_sink_grad``), so the partitioner sums it over rows and shards.

On one context shard (``mesh=None``) the same kernel runs without collectives:
that is ``model.attn_impl=tiled`` (``ndjax.ops.attention`` chooses between kernels,
and runs this one on each device's rows and heads too).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from ndjax.ops import kernel_vjp
from ndjax.parallel import mesh as mesh_lib
from ndjax.parallel.rules import MeshAxes, Rules, axes_of

LAYOUTS = ("zigzag", "contiguous")
PIECES = {"zigzag": 2, "contiguous": 1}

# Which (query piece, key piece) blocks a shard computes when it holds the keys of
# shard ``owner``. A block is needed iff its key chunk <= its query chunk
# (diagonal blocks are masked inside).
#
# Zigzag, shard i holds chunks (i, 2c-1-i) as pieces 0 and 1. Its own keys:
# (0, 0), (1, 0), (1, 1). Keys of j != i, with u = [j > i]: (u, 0) and (1, u).
# For j < i, key piece 0 (chunk j) precedes both query chunks and key piece 1
# (chunk 2c-1-j > 2c-1-i >= c > i) follows both: (0, 0), (1, 0). For j > i,
# query piece 0 (chunk i < j < c <= 2c-1-j) sees neither key chunk and query
# piece 1 (chunk 2c-1-i >= c > j, and > 2c-1-j) sees both: (1, 0), (1, 1). So
# every later step is two blocks picked by index: the same code, no branch.
#
# Contiguous, one piece: own keys (0, 0); keys of j < i the full block (0, 0);
# keys of j > i nothing, a ``lax.cond`` that skips the block.
OWN_BLOCKS = {"zigzag": ((0, 0), (1, 0), (1, 1)), "contiguous": ((0, 0),)}


def _zigzag_blocks(me: jax.Array, owner: jax.Array) -> jax.Array:
    u = (owner > me).astype(jnp.int32)
    return jnp.stack([jnp.stack([u, jnp.int32(0)]), jnp.stack([jnp.int32(1), u])])


def zigzag_permutation(seq_len: int, context: int) -> np.ndarray:
    """Indices ``perm`` such that ``x[:, perm]`` is the zigzag layout of ``x``.

    Cut the sequence into 2 * context chunks; the permuted sequence is chunks
    0, 2c-1, 1, 2c-2, ..., so that context shard i (the i-th contiguous slice)
    holds chunks i and 2c-1-i. ``np.argsort(perm)`` undoes it.
    """
    if seq_len % (2 * context):
        raise ValueError(f"seq_len={seq_len} is not divisible by 2 * context = {2 * context}")
    chunk = seq_len // (2 * context)
    order = np.array([[i, 2 * context - 1 - i] for i in range(context)]).reshape(-1)
    return (order[:, None] * chunk + np.arange(chunk)).reshape(-1)


def layout_permutation(layout: str, seq_len: int, context: int) -> np.ndarray | None:
    """The host-side sequence permutation a layout needs (None: keep the order)."""
    _check_layout(layout)
    return zigzag_permutation(seq_len, context) if layout == "zigzag" else None


def piece_len(layout: str, seq_len: int, context: int) -> int:
    """Length of one piece: the unit of a block, which ``kv_tile`` must divide."""
    _check_layout(layout)
    return seq_len // (context * PIECES[layout])


def tile_len(piece: int, kv_tile: int) -> int:
    """The kv tile actually used: the whole piece if it is shorter than the tile."""
    tile = min(piece, kv_tile)
    if tile < 1 or piece % tile:
        raise ValueError(f"kv_tile={kv_tile} does not divide the block length {piece}")
    return tile


def blocks_per_shard(layout: str, context: int) -> list[int]:
    """Blocks (piece x piece) each shard computes under the causal mask, by design."""
    _check_layout(layout)
    own = len(OWN_BLOCKS[layout])
    if layout == "zigzag":  # then 2 per other shard
        return [own + 2 * (context - 1)] * context
    return [own + i for i in range(context)]  # then 1 per earlier shard


def expected_collective_permutes(context: int) -> dict[str, int]:
    """Collective-permutes of one attention call: the design's count (see module doc)."""
    hops = context - 1
    return {"forward": 3 * hops, "backward": 2 * hops + context if context > 1 else 0}


def context_shards(rules: Rules | None) -> int:
    """Shards of the sequence inside attention: the context degree, if the rule
    table splits ``act_seq`` over the context axis, else 1."""
    if rules is None or "context" not in rules.axes_of("act_seq"):
        return 1
    return rules.mesh.shape["context"]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {LAYOUTS}")


# ----- one shard's work --------------------------------------------------------------------


def _token_index(owner, layout: str, context: int, piece: int) -> jax.Array:
    """Global (unpermuted) index of each local token of shard ``owner``."""
    t = jnp.arange(piece, dtype=jnp.int32)
    if layout == "contiguous":
        return owner * piece + t
    return jnp.concatenate([owner * piece + t, (2 * context - 1 - owner) * piece + t])


def scale_scores(s: jax.Array, scale: float | None, head_dim: int) -> jax.Array:
    """Scores times ``scale``; None: divided by sqrt(head_dim), the very operation
    ndjax's kernels ran before a scale could be set (the same bits)."""
    return s / math.sqrt(head_dim) if scale is None else s * scale


def allowed(q_idx, q_seg, k_idx, k_seg, window: int | None = None) -> jax.Array:
    """(b, q, t): causal in the unpermuted sequence, within ``window`` (q - k < window)
    and within one document."""
    seen = q_idx[:, None] >= k_idx[None, :]
    if window is not None:
        seen &= q_idx[:, None] - k_idx[None, :] < window
    return seen[None] & (q_seg[:, :, None] == k_seg[:, None, :])


def _ranges(seg: jax.Array, parts: int) -> tuple[jax.Array, jax.Array]:
    """Each row's least and greatest segment id in each of ``parts`` equal parts of
    its last axis: (..., parts) each."""
    x = seg.reshape(*seg.shape[:-1], parts, seg.shape[-1] // parts)
    return x.min(-1), x.max(-1)


def _meet_table(seg: jax.Array, sh: _Shard) -> jax.Array:
    """Document-aware skipping: whether query piece a of this shard and key tile t of
    piece p of shard o hold a common segment id in any row, as bools (a, o, p, t).
    Ranges that do not overlap hold no common id, so a (block or tile) pair they rule
    out is all masked: skipping it changes no bit of the result. On packed rows of
    short documents most pairs away from the diagonal are such. One small gather of
    the tiles' ranges over the ring and one reduction over the rows per call, not one
    per block."""
    b, n = seg.shape
    pieces, tiles = n // sh.piece, sh.piece // sh.tile
    q_lo, q_hi = _ranges(seg, pieces)                                  # (b, a)
    k_lo, k_hi = (x.reshape(b, pieces, tiles) for x in _ranges(seg, pieces * tiles))
    if sh.context > 1:
        k_lo, k_hi = (lax.all_gather(x, sh.axis) for x in (k_lo, k_hi))   # (o, b, p, t)
    else:
        k_lo, k_hi = k_lo[None], k_hi[None]
    lo = jnp.maximum(q_lo[None, :, :, None, None], k_lo[:, :, None])   # (o, b, a, p, t)
    hi = jnp.minimum(q_hi[None, :, :, None, None], k_hi[:, :, None])
    return (lo <= hi).any(1).transpose(1, 0, 2, 3)


def _tiles(tile: int, k, v, k_idx, k_seg):
    """Key-side arrays cut into tiles along a new leading axis, for ``lax.scan``."""
    b, n = k.shape[0], k.shape[1] // tile
    split = lambda x: x.reshape(b, n, tile, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
    return split(k), split(v), k_idx.reshape(n, tile), split(k_seg)


def _online_update(carry, q, q_idx, q_seg, kt, vt, it, st, window, scale):
    """Online-softmax update of (o, m, den) for queries ``q`` against one key tile."""
    o, m, den = carry        # (b, kv, g, q, d), (b, kv, g, q), (b, kv, g, q), float32
    s = jnp.einsum("bqkgd,btkd->bkgqt", q, kt, preferred_element_type=jnp.float32)
    s = scale_scores(s, scale, q.shape[-1])
    s = jnp.where(allowed(q_idx, q_seg, it, st, window)[:, None, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    # A row with no allowed key so far keeps m = -inf; shift by 0 instead so
    # that exp() gives 0, not NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    rescale = jnp.exp(m - m_safe)
    den = den * rescale + p.sum(-1)
    o = o * rescale[..., None] + jnp.einsum("bkgqt,btkd->bkgqd", p.astype(vt.dtype), vt,
                                            preferred_element_type=jnp.float32)
    return o, m_new, den


def _tile_backward(dq, q, do, lse, delta, q_idx, q_seg, kt, vt, it, st, window, scale):
    """FlashAttention-2 backward of queries ``q`` against one key tile: (dq, dk, dv)."""
    d = q.shape[-1]
    s = scale_scores(jnp.einsum("bqkgd,btkd->bkgqt", q, kt, preferred_element_type=jnp.float32),
                     scale, d)
    mask = allowed(q_idx, q_seg, it, st, window)[:, None, None]
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)   # the forward's probabilities
    dv = jnp.einsum("bkgqt,bqkgd->btkd", p.astype(do.dtype), do,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgd,btkd->bkgqt", do, vt, preferred_element_type=jnp.float32)
    ds = scale_scores(p * (dp - delta[..., None]), scale, d)
    dq = dq + jnp.einsum("bkgqt,btkd->bqkgd", ds.astype(kt.dtype), kt,
                         preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqt,bqkgd->btkd", ds.astype(q.dtype), q,
                    preferred_element_type=jnp.float32)
    return dq, dk, dv


def _block_forward(carry, q, q_idx, q_seg, k, v, k_idx, k_seg, tile: int,
                   window: int | None = None, scale: float | None = None, meet=None):
    """Online-softmax update of (o, m, den) for queries ``q`` against one key block:
    (the updated carry, key tiles x query tiles computed). ``meet`` (key tiles,):
    whether each key tile may share a document with the queries (``_meet_table``);
    the tiles it rules out are skipped."""
    n = k.shape[1] // tile
    meet = jnp.ones((n,), bool) if meet is None else meet
    if window is not None:
        return _window_block_forward(carry, q, q_idx, q_seg, k, v, k_idx, k_seg, tile,
                                     window, scale, meet)

    def step(acc, xs):
        carry, count = acc
        *kt, go = xs
        carry = lax.cond(go, lambda c: _online_update(c, q, q_idx, q_seg, *kt, None, scale),
                         lambda c: c, carry)
        return (carry, count + go), None

    def compute(carry):
        acc = (carry, jnp.zeros_like(q_idx[0]))
        (carry, count), _ = lax.scan(step, acc, (*_tiles(tile, k, v, k_idx, k_seg), meet))
        return carry, count * n

    return lax.cond(meet.any(), compute, lambda c: (c, jnp.zeros_like(q_idx[0])), carry)


def _block_backward(dq, q, do, lse, delta, q_idx, q_seg, k, v, k_idx, k_seg, tile: int,
                    window: int | None = None, scale: float | None = None, meet=None):
    """FlashAttention-2 backward of one block: dq accumulated, (dk, dv) of the block;
    the key tiles ``meet`` rules out skipped (zeros)."""
    n = k.shape[1] // tile
    meet = jnp.ones((n,), bool) if meet is None else meet
    if window is not None:
        return _window_block_backward(dq, q, do, lse, delta, q_idx, q_seg, k, v, k_idx, k_seg,
                                      tile, window, scale, meet)

    def step(dq, xs):
        *kt, go = xs
        zeros = jnp.zeros_like(kt[0], jnp.float32)
        dq, dk, dv = lax.cond(
            go, lambda dq: _tile_backward(dq, q, do, lse, delta, q_idx, q_seg, *kt, None, scale),
            lambda dq: (dq, zeros, zeros), dq)
        return dq, (dk, dv)

    def compute(dq):
        dq, (dk, dv) = lax.scan(step, dq, (*_tiles(tile, k, v, k_idx, k_seg), meet))
        join = lambda x: x.swapaxes(0, 1).reshape(k.shape[0], -1, *x.shape[3:])  # noqa: E731
        return dq, join(dk), join(dv)

    def skip(dq):
        zeros = jnp.zeros_like(k, jnp.float32)
        return dq, zeros, zeros

    return lax.cond(meet.any(), compute, skip, dq)


# ----- sliding windows: query tiles, and only the key tiles their window reaches ---------------
#
# With a window, a (query piece, key piece) block is cut into query tiles too (the key
# tile's length). Pieces are contiguous chunks of the unpermuted sequence whose
# lengths the tile divides, so a query tile's last token and the key tile holding it
# (its "diagonal" tile) line up, and the key tiles its window reaches are the
# ``_reach`` tiles ending there, clipped to the block. Only those are visited, each
# in a ``lax.cond`` that skips the clipped ones: per query tile at most ``_reach``
# tiles, so the work is O(seq x (window + tile)), not O(seq^2). A block whose keys all
# lie beyond every query's window is skipped whole.


def _reach(window: int, tile: int) -> int:
    """Key tiles a query tile's window touches: its diagonal tile and the ones before
    that hold keys within ``window`` of its first query."""
    return -(-(window - 1) // tile) + 1


def _split(x: jax.Array, tile: int, axis: int) -> jax.Array:
    """``x`` cut into tiles along ``axis``, the tiles on a new leading axis."""
    shape = x.shape
    return jnp.moveaxis(x.reshape(*shape[:axis], shape[axis] // tile, tile,
                                  *shape[axis + 1:]), axis, 0)


def _join(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of ``_split``."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _in_window(q_idx, k_idx, window: int) -> jax.Array:
    """Whether any key of a block is within the window of any of its queries (both
    pieces contiguous; the schedule never pairs queries with later keys)."""
    return q_idx[0] - k_idx[-1] < window


def _key_tiles(q_idx, k_idx, n: int, tile: int, window: int):
    """For query tile ``a`` of a block: (first key tile its window reaches, last one),
    both inside the block's n tiles; first > last where it reaches none."""
    diag0 = (q_idx[0] - k_idx[0]) // tile  # key tile of query tile 0's tokens (may be >= n)

    def bounds(a):
        diag = diag0 + a
        return jnp.maximum(diag - _reach(window, tile) + 1, 0), jnp.minimum(diag, n - 1)

    return bounds


def _window_block_forward(carry, q, q_idx, q_seg, k, v, k_idx, k_seg, tile, window, scale,
                          meet):
    n = q.shape[1] // tile
    bounds = _key_tiles(q_idx, k_idx, n, tile, window)
    take = lambda x, j, axis: lax.dynamic_slice_in_dim(x, j * tile, tile, axis)  # noqa: E731

    def query_tile(count, xs):
        a, qt, it, st, *stats = xs
        lo, hi = bounds(a)

        def key_tile(acc, step):
            stats, count = acc
            j = jnp.minimum(lo + step, n - 1)
            kt = (take(k, j, 1), take(v, j, 1), take(k_idx, j, 0), take(k_seg, j, 1))
            go = (lo + step <= hi) & meet[j]
            stats = lax.cond(go, lambda s: _online_update(s, qt, it, st, *kt, window, scale),
                             lambda s: s, stats)
            return (stats, count + go), None

        steps = jnp.arange(min(n, _reach(window, tile)))
        (stats, count), _ = lax.scan(key_tile, (tuple(stats), count), steps)
        return count, stats

    def compute(carry):
        o, m, den = carry
        xs = (jnp.arange(n), _split(q, tile, 1), _split(q_idx, tile, 0), _split(q_seg, tile, 1),
              _split(o, tile, 3), _split(m, tile, 3), _split(den, tile, 3))
        count, stats = lax.scan(query_tile, jnp.zeros_like(q_idx[0]), xs)
        return tuple(_join(x, 3) for x in stats), count

    return lax.cond(_in_window(q_idx, k_idx, window) & meet.any(), compute,
                    lambda carry: (carry, jnp.zeros_like(q_idx[0])), carry)


def _window_block_backward(dq, q, do, lse, delta, q_idx, q_seg, k, v, k_idx, k_seg, tile,
                           window, scale, meet):
    n = q.shape[1] // tile
    bounds = _key_tiles(q_idx, k_idx, n, tile, window)
    take = lambda x, j, axis: lax.dynamic_slice_in_dim(x, j * tile, tile, axis)  # noqa: E731

    def query_tile(dkv, xs):
        a, qt, dot, lset, dt, it, st, dqt = xs
        lo, hi = bounds(a)

        def key_tile(acc, step):
            dqt, dkv = acc
            j = jnp.minimum(lo + step, n - 1)
            kt = (take(k, j, 1), take(v, j, 1), take(k_idx, j, 0), take(k_seg, j, 1))
            zeros = jnp.zeros_like(kt[0], jnp.float32)
            dqt, dk, dv = lax.cond(
                (lo + step <= hi) & meet[j],
                lambda dqt: _tile_backward(dqt, qt, dot, lset, dt, it, st, *kt, window, scale),
                lambda dqt: (dqt, zeros, zeros), dqt)
            # Only the tile's own slice of dK/dV is touched: a skipped tile adds zeros.
            dkv = lax.dynamic_update_slice_in_dim(dkv, take(dkv, j, 2) + jnp.stack([dk, dv]),
                                                  j * tile, 2)
            return (dqt, dkv), None

        steps = jnp.arange(min(n, _reach(window, tile)))
        (dqt, dkv), _ = lax.scan(key_tile, (dqt, dkv), steps)
        return dkv, dqt

    def compute(dq):
        xs = (jnp.arange(n), _split(q, tile, 1), _split(do, tile, 1), _split(lse, tile, 3),
              _split(delta, tile, 3), _split(q_idx, tile, 0), _split(q_seg, tile, 1),
              _split(dq, tile, 1))
        dkv, dq = lax.scan(query_tile, jnp.zeros_like(jnp.stack([k, v]), jnp.float32), xs)
        return _join(dq, 1), dkv[0], dkv[1]

    def skip(dq):
        zeros = jnp.zeros_like(k, jnp.float32)
        return dq, zeros, zeros

    return lax.cond(_in_window(q_idx, k_idx, window) & meet.any(), compute, skip, dq)


class _Shard:
    """What one context shard knows: its index, the layout, the ring."""

    def __init__(self, axis: str, context: int, layout: str, tile: int, local_len: int):
        self.axis, self.context, self.layout, self.tile = axis, context, layout, tile
        self.piece = local_len // PIECES[layout]
        self.me = lax.axis_index(axis) if context > 1 else jnp.int32(0)

    def get(self, x, piece, axis: int) -> jax.Array:
        """Piece ``piece`` (a traced index) of ``x`` along ``axis``."""
        return lax.dynamic_slice_in_dim(x, piece * self.piece, self.piece, axis)

    def put(self, x, value, piece, axis: int) -> jax.Array:
        return lax.dynamic_update_slice_in_dim(x, value, piece * self.piece, axis)

    def blocks(self, compute, blocks, carry):
        """Runs ``compute(carry, query piece, key piece)`` for each row of ``blocks``
        (an int array (n, 2)) in a scan: one copy of the block code for any n."""
        return lax.scan(lambda carry, blk: (compute(carry, blk[0], blk[1]), None),
                        carry, blocks)[0]

    def index(self, owner) -> jax.Array:
        return _token_index(owner, self.layout, self.context, self.piece)

    def send(self, x):
        """One hop around the ring: shard j -> shard j + 1."""
        c = self.context
        return lax.ppermute(x, self.axis, perm=[(j, (j + 1) % c) for j in range(c)])

    def ring(self, compute, carry, block, *, returning=None):
        """Runs ``compute(blocks, carry, block, k_idx, owner) -> carry`` at each ring step.

        ``block`` (this shard's keys, values, segment ids) moves one hop per step,
        sent before the step's compute so that the two overlap. ``returning``
        names a carry entry (the block's gradients) that travels with the block
        and makes one more hop after the last step, home.
        """
        c = self.context

        def step(r, carry, block, last: bool):
            incoming = None if last else self.send(block)
            if isinstance(r, int) and r == 0:
                own = jnp.array(OWN_BLOCKS[self.layout], jnp.int32)
                carry = compute(own, carry, block, self.index(self.me), self.me)
            else:
                owner = (self.me - r) % c
                k_idx = self.index(owner)
                if self.layout == "zigzag":
                    carry = compute(_zigzag_blocks(self.me, owner), carry, block, k_idx, owner)
                else:
                    full = jnp.zeros((1, 2), jnp.int32)
                    carry = lax.cond(owner < self.me, functools.partial(compute, full),
                                     lambda carry, *_: carry, carry, block, k_idx, owner)
            if returning is not None and c > 1:
                carry = {**carry, returning: self.send(carry[returning])}
            return carry, incoming

        carry, block = step(0, carry, block, last=c == 1)
        if c > 2:  # steps 1 .. c-2: one loop body whatever c is
            carry, block = lax.fori_loop(
                1, c - 1, lambda r, cb: step(r, *cb, last=False), (carry, block))
        if c > 1:
            carry, _ = step(c - 1, carry, block, last=True)
        return carry


def _with_sink(o, m, den, sinks):
    """Running statistics (o, m, den) with the sink's column joined: logit ``sinks``
    (kv, g), value zero. Once, after every key: per ring step it would count it c times."""
    s = sinks.astype(jnp.float32)[None, :, :, None]
    m_new = jnp.maximum(m, s)  # finite: a row's sink is always there
    rescale = jnp.exp(m - m_new)
    return o * rescale[..., None], m_new, den * rescale + jnp.exp(s - m_new)


def _sink_grad(sinks, out, lse, dout) -> jax.Array:
    """The sinks' gradient (h,): -sum over rows and queries of exp(sink - lse_i)
    delta_i, delta_i = dout_i . out_i, with ``lse`` (b, kv, g, n) the rows' log-sum-exp
    with the sink (the probability of its column is exp(sink - lse))."""
    b, kv, g, n = lse.shape
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    delta = delta.reshape(b, n, kv, g).transpose(0, 2, 3, 1)
    p = jnp.exp(sinks.astype(jnp.float32).reshape(1, kv, g, 1) - lse)
    return -(p * delta).sum((0, 3)).reshape(kv * g).astype(sinks.dtype)


def _forward_local(q, k, v, seg, sinks=None, *, axis: str, context: int, layout: str,
                   tile: int, window: int | None, scale: float | None):
    """One shard's forward: (out, lse, [blocks computed, query x key tiles computed]).
    ``sinks`` (this device's heads,): joined once, after the ring (``_with_sink``)."""
    b, n, h, d = q.shape
    kv = k.shape[2]
    sh = _Shard(axis, context, layout, tile, n)
    q5 = q.reshape(b, n, kv, h // kv, d)
    q_idx = sh.index(sh.me)
    stats = (b, kv, h // kv, n)
    init = {"o": jnp.zeros((*stats, d), jnp.float32),
            "m": jnp.full(stats, -jnp.inf, jnp.float32),
            "den": jnp.zeros(stats, jnp.float32),
            "blocks": jnp.zeros((), jnp.int32),
            "tiles": jnp.zeros((), jnp.int32)}

    meet = _meet_table(seg, sh)

    def compute(blocks, carry, block, k_idx, owner):
        k, v, k_seg = block

        def one(carry, a, c):
            stats = tuple(sh.get(carry[x], a, 3) for x in ("o", "m", "den"))
            stats, tiles = _block_forward(stats, sh.get(q5, a, 1), sh.get(q_idx, a, 0),
                                          sh.get(seg, a, 1), sh.get(k, c, 1), sh.get(v, c, 1),
                                          sh.get(k_idx, c, 0), sh.get(k_seg, c, 1), sh.tile,
                                          window, scale, meet[a, owner, c])
            # A block counts where it computed a tile (a window may skip it whole).
            return {**{x: sh.put(carry[x], y, a, 3) for x, y in zip(("o", "m", "den"), stats)},
                    "blocks": carry["blocks"] + jnp.minimum(tiles, 1),
                    "tiles": carry["tiles"] + tiles}

        return sh.blocks(one, blocks, carry)

    carry = sh.ring(compute, init, (k, v, seg))
    o, m, den = carry["o"], carry["m"], carry["den"]
    if sinks is not None:
        o, m, den = _with_sink(o, m, den, sinks.reshape(kv, h // kv))
    out = (o / den[..., None]).transpose(0, 3, 1, 2, 4).reshape(b, n, h, d)
    lse = m + jnp.log(den)
    return out.astype(q.dtype), lse, jnp.stack([carry["blocks"], carry["tiles"]])


def _backward_local(q, k, v, seg, out, lse, dout, *, axis: str, context: int, layout: str,
                    tile: int, window: int | None, scale: float | None):
    """One shard's backward: (dq, dk, dv) of its own queries, keys and values.

    Keys and values travel stacked as one array here (and dK, dV likewise): one
    collective per hop instead of two, and, being different instructions from
    the forward's sends, XLA cannot merge the two rings, which would keep every
    received block alive from the forward to the backward.
    """
    b, n, h, d = q.shape
    kv = k.shape[2]
    sh = _Shard(axis, context, layout, tile, n)
    q5 = q.reshape(b, n, kv, h // kv, d)
    do5 = dout.reshape(b, n, kv, h // kv, d)
    # delta_i = sum_j P_ij dP_ij = dout_i . out_i, laid out like lse: (b, kv, g, n).
    delta = jnp.sum(do5.astype(jnp.float32) * out.reshape(q5.shape).astype(jnp.float32),
                    axis=-1).transpose(0, 2, 3, 1)
    q_idx = sh.index(sh.me)
    init = {"dq": jnp.zeros(q5.shape, jnp.float32),
            "dkv": jnp.zeros((2, *k.shape), jnp.float32)}

    meet = _meet_table(seg, sh)

    def compute(blocks, carry, block, k_idx, owner):
        (k, v), k_seg = block

        def one(carry, a, c):
            dq, dkv = carry["dq"], carry["dkv"]
            dq_a, dk, dv = _block_backward(
                sh.get(dq, a, 1), sh.get(q5, a, 1), sh.get(do5, a, 1), sh.get(lse, a, 3),
                sh.get(delta, a, 3), sh.get(q_idx, a, 0), sh.get(seg, a, 1), sh.get(k, c, 1),
                sh.get(v, c, 1), sh.get(k_idx, c, 0), sh.get(k_seg, c, 1), sh.tile, window,
                scale, meet[a, owner, c])
            dkv_c = sh.get(dkv, c, 2) + jnp.stack([dk, dv])
            return {"dq": sh.put(dq, dq_a, a, 1), "dkv": sh.put(dkv, dkv_c, c, 2)}

        return sh.blocks(one, blocks, carry)

    carry = sh.ring(compute, init, (jnp.stack([k, v]), seg), returning="dkv")
    dk, dv = carry["dkv"]
    return (carry["dq"].reshape(b, n, h, d).astype(q.dtype), dk.astype(k.dtype),
            dv.astype(v.dtype))


# ----- the op ------------------------------------------------------------------------------


def _one(axes: tuple[str, ...]) -> MeshAxes:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _manual(mesh: Mesh, axis: str, rows: tuple[str, ...], heads: tuple[str, ...],
            forward, backward, sinks: bool = False):
    """``forward`` and ``backward`` as shard_maps manual over every axis of ``mesh``:
    the sequence split over ``axis``, batch rows over ``rows``, heads over ``heads``,
    whatever else replicated. Manual over the context axis alone, XLA's partitioner
    placed the rest, and on GPUs it gathered the tiles' operands (all rows, all
    heads) inside each skipping ``lax.cond`` (tens of all-gathers per step, compiled
    for H100s: tests/test_gpu_compile.py). check_vma=False: every device computes on
    its own rows and heads, nothing in the ring reduces over them. The work counts
    come back per device, context-major (``ring_attention_work``). ``sinks``: the
    forward takes the sink logits too, split like the heads."""
    if axis in rows + heads or set(rows) & set(heads):
        raise ValueError(f"ring attention: rows over {rows}, heads over {heads} and the "
                         f"sequence over {axis!r} need distinct mesh axes")
    r, h = _one(rows), _one(heads)
    seq = PartitionSpec(r, axis, h)  # q, k, v, the output and their gradients
    ids, lse = PartitionSpec(r, axis), PartitionSpec(r, h, None, axis)
    # Not over pipeline stages: the pipeline vmaps the layers over them (spmd_axis_name),
    # and adds ``stage`` to every spec itself.
    staged = ("stage",) if mesh_lib.stages(mesh) > 1 else ()
    counts = PartitionSpec((axis, *(a for a in mesh.axis_names if a not in (axis, *staged))))
    shard = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    sink = (PartitionSpec(h),) if sinks else ()  # the sink logits, split like the heads
    forward = shard(forward, in_specs=(seq, seq, seq, ids, *sink), out_specs=(seq, lse, counts))
    backward = shard(backward, in_specs=(seq, seq, seq, ids, seq, lse, seq),
                     out_specs=(seq, seq, seq))
    return forward, backward


@functools.cache
def _build(mesh: Mesh | None, axis: str, layout: str, kv_tile: int, seq_len: int,
           window: int | None = None, scale: float | None = None, rows: MeshAxes = None,
           heads: MeshAxes = None, sinks: bool = False):
    """(attention with its custom VJP, forward that also returns its work per device).
    ``sinks``: both take the sink logits as a fifth argument (without, the kernel is
    the sink-free one exactly)."""
    _check_layout(layout)
    if window is not None and window < 1:
        raise ValueError(f"window={window}: a query sees at least itself (window >= 1)")
    if window is not None and window >= seq_len:
        window = None  # every earlier key is within it: the plain causal kernel
    context = 1 if mesh is None else mesh.shape[axis]
    if seq_len % (context * PIECES[layout]):
        raise ValueError(f"sequence length {seq_len} is not divisible by {PIECES[layout]} x "
                         f"{context} context shards (layout {layout!r})")
    tile = tile_len(piece_len(layout, seq_len, context), kv_tile)
    kw = dict(axis=axis, context=context, layout=layout, tile=tile, window=window, scale=scale)
    forward = functools.partial(_forward_local, **kw)
    backward = functools.partial(_backward_local, **kw)
    if context > 1:
        forward, backward = _manual(mesh, axis, axes_of(rows), axes_of(heads), forward, backward,
                                    sinks)

    def attend_fwd(*args):
        out, lse, _ = forward(*args)
        return out, lse, None

    def attend_bwd(args, out, lse, _, dout):
        q, k, v, seg, *sink = args
        grads = (*backward(q, k, v, seg, out, lse, dout), None)  # none for the segment ids
        return grads + tuple(_sink_grad(s, out, lse, dout) for s in sink)

    return kernel_vjp.named_residuals(attend_fwd, attend_bwd), forward


def _hashable(rows: MeshAxes, heads: MeshAxes) -> tuple[MeshAxes, MeshAxes]:
    """``_build``'s cache keys: a list of axes as a tuple."""
    return _one(axes_of(rows)), _one(axes_of(heads))


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                   mesh: Mesh | None, axis: str = "context", layout: str = "zigzag",
                   kv_tile: int = 512, window: int | None = None,
                   scale: float | None = None, rows: MeshAxes = None,
                   heads: MeshAxes = None, sinks: jax.Array | None = None) -> jax.Array:
    """Causal grouped-query attention over packed documents, sequence split over ``axis``.

    Same contract as ``ndjax.ops.attention.dense`` on the *unpermuted* sequence; with
    ``layout='zigzag'`` the inputs' sequence axis must be in zigzag order
    (``zigzag_permutation``) and so is the output. q: (b, s, h, d); k, v: (b, s, kv, d);
    segment_ids: (b, s). ``mesh=None`` or a context axis of size 1 runs the same tiled
    kernel on one shard, without collectives. ``window``: a query at p sees keys
    p - window < k <= p only (``AttentionSpec.window``); ``scale``: the scores' factor,
    None: 1 / sqrt(d). ``rows``, ``heads``: the mesh axes the batch rows and the heads
    of q, k and v are split over (each device's query heads with the kv heads they
    read), as the rule table splits them; each device then attends on its own rows
    and heads (``_manual``). Any other split of the inputs is gathered first.
    ``sinks`` (h,): each head's sink logit (any float dtype, computed in float32; its
    gradient in its dtype), split over ``heads`` like q's heads.
    """
    attend, _ = _build(mesh, axis, layout, kv_tile, q.shape[1], window, scale,
                       *_hashable(rows, heads), sinks is not None)
    return attend(q, k, v, segment_ids, *(() if sinks is None else (sinks,)))


def ring_attention_work(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                        mesh: Mesh | None, axis: str = "context", layout: str = "zigzag",
                        kv_tile: int = 512, window: int | None = None,
                        scale: float | None = None, rows: MeshAxes = None,
                        heads: MeshAxes = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Forward only: (output, blocks and (query tile, key tile) pairs computed by each
    context shard, both shape (context,)), counted as the kernel runs, so the figures
    measure what it really skipped. A block is one query piece against one key piece
    (``piece_len``), (piece / tile)^2 tile pairs; with a window only the blocks and
    tiles that reach into it are computed. Where a context shard's rows or heads are
    split over more devices (``rows``, ``heads``), each skips by its own rows: a
    shard's figure is its busiest device's."""
    _, forward = _build(mesh, axis, layout, kv_tile, q.shape[1], window, scale,
                        *_hashable(rows, heads))
    out, _, counts = forward(q, k, v, segment_ids)
    counts = counts.reshape(1 if mesh is None else mesh.shape[axis], -1, 2).max(1)
    return out, counts[:, 0], counts[:, 1]


def ring_attention_blocks(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                          mesh: Mesh | None, axis: str = "context", layout: str = "zigzag",
                          kv_tile: int = 512, window: int | None = None,
                          scale: float | None = None, rows: MeshAxes = None,
                          heads: MeshAxes = None) -> tuple[jax.Array, jax.Array]:
    """Forward only: (output, blocks computed by each context shard, shape (context,));
    see ``ring_attention_work``."""
    out, blocks, _ = ring_attention_work(q, k, v, segment_ids, mesh=mesh, axis=axis,
                                         layout=layout, kv_tile=kv_tile, window=window,
                                         scale=scale, rows=rows, heads=heads)
    return out, blocks
