"""The decoder of ``decoder.py`` run with a KV cache: prefill and one-token decode steps.

The same parameters, the same weight gathering (``layers.weight``), projections,
RoPE, norms and MLP as the training forward; only attention differs: keys and
values are written into a cache and each query attends to the cache's filled
slots (within its window, on a local layer). Every family registered so far
decodes with it (``registry.Family.decode``).

Layout. The cache is ``(layers, batch, slots, kv heads, head_dim)`` in the compute
dtype, named ``CACHE_NAMES`` for the rule table: rows over the batch's mesh axes,
kv heads over ``tensor`` like the k/v projections (repeated like the weights when
the rules replicate kv heads, ``Rules.kv_repeat``), slots unsplit.

Batches of prompts of different lengths are left-padded: every row's prompt ends
at the same slot, so one decode step writes one slot for all rows. Row ``b``'s
token in slot ``t`` has position ``t - pad[b]``; slots before ``pad[b]`` are
masked out as keys.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from ndjax.models.decoder import FULL, HIDDEN, RESIDUAL, SLIDING, Block, Decoder, DecoderConfig
from ndjax.models.layers import weight
from ndjax.ops.attention import masked_attention
from ndjax.parallel.rules import active, constrain

CACHE_NAMES = ("layers", "act_batch", None, "act_kv_heads", "act_head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    k: jax.Array    # (layers, batch, slots, cache_heads, head_dim), compute dtype
    v: jax.Array
    pad: jax.Array  # (batch,) int32: the row's left padding; its slots hold no token


def cache_heads(cfg: DecoderConfig) -> int:
    """kv heads as the k/v projections produce them under the active rules."""
    rules = active()
    return cfg.n_kv_heads * (1 if rules is None else rules.kv_repeat(cfg.n_kv_heads))


def init_cache(cfg: DecoderConfig, batch: int, slots: int, pad: jax.Array) -> Cache:
    shape = (cfg.n_layers, batch, slots, cache_heads(cfg), cfg.hd)
    zeros = constrain(jnp.zeros(shape, cfg.dtype), CACHE_NAMES)
    return Cache(zeros, zeros, pad.astype(jnp.int32))


def forward(model: Decoder, tokens: jax.Array, start: jax.Array | int, cache: Cache
            ) -> tuple[jax.Array, Cache]:
    """Runs ``tokens`` (b, s), which fill slots ``start .. start+s-1``, through the model.

    Returns the float32 logits (b, vocab) of the last of them, and the cache with
    their keys and values written.
    """
    cfg = model.cfg
    s = tokens.shape[1]
    slots = start + jnp.arange(s, dtype=jnp.int32)
    positions = jnp.maximum(slots[None, :] - cache.pad[:, None], 0)
    table = weight(model.embed, cfg.dtype)
    x = jnp.take(table, tokens, axis=0)
    if cfg.embed_scale:
        x = x * jnp.asarray(math.sqrt(cfg.dim), cfg.dtype)
    x = constrain(x, RESIDUAL)
    tables = model.rope_tables(positions)
    global_tables = tables.get(FULL, tables.get(SLIDING))
    local_tables = tables.get(SLIDING, global_tables)
    # (b, s, slots): causal over slots, and never a row's padding. A local layer also
    # masks the slots more than its window behind (slots differ as positions do).
    keys = jnp.arange(cache.k.shape[2], dtype=jnp.int32)
    behind = slots[None, :, None] - keys[None, None, :]
    mask = (behind >= 0) & (keys[None, None, :] >= cache.pad[:, None, None])
    windows = jnp.array([cfg.spec(t).window or cache.k.shape[2] + 1 for t in cfg.types],
                        jnp.int32)
    local = jnp.array([t == SLIDING for t in cfg.types])
    graphdef, stacked = nnx.split(model.layers)

    def layer(carry, xs):
        h, k_all, v_all = carry
        state, i, window, is_local = xs
        block = nnx.merge(graphdef, state)
        cos, sin = (jnp.where(is_local, a, b) for a, b in zip(local_tables, global_tables))
        return _block(block, cfg, h, cos, sin, mask & (behind < window), k_all, v_all, i,
                      start), None

    # The whole cache is carried (not scanned over) so that each layer updates its
    # slots in place instead of the scan writing a fresh copy of every layer's cache.
    (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v),
                                (stacked, jnp.arange(cfg.n_layers, dtype=jnp.int32), windows,
                                 local))
    x = constrain(model.final_norm(x[:, -1:]), HIDDEN)
    head = table.T if cfg.tie_embeddings else weight(model.lm_head, cfg.dtype)
    logits = jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)
    logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"))[:, 0]
    return logits, Cache(k, v, cache.pad)


def _block(block: Block, cfg: DecoderConfig, x, cos, sin, mask, k_all, v_all, layer, start):
    """``decoder.Block`` with its attention reading and writing the cache of ``layer``: the
    new keys and values go in at ``start`` and the queries attend to the whole cache."""
    cache = {}

    def attend(h):
        q, k, v = block.attn.qkv(h, cos, sin)
        zero = jnp.zeros((), jnp.int32)
        at = (layer, zero, jnp.asarray(start, jnp.int32), zero, zero)
        for name, new, whole in (("k", k, k_all), ("v", v, v_all)):
            cache[name] = constrain(jax.lax.dynamic_update_slice(
                whole, new[None].astype(whole.dtype), at), CACHE_NAMES)
        spec = cfg.spec(FULL)  # the scale and soft cap; the window is in mask
        out = masked_attention(q, cache["k"][layer], cache["v"][layer], mask,
                               scale=spec.scale, softcap=spec.softcap)
        return block.attn.output(out)

    x, _ = block.around(x, attend, dropless=True)
    return x, cache["k"], cache["v"]
