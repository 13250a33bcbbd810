"""The decoder of ``decoder.py`` run with a KV cache: prefill and one-token decode steps.

The same parameters, the same weight gathering (``layers.weight``), projections,
RoPE, norms and MLP as the training forward; only attention differs: keys and
values are written into a cache and each query attends to the cache's filled
slots (within its window, on a local layer). Every family registered so far
decodes with it (``registry.Family.decode``).

Layout. The cache is ``(layers, batch, slots, kv heads, head_dim)`` in the compute
dtype, named ``CACHE_NAMES`` for the rule table: rows over the batch's mesh axes,
kv heads over ``tensor`` like the k/v projections (repeated like the weights when
the rules replicate kv heads, ``Rules.kv_repeat``), slots unsplit. Multi-head latent
attention (``ndjax.models.mla``) caches what its keys and values are made from instead:
each token's normed latent and its rotated rotary key, ``(layers, batch, slots,
kv_lora_rank + rope_head_dim)`` in ``Cache.k`` (``v`` None), rows split like the
batch, the rest whole; each step expands the cache through ``wkv_b`` into every
head's keys and values (``MLA.expand``).

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

from ndjax.models.decoder import (
    FULL,
    HIDDEN,
    RESIDUAL,
    SLIDING,
    Block,
    Decoder,
    DecoderConfig,
    layer_order,
    stacks,
)
from ndjax.models.layers import weight
from ndjax.models.mla import padded
from ndjax.ops.attention import masked_attention
from ndjax.parallel.rules import active, constrain

CACHE_NAMES = ("layers", "act_batch", None, "act_kv_heads", "act_head_dim")
# MLA's cache of latents: (layers, batch, slots, kv_lora_rank + rope_head_dim).
LATENT_CACHE_NAMES = ("layers", "act_batch", None, None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Cache:
    k: jax.Array    # (layers, batch, slots, cache_heads, head_dim), compute dtype; MLA: its
    #                 latents (layers, batch, slots, kv_lora_rank + rope_head_dim)
    v: jax.Array | None  # as k; None for MLA
    pad: jax.Array  # (batch,) int32: the row's left padding; its slots hold no token


def cache_heads(cfg: DecoderConfig) -> int:
    """kv heads as the k/v projections produce them under the active rules."""
    rules = active()
    return cfg.n_kv_heads * (1 if rules is None else rules.kv_repeat(cfg.n_kv_heads))


def init_cache(cfg: DecoderConfig, batch: int, slots: int, pad: jax.Array) -> Cache:
    if cfg.kv_lora_rank:
        shape = (cfg.n_layers, batch, slots, cfg.kv_lora_rank + cfg.rope_head_dim)
        latents = constrain(jnp.zeros(shape, cfg.dtype), LATENT_CACHE_NAMES)
        return Cache(latents, None, pad.astype(jnp.int32))
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
    k, v = cache.k, cache.v
    if layer_order(cfg) is not None:  # the scan below runs the stacked layers as stored
        raise ValueError("decoding needs the layers in order: pass Experiment.in_layer_order's "
                         "parameters with a config of virtual_stages=1")
    for stack in stacks(cfg):  # (DeepSeek V3: its dense first layers, then the rest)
        graphdef, stacked = nnx.split(getattr(model, stack.name))

        def layer(carry, xs, graphdef=graphdef):
            h, k_all, v_all = carry
            state, i, window, is_local = xs
            block = nnx.merge(graphdef, state)
            cos, sin = (jnp.where(is_local, a, b) for a, b in zip(local_tables, global_tables))
            return _block(block, cfg, h, cos, sin, mask & (behind < window), k_all, v_all, i,
                          start), None

        # The whole cache is carried (not scanned over) so that each layer updates its
        # slots in place instead of the scan writing a fresh copy of every layer's cache.
        span = slice(stack.first, stack.stop)
        (x, k, v), _ = jax.lax.scan(
            layer, (x, k, v), (stacked, jnp.arange(stack.first, stack.stop, dtype=jnp.int32),
                               windows[span], local[span]))
    x = constrain(model.final_norm(x[:, -1:]), HIDDEN)
    head = table.T if cfg.tie_embeddings else weight(model.lm_head, cfg.dtype)
    logits = jnp.einsum("bsd,dv->bsv", x, head, preferred_element_type=jnp.float32)
    logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"))[:, 0]
    return logits, Cache(k, v, cache.pad)


def _block(block: Block, cfg: DecoderConfig, x, cos, sin, mask, k_all, v_all, layer, start):
    """``decoder.Block`` with its attention reading and writing the cache of ``layer``: the
    new keys and values go in at ``start`` and the queries attend to the whole cache."""
    if cfg.kv_lora_rank:
        return _latent_block(block, cfg, x, cos, sin, mask, k_all, layer, start)
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
                               scale=spec.scale, softcap=spec.softcap,
                               sinks=block.attn.sink_logits())
        return block.attn.output(out)

    x, _ = block.around(x, attend, dropless=True)
    return x, cache["k"], cache["v"]


def _latent_block(block: Block, cfg: DecoderConfig, x, cos, sin, mask, latents, layer, start):
    """``_block`` of multi-head latent attention: the new tokens' latents and rotary keys
    go into the cache of ``layer`` at ``start``, and the queries attend to the keys and
    values the whole cache expands to."""
    cache = {}

    def attend(h):
        attn = block.attn
        q = attn.queries(h, cos, sin)
        new = jnp.concatenate(attn.latent(h, cos, sin), axis=-1)
        zero = jnp.zeros((), jnp.int32)
        at = (layer, zero, jnp.asarray(start, jnp.int32), zero)
        cache["latents"] = constrain(jax.lax.dynamic_update_slice(
            latents, new[None].astype(latents.dtype), at), LATENT_CACHE_NAMES)
        mine = cache["latents"][layer]
        k, v = attn.expand(mine[..., :cfg.kv_lora_rank], mine[..., cfg.kv_lora_rank:])
        spec = cfg.spec(FULL)  # the scale and soft cap; the window is in mask
        out = masked_attention(*padded(q, k, v), mask, scale=spec.scale, softcap=spec.softcap)
        return attn.output(out[..., :v.shape[-1]])

    x, _ = block.around(x, attend, dropless=True)
    return x, cache["latents"], None
