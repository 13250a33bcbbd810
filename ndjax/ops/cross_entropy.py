"""Next-token cross-entropy, fused with the LM head, that never holds the batch's logits.

The LM head turns (b, s, dim) hidden states into (b, s, vocab) logits: at a
128k vocabulary and 4096 tokens that is 2 GiB per sequence in float32, plus a
one-hot and the gradients of the same size. ``loss_sums`` instead runs the head
and the loss over ``chunk`` positions at a time in a ``lax.scan``, and its
backward pass (a custom VJP) recomputes each chunk's logits, turns them into the
logits' gradient (softmax - one-hot) and consumes it at once: memory grows with
the chunk, not with the sequence.

The work is per device: a ``jax.shard_map`` over the mesh axes that split the
batch and the sequence, with ``tensor`` left to the partitioner so that the
logits stay vocab-parallel. Each device sums the head's gradient over its own
chunks in a float32 accumulator, and the data axes reduce it once, in float32,
at the end, rather than once per chunk (which autodiff of a chunked scan does)
or in bfloat16: a reduce-scatter straight into the head's storage layout (FSDP
shards it over the data axes), so that no device receives the whole sum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ndjax.parallel.rules import (
    ParamUse,
    Weight,
    active,
    data_axes,
    partials_out,
    partials_spec,
    partials_sum,
    scatter,
)


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


def _chunks(a: jax.Array, n: int) -> jax.Array:
    """(b, s, ...) -> (n, b, s // n, ...): chunk j = local positions [j s/n, (j+1) s/n)."""
    b, s = a.shape[:2]
    return jnp.moveaxis(a.reshape(b, n, s // n, *a.shape[2:]), 1, 0)


def _unchunk(a: jax.Array) -> jax.Array:
    n, b, c = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(b, n * c, *a.shape[3:])


class _Local:
    """The per-device loss and its gradients; ``vocab_spec`` constrains logits to
    stay split over the vocabulary's (non-data) mesh axes."""

    def __init__(self, n: int, vocab_spec: PartitionSpec | None):
        self.n, self.vocab_spec = n, vocab_spec

    def logits(self, xc, head):
        logits = jnp.einsum("bsd,dv->bsv", xc, head, preferred_element_type=jnp.float32)
        if self.vocab_spec is not None:
            logits = jax.lax.with_sharding_constraint(logits, self.vocab_spec)
        return logits

    def loss(self, x, head, targets, weights):
        def body(total, chunk):
            xc, tc, wc = chunk
            return total + jnp.sum(cross_entropy(self.logits(xc, head), tc) * wc), None

        total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                                (_chunks(x, self.n), _chunks(targets, self.n),
                                 _chunks(weights, self.n)))
        return total

    def token_log_probs(self, x, head, targets):
        """(log p(target) per position, the mean of its logits over the vocabulary), both
        (b, s) float32: a preference or RL objective's inputs."""
        def body(_, chunk):
            xc, tc = chunk
            logits = self.logits(xc, head)
            return None, (-cross_entropy(logits, tc), jnp.mean(logits, axis=-1))

        _, (logps, means) = jax.lax.scan(body, None, (_chunks(x, self.n),
                                                      _chunks(targets, self.n)))
        return _unchunk(logps), _unchunk(means)

    def loss_and_probs(self, x, head, targets, weights):
        """One chunk (``n == 1``): the loss and the softmax of its logits, which the
        backward pass then takes instead of running the LM head again."""
        logits = self.logits(x, head)
        logz = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        probs = jnp.exp(logits - logz)
        target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1],
                                                       dtype=logits.dtype), axis=-1)
        return jnp.sum((logz[..., 0] - target_logit) * weights), probs

    def grads(self, x, head, targets, weights, g, probs=None):
        """(d loss / d x in x's dtype, d loss / d head in float32), this device's part.
        ``probs``: the softmax ``loss_and_probs`` kept (one chunk), or None."""
        def chunk_grads(xc, tc, wc, probs):
            one_hot = jax.nn.one_hot(tc, probs.shape[-1], dtype=jnp.float32)
            d_logits = ((probs - one_hot) * (wc * g)[..., None]).astype(x.dtype)
            d_x = jnp.einsum("bsv,dv->bsd", d_logits, head)
            d_head = jnp.einsum("bsd,bsv->dv", xc, d_logits, preferred_element_type=jnp.float32)
            return d_head, d_x

        if probs is not None:
            d_head, d_x = chunk_grads(x, targets, weights, probs)
            return d_x, d_head

        def body(d_head, chunk):
            xc, tc, wc = chunk
            probs = jax.nn.softmax(self.logits(xc, head), axis=-1)
            chunk_d_head, d_x = chunk_grads(xc, tc, wc, probs)
            return d_head + chunk_d_head, d_x

        d_head, d_x = jax.lax.scan(body, jnp.zeros(head.shape, jnp.float32),
                                   (_chunks(x, self.n), _chunks(targets, self.n),
                                    _chunks(weights, self.n)))
        return _unchunk(d_x), d_head


