"""Train state and optimizer: AdamW with warmup + cosine/linear/constant, clipping."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from ndjax.config import TrainSettings


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any      # nested dict of arrays (model.param_dtype), paths as in the model
    opt_state: Any


def make_schedule(train: TrainSettings) -> optax.Schedule:
    warmup = (math.ceil(train.warmup_ratio * train.steps) if train.warmup_ratio
              else max(int(train.warmup_steps), 0))
    if train.schedule == "linear":
        return _linear(train.lr, warmup, int(train.steps))
    if train.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(train.lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, train.lr, warmup), optax.constant_schedule(train.lr)],
            [warmup])
    decay_steps = max(int(train.steps), warmup + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train.lr, warmup_steps=warmup, decay_steps=decay_steps,
        end_value=train.lr * train.min_lr_ratio)


def _linear(lr: float, warmup: int, steps: int) -> optax.Schedule:
    """transformers' get_linear_schedule_with_warmup: up from 0 over ``warmup`` steps,
    then down to 0 at ``steps``. The decay is (steps - step) / (steps - warmup), as
    there, not optax.linear_schedule's 1 - elapsed fraction, whose cancellation near the
    end would leave the last steps' rates only a few float32 digits right."""
    up, down = max(warmup, 1), max(steps - warmup, 1)

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        return lr * jnp.where(step < warmup, step / up, jnp.maximum(steps - step, 0.0) / down)

    return schedule


def _cast_floats(tree: Any, dtype: Any) -> Any:
    """Floating-point arrays of ``tree`` cast to ``dtype``; counters and anything
    that is not an array (optax's placeholders in ``tree_map_params``) kept."""
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree.map(cast, tree)


