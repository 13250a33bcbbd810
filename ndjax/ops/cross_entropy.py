"""Next-token cross-entropy that never holds the whole batch's logits.

The LM head turns (b, s, dim) hidden states into (b, s, vocab) logits: at a
128k vocabulary and 4096 tokens that is 2 GiB per sequence in float32, plus a
one-hot of the same size, plus their gradients. ``loss_sums`` computes the
logits ``chunk`` positions at a time inside a ``lax.scan`` whose body is
rematerialised, so the backward pass recomputes each chunk's logits instead of
keeping them: memory grows with the chunk, not with the sequence.

Chunk ``j`` takes positions ``j, j + n, j + 2n, ...`` of every row (n chunks):
the loss is a sum over tokens, so any partition of them gives the same result,
and a strided one keeps each chunk split over the context axis exactly as the
sequence is (a chunk of consecutive positions would live on one context shard).
Logits stay vocab-parallel (split over ``tensor``) inside a chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ndjax.rules import constrain

HIDDEN = ("act_batch", "act_seq", "act_embed")
LOGITS = ("act_batch", "act_seq", "act_vocab")


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy in float32. A one-hot contraction rather than a
    gather keeps a vocab-sharded logits tensor sharded (the partitioner turns it
    into a local masked sum plus an all-reduce)."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1],
                                                   dtype=logits.dtype), axis=-1)
    return logz - target_logit


def num_chunks(seq_len: int, chunk: int) -> int:
    """How many chunks ``loss_sums`` cuts a row into (1: no chunking)."""
    return seq_len // chunk if seq_len > chunk else 1


def loss_sums(x: jax.Array, head: jax.Array, targets: jax.Array, weights: jax.Array,
              chunk: int) -> tuple[jax.Array, jax.Array]:
    """(sum of weights x cross-entropy, sum of weights), float32 scalars.

    x: (b, s, dim) final hidden states in the compute dtype; head: (dim, vocab) LM
    head in its compute layout; targets: (b, s) int; weights: (b, s) float32 (the
    loss mask). ``chunk`` must divide s when s > chunk (``Experiment`` checks).
    """
    dtype = x.dtype
    weights = weights.astype(jnp.float32)

    def chunk_loss(head32, xc, tc, wc):
        logits = jnp.einsum("bsd,dv->bsv", xc, head32.astype(dtype),
                            preferred_element_type=jnp.float32)
        return jnp.sum(cross_entropy(constrain(logits, LOGITS), tc) * wc)

    b, s, d = x.shape
    n = num_chunks(s, chunk)
    if n == 1:
        return chunk_loss(head, x, targets, weights), jnp.sum(weights)

    def strided(a):  # (b, s, ...) -> (n, b, s // n, ...): chunk j = positions j::n
        a = a.reshape(b, s // n, n, *a.shape[2:])
        return jnp.moveaxis(a, 2, 0)

    xs = constrain(strided(x), (None, *HIDDEN))
    # The head enters the scan in float32 so that its gradient is summed over the
    # chunks in float32 (a compute-dtype constant would accumulate in bfloat16).
    head32 = head.astype(jnp.float32)

    @jax.checkpoint
    def body(total, chunk_inputs):
        return total + chunk_loss(head32, *chunk_inputs), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (xs, strided(targets), strided(weights)))
    return total, jnp.sum(weights)