def loss_sums(x: jax.Array, head: jax.Array | Weight, targets: jax.Array, weights: jax.Array,
              chunk: int) -> tuple[jax.Array, jax.Array]:
    """(sum of weights x cross-entropy, sum of weights), float32 scalars.

    x: (b, s, dim) final hidden states in the compute dtype; head: (dim, vocab) LM
    head, either an array used as it is or a ``rules.Weight``, whose gradient goes to
    its stored value in the storage layout, summed in float32; targets: (b, s) int;
    weights: (b, s) (the loss mask). ``chunk`` must divide s when s > chunk, in
    pieces the sequence's mesh axes split evenly (``Experiment`` checks).
    """
    if not isinstance(head, Weight):
        head = Weight(head, head, ParamUse(head.dtype))
    weights = weights.astype(jnp.float32)
    local, rules = _local(x.shape[1], chunk)
    return (_fused(local, rules, head.use, x, head.gathered, targets, weights, head.value),
            jnp.sum(weights))


def token_log_probs(x: jax.Array, head: jax.Array | Weight, targets: jax.Array, chunk: int
                    ) -> tuple[jax.Array, jax.Array]:
    """(log-probability of each target, the mean over the vocabulary of its position's
    logits), both (b, s) float32, with the head applied ``chunk`` positions at a time as
    ``loss_sums`` does, never the whole batch's logits. The log-probabilities carry a
    gradient (for any function of them: per-sequence sums, ratios); the mean logits are
    a metric (TRL's logits/chosen) and carry none. Arguments as ``loss_sums``'s."""
    if not isinstance(head, Weight):
        head = Weight(head, head, ParamUse(head.dtype))
    local, rules = _local(x.shape[1], chunk)
    return _fused_tokens(local, rules, head.use, x, head.gathered, targets, head.value)


def _local(seq_len: int, chunk: int) -> tuple[_Local, object]:
    """The per-device functions, and the rules whose data axes a shard_map runs over
    (None: nothing splits the batch or the sequence, no shard_map)."""
    n = num_chunks(seq_len, chunk)
    rules = active()
    if rules is not None and not rules.data_axes:
        return _Local(n, rules.spec((None, None, "act_vocab"))), None
    if rules is None:
        return _Local(n, None), None
    vocab = tuple(a for a in rules.axes_of("act_vocab") if a not in rules.data_axes)
    return _Local(n, PartitionSpec(None, None, vocab or None)), rules


def _shard_maps(local: _Local, rules, use: ParamUse):
    """For shard_maps over ``rules``' data axes: (the hidden states' spec, the rows'
    spec, a shard_map wrapper, ``local.grads`` as one, the head's gradient left as
    float32 partial sums to be summed once outside)."""
    axes = data_axes(rules)
    rows = rules.spec(("act_batch", "act_seq"))
    hidden = PartitionSpec(*rows, None) if len(rows) else PartitionSpec()
    shard = functools.partial(jax.shard_map, mesh=rules.mesh, axis_names=set(axes),
                              check_vma=False)

    def all_grads(*args):
        d_x, d_head = local.grads(*args)
        return d_x, partials_out(d_head, use, axes)  # summed outside, once, in float32

    backward = shard(all_grads, in_specs=(hidden, PartitionSpec(), rows, rows, PartitionSpec()),
                     out_specs=(hidden, partials_spec(use, axes, 2)))
    return hidden, rows, shard, backward


