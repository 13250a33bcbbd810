"""Batched generation with a KV cache: one jitted prefill, one jitted decode loop.

Compiles. Shapes are bucketed so that a run compiles a handful of programs, never
one per token or per prompt: the rows of a batch are rounded up to the batch's
mesh ways times a power of two, the prompt slots to a power of two (at least 8,
at most ``max_len - max_new_tokens``), and the cache holds prompt slots +
``max_new_tokens``. Prefill and decode each compile once per (rows, prompt slots)
pair; the decode loop is one ``lax.while_loop`` over up to ``max_new_tokens``
steps that stops early once every row has emitted an end-of-sequence token.

Sampling settings are compile-time constants (they are fixed for a run).
Temperature 0 is greedy (argmax). Otherwise logits are divided by the temperature,
cut to the ``top_k`` largest and to the smallest set whose probability reaches
``top_p``, and sampled. Each prompt draws its own randomness: prompt ``j`` (its place
in the list a Generator is called with) samples step ``t`` with the key
``fold_in(fold_in(key(seed), j), t)``. So no two prompts share draws (16 copies of
one prompt give 16 completions, whichever batches they fall in), a seed repeats the
whole output, and a prompt's draws do not depend on ``batch_size``, on its row in
the batch or on the filler rows a mesh pads the batch with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from ndjax.models import registry
from ndjax.models.decoder import DecoderConfig
from ndjax.parallel import rules as rules_lib
from ndjax.runtime.errors import ConfigError

MIN_PROMPT_SLOTS = 8


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0        # 1: off
    top_k: int = 0            # 0: off

    def check(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"--temperature={self.temperature} must be >= 0 (0: greedy).")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p={self.top_p} must be in (0, 1] (1: off).")
        if self.top_k < 0:
            raise ConfigError(f"--top_k={self.top_k} must be >= 0 (0: off).")


def sample(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """logits (b, vocab) float32 -> token ids (b,) int32; ``key`` is one key for the
    whole batch, or (b,) keys, one per row."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    low = jnp.finfo(jnp.float32).min
    if s.top_k:
        kth = jax.lax.top_k(logits, min(s.top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, low, logits)
    if s.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # A token is kept if the tokens ranked above it hold less than top_p; the
        # first always is.
        kept = jnp.cumsum(probs, axis=-1) - probs < s.top_p
        cutoff = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, low, logits)
    if key.ndim == 0:
        return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    # One key per row: a row's draw depends only on its own key, not on how many rows
    # the batch has or where the row sits in it.
    return jax.vmap(jax.random.categorical)(key, logits).astype(jnp.int32)


def row_keys(key: jax.Array, start: jax.Array | int, rows: int) -> jax.Array:
    """(rows,) keys: row r's is ``fold_in(key, start + r)``, its prompt's own stream."""
    return jax.vmap(jax.random.fold_in, (None, 0))(key, start + jnp.arange(rows))


def step_keys(keys: jax.Array, step: jax.Array | int) -> jax.Array:
    """Each row's key for decode step ``step`` (0: the token prefill samples)."""
    return jax.vmap(jax.random.fold_in, (0, None))(keys, step)


