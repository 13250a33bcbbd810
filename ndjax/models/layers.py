"""Layers the decoder families share, speaking only logical axis names.

Weights are stored in ``param_dtype`` and used through ``rules.gather`` (FSDP's
all-gather in the compute dtype); ops that use a weight take the stored value too
and give it its gradient in float32 (``project``, ``embed_lookup``, ``add_bias``),
so gradients are summed across devices unrounded. Norms (Llama's ``w * x`` and
Gemma's ``(1 + w) * x``), rotary embeddings (default, llama3 and linear scaling;
rotate-half, Hugging Face's layout) and the gated MLP's activations are here too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from ndjax.models.quant import Quantized, dequantize
from ndjax.parallel.rules import (
    ParamUse,
    active,
    data_axes,
    gather,
    param_use,
    partials_out,
    partials_spec,
    partials_sum,
    scatter,
)


def init_param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float,
           dtype: Any) -> nnx.Param:
    # Drawn in float32 and rounded once, so a bfloat16 model starts from the
    # float32 model's values rounded (the same random stream for both).
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=names)


def use_param(var: nnx.Param, dtype, n_kv_heads: int | None = None, param_dtype: Any = None
         ) -> tuple[jax.Array, jax.Array, ParamUse]:
    """(the parameter gathered to its compute layout and cast to ``dtype``, its stored
    value, how the one is made from the other: ``rules.ParamUse``), the arguments
    ``project`` and ``embed_lookup`` take.

    ``n_kv_heads`` (the k/v weights): when the active rules put more tensor shards
    than kv heads (``Rules.kv_repeat``), the weight is stored replicated along its
    kv heads and each head is repeated at use, so that every tensor shard gets the
    one its query heads use.

    ``param_dtype``: the dtype the parameter is stored in (``model.param_dtype``).
    Under ``train.grad_accum`` the step hands the model float32 copies of bfloat16
    parameters, so that each micro-batch's gradient comes back in float32 (the
    gradient of a value has its dtype) and is summed unrounded; the copy is
    narrowed back, exactly, before it is gathered, so the all-gather still moves
    bfloat16 bytes when the compute dtype is float32 (``gather`` gathers in the
    narrower of the value's and the compute dtype).
    """
    if isinstance(var, Quantized):
        return _use_quantized(var, dtype, n_kv_heads)
    value = var[...]
    names = _names(var)
    use = param_use(names, dtype, n_kv_heads)
    as_stored = value if param_dtype is None else value.astype(param_dtype)
    return checkpoint_name(gather(as_stored, use), "gathered_weight"), value, use


# The logical names of the stacked layers' leading axis: the stacks' names
# (decoder.stacks). The rules split ``layers`` over pipeline stages, ``dense_layers`` never.
STACKED_AXES = ("layers", "dense_layers")


def _names(var: nnx.Param) -> tuple[str, ...]:
    names = tuple(var.get_metadata()["logical_axes"])
    # Inside the layer scan a variable holds one layer's slice, while its
    # metadata still names the stacked ``layers`` axis.
    if len(names) == var[...].ndim + 1 and names[0] in STACKED_AXES:
        names = names[1:]
    return names


def _use_quantized(var: Quantized, dtype, n_kv_heads: int | None
                   ) -> tuple[jax.Array, jax.Array, ParamUse]:
    """``use_param`` of a frozen quantized weight (QLoRA): its codes and scales gathered
    to the compute layout as they are stored (FSDP moves the 4- or 8-bit codes), then
    read back in ``dtype``. The stored value handed on is the weight read back, cut
    from autodiff: a frozen base gets no gradient."""
    names = _names(var.codes)
    codes = gather(var.codes[...], param_use(names, var.codes[...].dtype, n_kv_heads))
    scales = gather(var.scales[...], param_use(names, jnp.float32, n_kv_heads))
    use = param_use(names, dtype, n_kv_heads)
    w = checkpoint_name(dequantize(codes, scales, var.q, dtype), "gathered_weight")
    return w, jax.lax.stop_gradient(w), use


def weight(var: nnx.Param, dtype, n_kv_heads: int | None = None) -> jax.Array:
    """A parameter gathered to its compute layout and cast, for forward-only uses (the
    KV-cache decode)."""
    return use_param(var, dtype, n_kv_heads)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def project(equation: str, x: jax.Array, w: jax.Array, stored: jax.Array, use: ParamUse
            ) -> jax.Array:
    """``jnp.einsum(equation, x, w)``, where ``w = gather(stored, use)`` is a stored
    parameter in its compute layout and dtype, whose gradient goes to ``stored``
    directly, in float32.

    Backward, the weight's gradient is formed in float32 from the device's tokens
    and handed to ``rules.scatter`` as it is: the partitioner sums it across the
    data axes with a reduce-scatter into the storage layout, in float32, and it is
    rounded to the parameter's dtype only as a shard. ``w`` gets no gradient (a
    zero, so autodiff runs nothing through ``gather``): a gradient of the
    compute-dtype ``w`` would be rounded to bfloat16 before the sum, which forces
    the partitioner to finish the sum first, an all-reduce of the whole gradient.
    Activations and their gradients stay in the compute dtype, and so do tensor
    parallelism's all-reduces of them.

    The residuals are ``x`` and ``w``, made outside, so remat policies decide about
    ``w`` like any value: none saves it (``ACTIVATIONS``), each layer gathers its
    weights again in the backward pass, and under ``remat=full`` the backward
    matmuls reuse the recomputed forward's gather.
    """
    return jnp.einsum(equation, x, w)


def _project_fwd(equation, x, w, stored, use):
    return project(equation, x, w, stored, use), (x, w, jnp.zeros((0,), stored.dtype))


def _project_bwd(equation, use, saved, g):
    x, w, dtype_of_stored = saved
    inputs, out = equation.split("->")
    x_sub, w_sub = inputs.split(",")
    dx = jnp.einsum(f"{out},{w_sub}->{x_sub}", g, w)
    dw = jnp.einsum(f"{x_sub},{out}->{w_sub}", x, g, preferred_element_type=jnp.float32)
    return dx, None, scatter(dw, use, dtype_of_stored.dtype)


project.defvjp(_project_fwd, _project_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def embed_lookup(table: jax.Array, tokens: jax.Array, stored: jax.Array, use: ParamUse
                 ) -> jax.Array:
    """``table[tokens]``, where ``table = gather(stored, use)``, whose gradient is
    scattered and summed in float32 and goes to ``stored`` unrounded (see
    ``project``)."""
    return jnp.take(table, tokens, axis=0)


def _embed_fwd(table, tokens, stored, use):
    # The table is no residual: its gradient reads only the tokens.
    return (embed_lookup(table, tokens, stored, use),
            (jnp.zeros((0,), stored.dtype), table.shape, tokens))


def _embed_bwd(use, saved, g):
    dtype_of_stored, shape, tokens = saved

    def local(tokens, g):
        return jnp.zeros(shape, jnp.float32).at[tokens].add(g.astype(jnp.float32))

    rules = active()
    if rules is None or not rules.data_axes:
        return None, None, scatter(local(tokens, g), use, dtype_of_stored.dtype)
    # Each device's tokens into a float32 table, summed over the data axes into the
    # table's storage layout (the partitioner, left to place the scatter-add itself,
    # all-reduces the whole table over some of them).
    axes = data_axes(rules)
    rows = rules.spec(("act_batch", "act_seq"))
    partials = jax.shard_map(
        lambda t, g: partials_out(local(t, g), use, axes),
        mesh=rules.mesh, axis_names=set(axes), in_specs=(rows, PartitionSpec(*rows, None)),
        out_specs=partials_spec(use, axes, len(shape)), check_vma=False)(tokens, g)
    return None, None, partials_sum(partials, use, axes, dtype_of_stored.dtype)


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def add_bias(x: jax.Array, b: jax.Array, stored: jax.Array, use: ParamUse) -> jax.Array:
    """``x + b``, where ``b = gather(stored, use)`` (Qwen's q/k/v biases, GPT-OSS's output
    bias), whose gradient, summed over the tokens in float32, goes to ``stored`` (see
    ``project``)."""
    return x + b


def _bias_fwd(x, b, stored, use):
    # An empty array with the bias's rank and dtype: what the backward needs of it.
    return add_bias(x, b, stored, use), jnp.zeros((0,) * stored.ndim, stored.dtype)


def _bias_bwd(use, like_stored, g):
    # Every leading axis of g beyond the bias's own is a token axis.
    db = jnp.sum(g.astype(jnp.float32), axis=tuple(range(g.ndim - like_stored.ndim)))
    return g, None, scatter(db, use, like_stored.dtype)


add_bias.defvjp(_bias_fwd, _bias_bwd)


class RMSNorm(nnx.Module):
    """``x / rms(x) * w`` in float32 (Llama, Qwen, Mistral); ``plus_one``: ``* (1 + w)``
    with w starting at 0 (Gemma). ``names``: the scale's logical axes."""

    def __init__(self, dim: int, eps: float, dtype: Any = jnp.float32, *,
                 plus_one: bool = False, names: tuple[str, ...] = ("norm",)):
        init = jnp.zeros if plus_one else jnp.ones
        self.scale = nnx.Param(init((dim,), dtype), logical_axes=names)
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x32 * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of rotary embeddings, as Hugging Face's ``rope_parameters``
    name it: ``llama3`` (Llama 3.1+: long wavelengths divided by ``factor``, a smooth
    band between), ``linear`` (every frequency divided by ``factor``: Gemma 3's
    global layers) or ``yarn`` (GPT-OSS, DeepSeek V3: frequencies that turn more than
    ``beta_fast`` times in ``original_max_position_embeddings`` kept, fewer than
    ``beta_slow`` divided by ``factor``, a ramp between; cos and sin times
    ``attention_scaling``). ``ROPE_FIELDS`` says which fields each type reads;
    ``attention_factor`` None: from ``factor`` and, where both are set, ``mscale`` /
    ``mscale_all_dim``."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """rope_type and the fields it reads (unset ones left out): Hugging Face's
        rope_parameters less rope_theta, and ``RopeScaling(**d)`` gives it back."""
        fields = {k: getattr(self, k) for k in ROPE_FIELDS[self.rope_type]}
        return {"rope_type": self.rope_type,
                **{k: v for k, v in fields.items() if v is not None}}

    @property
    def attention_scaling(self) -> float:
        """What cos and sin are multiplied by: 1 but for yarn (transformers'
        ``attention_scaling``)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