def _fused_tokens(local: _Local, rules, use: ParamUse, x, head, targets, stored
                  ) -> tuple[jax.Array, jax.Array]:
    """``token_log_probs``' custom VJP: the log-probabilities' cotangent (b, s) is the
    cross-entropy's per-token weights with the sign flipped, so the backward pass is
    ``loss_sums``' (``_Local.grads``: chunk by chunk, the logits recomputed)."""
    if rules is None:
        forward, backward = local.token_log_probs, local.grads
    else:
        hidden, rows, shard, backward = _shard_maps(local, rules, use)
        forward = shard(local.token_log_probs, in_specs=(hidden, PartitionSpec(), rows),
                        out_specs=(rows, rows))

    @jax.custom_vjp
    def fused(x, head, targets, stored):
        return forward(x, head, targets)

    def fwd(x, head, targets, stored):
        return forward(x, head, targets), (x, head, targets, jnp.zeros((0,), stored.dtype))

    def bwd(saved, cotangents):
        x, head, targets, dtype_of_stored = saved
        d_x, d_head = backward(x, head, targets, cotangents[0], jnp.float32(-1.0))
        d_head = (scatter(d_head, use, dtype_of_stored.dtype) if rules is None
                  else partials_sum(d_head, use, data_axes(rules), dtype_of_stored.dtype))
        return d_x, None, np.zeros(targets.shape, jax.dtypes.float0), d_head

    fused.defvjp(fwd, bwd)
    logps, means = fused(x, head, targets, stored)
    return logps, jax.lax.stop_gradient(means)


def _fused(local: _Local, rules, use: ParamUse, x, head, targets, weights, stored
           ) -> jax.Array:
    """The custom VJP around the per-device loss: a shard_map over the data axes
    when ``rules`` is given, the plain local functions otherwise. ``head`` is the
    head in its compute layout, ``gather(stored, use)``: the head's gradient goes
    to ``stored``, in its storage layout (``rules.scatter``).

    On CPU, when the sequence is one chunk, the forward pass keeps the chunk's
    softmax (float32, the size of its logits, which exist at that moment anyway)
    for the backward pass, which comes right after it: the backward pass then
    skips the LM head's matmul that would recompute the logits (a third of the
    head's work; measured by bench/cpu_vs_torch.py). Only without the shard_map
    (nothing splits the batch or the sequence, e.g. one device): through the
    shard_map the kept softmax, vocab-parallel under tensor parallelism, would
    leave it under a replicated spec, and a step loaded from the persistent
    compilation cache then hung in an all-reduce. Elsewhere, and with more than
    one chunk, the backward pass recomputes every chunk's logits.
    """
    keep_probs = local.n == 1 and rules is None and jax.default_backend() == "cpu"
    if rules is None:
        forward = local.loss_and_probs if keep_probs else local.loss
        backward = local.grads
    else:
        axes = data_axes(rules)
        hidden, rows, shard, backward = _shard_maps(local, rules, use)

        def total_loss(*args):
            return jax.lax.psum(local.loss(*args), axes)

        forward = shard(total_loss, in_specs=(hidden, PartitionSpec(), rows, rows),
                        out_specs=PartitionSpec())

    @jax.custom_vjp
    def fused(x, head, targets, weights, stored):
        out = forward(x, head, targets, weights)
        return out[0] if keep_probs else out

    def fwd(x, head, targets, weights, stored):
        out = forward(x, head, targets, weights)
        # Only the stored head's dtype is needed, as an empty array of it.
        saved = (x, head, targets, weights, jnp.zeros((0,), stored.dtype))
        if keep_probs:
            return out[0], saved + (out[1],)
        return out, saved

    def bwd(saved, g):
        x, head, targets, weights, dtype_of_stored = saved[:5]
        d_x, d_head = backward(x, head, targets, weights, g, *saved[5:])
        d_head = (scatter(d_head, use, dtype_of_stored.dtype) if rules is None
                  else partials_sum(d_head, use, axes, dtype_of_stored.dtype))
        return (d_x, None, np.zeros(targets.shape, jax.dtypes.float0), jnp.zeros_like(weights),
                d_head)

    fused.defvjp(fwd, bwd)
    return fused(x, head, targets, weights, stored)