def decode_rules(rules: rules_lib.Rules) -> rules_lib.Rules:
    """The run's rule table with the sequence unsplit: a decode step has one token, and
    the cache's slots stay whole on every device (ring attention is not used here)."""
    table = tuple((name, None if name in ("act_seq", "act_res_seq") else axes)
                  for name, axes in rules.table)
    return rules_lib.Rules(table, rules.mesh)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class Generator:
    """Generates from token-id prompts with the parameters ``params`` (placed in any
    sharding of ``rules.mesh``; weights are gathered at use as in training)."""

    def __init__(self, graphdef: Any, params: Any, cfg: DecoderConfig,
                 rules: rules_lib.Rules, *, max_new_tokens: int, max_len: int,
                 sampling: Sampling | None = None, eos_ids: Sequence[int] = (), pad_id: int = 0,
                 seed: int = 0, max_len_what: str = "the model's context"):
        sampling = sampling or Sampling()
        sampling.check()
        if max_new_tokens < 1:
            raise ConfigError(f"--max_new_tokens={max_new_tokens} must be >= 1.")
        self.cfg, self.params, self.rules = cfg, params, decode_rules(rules)
        self.max_new, self.max_len, self.sampling = max_new_tokens, max_len, sampling
        self.max_len_what = max_len_what
        self.eos = jnp.asarray(sorted(set(eos_ids)) or [-1], jnp.int32)
        self.pad_id = pad_id
        self.key = jax.random.key(seed)
        self.row_ways = math.prod(rules.mesh.shape[a] for a in self.rules.axes_of("act_batch"))
        self.graphdef = graphdef
        self.prefill = jax.jit(self._prefill)
        self.decode = jax.jit(self._decode, donate_argnums=2)

    # ----- the two jitted programs ---------------------------------------------------

    # ``start``: the index of the batch's first prompt among all prompts, which picks
    # each row's random stream (``row_keys``); a traced scalar, so every batch runs the
    # same compiled program. Its default keeps the older four- and five-argument calls
    # (bench/generate.py) working.
    def _prefill(self, params, tokens, pad, key, start=0):
        model = nnx.merge(self.graphdef, params)
        b, slots = tokens.shape
        cache = registry.of(self.cfg).decode.init_cache(self.cfg, b, slots + self.max_new, pad)
        logits, cache = registry.of(self.cfg).decode.forward(model, tokens, 0, cache)
        keys = step_keys(row_keys(key, start, b), 0)
        return sample(logits, keys, self.sampling), cache

    def _decode(self, params, first, cache, key, n_prompts, start=0):
        """Tokens (b, max_new_tokens): ``first`` then one per step; after a row's
        end-of-sequence token, ``pad_id``. The cache is donated and returned so that the
        loop updates it in place rather than in a copy."""
        model = nnx.merge(self.graphdef, params)
        keys = row_keys(key, start, first.shape[0])
        n = self.max_new
        prompt_slots = cache.k.shape[2] - n
        out = jnp.full((first.shape[0], n), self.pad_id, jnp.int32).at[:, 0].set(first)
        # Filler rows (beyond n_prompts) count as done, or they would keep the loop going.
        done = jnp.isin(first, self.eos) | (jnp.arange(first.shape[0]) >= n_prompts)

        def running(carry):
            i, _, done, _ = carry
            return (i < n) & ~jnp.all(done)

        def step(carry):
            i, out, done, cache = carry
            last = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
            logits, cache = registry.of(self.cfg).decode.forward(model, last,
                                                                 prompt_slots + i - 1, cache)
            token = sample(logits, step_keys(keys, i), self.sampling)
            token = jnp.where(done, self.pad_id, token)
            out = jax.lax.dynamic_update_slice_in_dim(out, token[:, None], i, axis=1)
            return i + 1, out, done | jnp.isin(token, self.eos), cache

        _, out, _, cache = jax.lax.while_loop(running, step, (jnp.int32(1), out, done, cache))
        return out, cache

    # ----- host side -----------------------------------------------------------------

    def shapes(self, n_prompts: int, longest: int) -> tuple[int, int]:
        """(rows, prompt slots) of the compiled programs for such a batch."""
        rows = self.row_ways * _pow2(-(-n_prompts // self.row_ways))
        slots = min(max(_pow2(longest), MIN_PROMPT_SLOTS), self.max_len - self.max_new)
        return rows, max(slots, longest)

    def inputs(self, prompts: Sequence[Sequence[int]]) -> tuple[jax.Array, jax.Array]:
        """Left-padded tokens (rows, slots) and each row's padding, placed by the rules."""
        rows, slots = self.shapes(len(prompts), max(len(p) for p in prompts))
        tokens = np.full((rows, slots), self.pad_id, np.int32)
        pad = np.full((rows,), slots - 1, np.int32)  # filler rows: one pad token
        for i, p in enumerate(prompts):
            tokens[i, slots - len(p):] = p
            pad[i] = slots - len(p)
        mesh = self.rules.mesh
        return (jax.device_put(tokens, NamedSharding(mesh, self.rules.spec(("act_batch", None)))),
                jax.device_put(pad, NamedSharding(mesh, self.rules.spec(("act_batch",)))))

    def compile_ahead(self, n_prompts: int, longest: int
                      ) -> tuple[jax.stages.Compiled, jax.stages.Compiled]:
        """Prefill and decode compiled for a batch of ``n_prompts`` prompts of up to
        ``longest`` tokens, against abstract inputs (``params`` may be abstract too):
        what ``ndjax compile --step=decode`` reads."""
        from ndjax.parallel import platforms
        from ndjax.runtime import compiler

        rows, slots = self.shapes(n_prompts, longest)
        mesh = self.rules.mesh
        platform = platforms.of(mesh.devices.flat)

        def placed(shape, dtype, names):
            return jax.ShapeDtypeStruct(shape, dtype,
                                        sharding=NamedSharding(mesh, self.rules.spec(names)))

        key = placed(self.key.shape, self.key.dtype, ())
        start = placed((), jnp.int32, ())
        with rules_lib.use(self.rules):
            prefill = compiler.compile_step(self.prefill.trace(
                self.params, placed((rows, slots), jnp.int32, ("act_batch", None)),
                placed((rows,), jnp.int32, ("act_batch",)), key, start).lower(),
                platform=platform)
            first, cache = jax.tree.map(
                lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                prefill.out_info, prefill.output_shardings)
            decode_step = compiler.compile_step(self.decode.trace(
                self.params, first, cache, key, placed((), jnp.int32, ()), start).lower(),
                platform=platform)
        return prefill, decode_step

    def check(self, prompts: Sequence[Sequence[int]]) -> None:
        for i, p in enumerate(prompts):
            if not len(p):
                raise ConfigError(f"prompt {i + 1} is empty (0 tokens); give at least one token.")
            if len(p) + self.max_new > self.max_len:
                raise ConfigError(
                    f"prompt {i + 1} has {len(p)} tokens; with --max_new_tokens={self.max_new} "
                    f"that is {len(p) + self.max_new}, more than --max_len={self.max_len} "
                    f"({self.max_len_what}). Shorten the prompt or lower --max_new_tokens.")

    def generate(self, prompts: Sequence[Sequence[int]], start: int = 0) -> list[list[int]]:
        """One batch: each prompt's new tokens, up to and including its first
        end-of-sequence token. ``start``: the index of ``prompts[0]`` among all the
        prompts of the call, so that each prompt samples with its own key."""
        self.check(prompts)
        # Traced, as compile_ahead declares it: one compiled program for every batch.
        first_index = np.int32(start)
        with rules_lib.use(self.rules):
            tokens, pad = self.inputs(prompts)
            first, cache = self.prefill(self.params, tokens, pad, self.key, first_index)
            out, _ = self.decode(self.params, first, cache, self.key, len(prompts),
                                 first_index)
        out = _host(out)[:len(prompts)]
        eos = set(np.asarray(self.eos).tolist())
        result = []
        for row in out.tolist():
            end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
            result.append(row[:end])
        return result

    def __call__(self, prompts: Sequence[Sequence[int]], batch_size: int = 8
                 ) -> list[list[int]]:
        """All prompts, ``batch_size`` at a time, in order."""
        self.check(prompts)
        out: list[list[int]] = []
        for i in range(0, len(prompts), batch_size):
            out += self.generate(prompts[i:i + batch_size], start=i)
        return out


def _host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