ROPE_TYPES = ("llama3", "linear", "yarn")
# The fields each rope_type reads.
ROPE_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate", "attention_factor", "mscale", "mscale_all_dim"),
}


@dataclasses.dataclass(frozen=True)
class Rope:
    """One layer's rotary embedding: base ``theta``, optional ``scaling``."""

    theta: float
    scaling: RopeScaling | None = None


def _llama3(inv: jax.Array, s: RopeScaling) -> jax.Array:
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling) -> jax.Array:
    # transformers' _compute_yarn_parameters, operation for operation.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by 0
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of each original frequency
    pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    return (1.0 / (s.factor * pos_freqs) * (1 - extrapolation)
            + 1.0 / pos_freqs * extrapolation)


def rope_frequencies(rope: Rope, head_dim: int) -> jax.Array:
    """Inverse frequencies (float32), scaled as Hugging Face scales them."""
    s = rope.scaling
    if s is not None and s.rope_type == "yarn":
        return _yarn(rope.theta, head_dim, s)
    inv = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if s is None:
        return inv
    if s.rope_type == "linear":
        return inv / s.factor
    if s.rope_type == "llama3":
        return _llama3(inv, s)
    raise ValueError(f"rope_type={s.rope_type!r}: choose one of {ROPE_TYPES}")


def rope_tables(rope: Rope, head_dim: int, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
    """cos and sin (b, s, head_dim) of each token's position, for ``apply_rope`` (times
    yarn's attention scaling)."""
    freqs = positions[..., None].astype(jnp.float32) * rope_frequencies(rope, head_dim)
    freqs = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    scale = 1.0 if rope.scaling is None else rope.scaling.attention_scaling
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: (b, s, heads, hd); cos/sin: (b, s, hd)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


# The gated MLP's activation, by Hugging Face's ``hidden_act`` / ``hidden_activation``.
ACTIVATION_FNS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True),
}