# train.opt_state_dtype=bfloat16 keeps Adam's first moment to this many bits below
# bfloat16's 8 significant ones, in the low bits of the second moment's float32 word
# (``pack_moments``).
MU_EXTRA_BITS = 5


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _float(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _round_off(x: jax.Array, n: int) -> jax.Array:
    """The float32 bits of ``x`` rounded to nearest (ties to even) at bit ``n``, the n
    low bits zero. A carry into the exponent is the correct rounding up; NaN is kept
    as it is, since its carry could reach the sign bit and make a number of it."""
    bits = _bits(x)
    half_less_one, keep = jnp.uint32((1 << (n - 1)) - 1), jnp.uint32(0xFFFFFFFF << n & 0xFFFFFFFF)
    rounded = (bits + half_less_one + ((bits >> n) & 1)) & keep
    return jnp.where(jnp.isnan(x), bits, rounded)


def pack_moments(mu: jax.Array, nu: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 Adam moments -> (mu: bfloat16, nu: float32 word), 6 bytes per parameter.

    bfloat16 alone cannot hold an exponential average whose step is smaller than half
    its ulp, 2^-9 to 2^-8 of the value: ``nu`` moves by (1 - b2) of the gap to g^2 per
    step, 0.1% at b2 = 0.999, and stalls for good (a gradient that falls 10x leaves it
    at 9x float32's, the update at a third); ``mu`` (b1 = 0.9) stalls within 2-4% of a
    steady gradient. Deterministic, so a resumed run stays bitwise (stochastic
    rounding's noise would accumulate too: the update off by 4.5% rms at b2 = 0.999):

    * ``mu`` is rounded to 8 + MU_EXTRA_BITS significant bits; its top 16 bits are the
      bfloat16 (a tool reading it alone sees ``mu`` to within one bfloat16 ulp), the
      next MU_EXTRA_BITS go in the low bits of ``nu``'s word;
    * ``nu`` (>= 0) is rounded to 24 - MU_EXTRA_BITS significant bits, the rest of
      that float32 word (read as a float, ``nu`` to within 2^-18 of itself).

    An average stored to p significant bits strays from float32's by at most
    2^-p / (1 - b) of itself at steady state: 0.12% for ``mu`` at b1 = 0.9 and 0.19%
    for ``nu`` at b2 = 0.999, so the update (mu / sqrt(nu)) by at most ~0.2%; while
    an average decays, the bound grows with the steps it decays for (0.54% of the
    update while ``nu`` falls 30x over 4,000 steps; 0.11% measured: tests/test_dtypes.py).
    """
    low = 16 - MU_EXTRA_BITS
    mu_bits = _round_off(mu, low)
    hi = jax.lax.bitcast_convert_type((mu_bits >> 16).astype(jnp.uint16), jnp.bfloat16)
    extra = (mu_bits >> low) & jnp.uint32((1 << MU_EXTRA_BITS) - 1)
    return hi, _float(_round_off(nu, MU_EXTRA_BITS) | extra)


def unpack_moments(hi: jax.Array, word: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``pack_moments``' (mu: bfloat16, nu: float32 word) -> float32 (mu, nu). Moments
    stored plainly (a checkpoint of bfloat16 or float32 moments, converted on
    restore) read as themselves: nu to within 2^-18, mu to within one bfloat16 ulp
    (its bfloat16 plus what nu's low bits add)."""
    mask = jnp.uint32((1 << MU_EXTRA_BITS) - 1)
    word_bits = _bits(word)
    # The bfloat16's bits as they are (a float conversion could flush subnormals).
    top = jax.lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32) << 16
    mu = top | ((word_bits & mask) << (16 - MU_EXTRA_BITS))
    return _float(mu), _float(word_bits & ~mask)


def _is_adam(x: Any) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def _store(state: Any, dtype: Any) -> Any:
    """float32 optimizer state -> as stored: Adam's moments packed (``pack_moments``)
    when ``dtype`` is bfloat16, other floating-point arrays cast to ``dtype``."""
    def one(x):
        if not (_is_adam(x) and jnp.dtype(dtype) == jnp.bfloat16):
            return _cast_floats(x, dtype)
        mu = jax.tree.map(lambda m, v: pack_moments(m, v)[0], x.mu, x.nu)
        nu = jax.tree.map(lambda m, v: pack_moments(m, v)[1], x.mu, x.nu)
        return x._replace(mu=mu, nu=nu)
    return jax.tree.map(one, state, is_leaf=_is_adam)


def read_moments(stored: optax.ScaleByAdamState) -> optax.ScaleByAdamState:
    """A ``ScaleByAdamState`` as ``store_moments_as`` stores it -> its float32 moments."""
    if all(m.dtype == jnp.float32 for m in jax.tree.leaves(stored.mu)):
        return _cast_floats(stored, jnp.float32)
    mu = jax.tree.map(lambda h, w: unpack_moments(h, w)[0], stored.mu, stored.nu)
    nu = jax.tree.map(lambda h, w: unpack_moments(h, w)[1], stored.mu, stored.nu)
    return stored._replace(mu=mu, nu=nu)


def _load(state: Any) -> Any:
    def one(x):
        return read_moments(x) if _is_adam(x) else _cast_floats(x, jnp.float32)
    return jax.tree.map(one, state, is_leaf=_is_adam)


def store_moments_as(inner: optax.GradientTransformation, dtype: Any
                     ) -> optax.GradientTransformation:
    """``inner`` (e.g. scale_by_adam) with its floating-point state stored in ``dtype``.

    The update reads the stored state as float32, runs ``inner`` in float32 and
    stores the new state: only storage is narrow, never the arithmetic. In
    bfloat16, Adam's two moments are stored together in 6 bytes per parameter, the
    first moment as a bfloat16 and the second as a float32 word that also holds
    the first's next bits (``pack_moments``): plain bfloat16 moments stop following
    the gradient once its changes are below half an ulp. The state keeps
    ``inner``'s tree structure (and so its checkpoint paths, and the
    parameter-shaped subtrees that ``optax.tree_map_params`` looks for).
    """
    def init(params):
        return _store(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, _load(state), params)
        return updates, _store(state, dtype)

    return optax.GradientTransformation(init, update)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` fed float32 gradients and parameters, so that clipping's global
    norm, the moments' arithmetic and weight decay are float32 whatever the
    parameter dtype. Its updates come out float32; ``optax.apply_updates`` rounds
    parameter + update to the parameter dtype.

    A wrapper rather than a first element of the chain: a stateless element
    would still add an entry to the optimizer state and renumber the paths of
    every checkpoint written before it.
    """
    def update(updates, state, params=None):
        return inner.update(_cast_floats(updates, jnp.float32), state,
                            None if params is None else _cast_floats(params, jnp.float32))

    return optax.GradientTransformation(inner.init, update)


def make_optimizer(train: TrainSettings, param_names: dict, schedule: optax.Schedule,
                   moments: Any = jnp.float32) -> optax.GradientTransformation:
    """AdamW, moments stored in ``moments`` (``Precision.moments``, from
    train.opt_state_dtype); no weight decay on norm scales (found by their logical names)."""
    decay_mask = jax.tree.map(lambda names: "norm" not in names, param_names,
                              is_leaf=lambda x: isinstance(x, tuple))
    parts = []
    if train.clip_norm and train.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(train.clip_norm))
    # optax.adamw's own chain, with its moments' storage dtype set (same state tree).
    parts.append(optax.chain(
        store_moments_as(optax.scale_by_adam(b1=train.b1, b2=train.b2, eps=train.eps), moments),
        optax.add_decayed_weights(train.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule)))
    return in_float32(optax.chain(*parts))


def state_shardings(optimizer: optax.GradientTransformation, abstract_params: Any,
                    param_shardings: Any, replicated: Any, params: Any = None) -> TrainState:
    """Shardings of the whole state: optimizer moments are laid out like their params.
    ``abstract_params`` and ``param_shardings`` are what the optimizer sees; ``params``
    (default: ``param_shardings``) the shardings of every parameter (under LoRA the
    optimizer sees only the adapters, the state holds the frozen base too).

    ``optax.tree_map_params`` finds the parameter-shaped subtrees of the
    optimizer state (the moments) by initialising the optimizer on a
    placeholder; everything else (step counts) is replicated. Both inits are
    abstract (the placeholder is an empty pytree), so nothing runs on a device.
    """
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        lambda params: jax.eval_shape(optimizer.init, params),
        lambda _, sharding: sharding, abstract_opt, param_shardings,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_shardings if params is None else params,
                      opt_state=opt_shardings)


def zero_step() -> jax.Array:
    return jnp.zeros((), jnp.int32)
