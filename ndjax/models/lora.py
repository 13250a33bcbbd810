"""LoRA: low-rank adapters beside a frozen base (Hu et al. 2021; PEFT's conventions).

A targeted projection ``y = x W`` becomes ``y = x W + scale * (x A) B``: ``A`` maps the
base weight's input dims to ``rank``, ``B`` maps ``rank`` to its output dims, and
``scale`` is ``alpha / rank`` (``alpha / sqrt(rank)`` with rsLoRA). As PEFT inits them,
``A`` is Kaiming-uniform (bound ``1 / sqrt(fan_in)``) and ``B`` is zero, so a fresh
adapter leaves the base model's outputs exactly as they were.

The adapters carry the base weight's logical names (``A`` its input's, ``B`` its
output's, the rank axis ``lora_rank``), so the rule table lays them out like the
weight they adapt: under FSDP both are stored sharded and gathered at use, under
tensor parallelism ``B`` of a column-parallel weight is split like it. They are
stored in float32 whatever ``model.param_dtype`` (PEFT's ``autocast_adapter_dtype``):
they are small, and the base is what is narrow.

Adapters live in the parameter tree as ``lora_<target>`` modules (``.../attn/lora_q/a``)
beside the weight they adapt; ``split`` and ``merge`` separate the trainable leaves
from the frozen base by that name.

``lora_dropout`` (PEFT's) drops the adapter's input, not the base's:
``y = x W + scale * (dropout(x) A) B``, a mask of its own for each projection
(``Dropout``). The train step alone applies it; evaluation and generation do not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, traverse_util

from ndjax.models.quant import QuantConfig, dequantized

# ndjax's name of each projection a LoRA can target -> PEFT's (Hugging Face's) module name.
TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
           "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
MLP_TARGETS = ("gate", "up", "down")
ALL_LINEAR = "all-linear"  # PEFT's name for every linear layer but the LM head
PREFIX = "lora_"
# PEFT's modules_to_save ndjax can train in full beside the adapters -> the top-level
# parameter each is (with tied embeddings lm_head is embed_tokens' table).
SAVABLE = {"embed_tokens": "embed", "lm_head": "lm_head"}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    targets: tuple[str, ...]   # keys of TARGETS
    rslora: bool = False
    # PEFT's lora_dropout: the probability that an element of an adapter's input is
    # zeroed in training (the rest are scaled by 1 / (1 - dropout)).
    dropout: float = 0.0
    # QLoRA: the frozen base's projections stored quantized (ndjax.models.quant); None:
    # in model.param_dtype.
    quant: QuantConfig | None = None
    # PEFT's modules_to_save (keys of SAVABLE): trained in full beside the adapters.
    saved: tuple[str, ...] = ()

    @property
    def saved_params(self) -> tuple[str, ...]:
        """The top-level parameters ``saved`` trains."""
        return tuple(dict.fromkeys(SAVABLE[m] for m in self.saved))

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def parse_targets(value: str) -> tuple[str, ...] | str:
    """``lora.target_modules`` ("all-linear", or comma-separated names in ndjax's or PEFT's
    spelling: "q,v" or "q_proj,v_proj") -> the TARGETS keys, in TARGETS' order; or the
    first name that is none of them (the caller's error)."""
    if value.strip() == ALL_LINEAR:
        return tuple(TARGETS)
    by_peft = {v: k for k, v in TARGETS.items()}
    chosen = set()
    for name in (n.strip() for n in value.split(",")):
        key = name if name in TARGETS else by_peft.get(name)
        if key is None:
            return name
        chosen.add(key)
    return tuple(k for k in TARGETS if k in chosen)


class Adapter(nnx.Module):
    """The adapter of one base weight of shape ``in_shape + out_shape`` whose names are
    ``in_names + out_names``: ``a`` (in_shape..., rank) and ``b`` (rank, out_shape...)."""

    def __init__(self, rngs: nnx.Rngs, in_shape: Sequence[int], in_names: Sequence[str],
                 out_shape: Sequence[int], out_names: Sequence[str], rank: int):
        fan_in = math.prod(in_shape)
        bound = 1.0 / math.sqrt(fan_in)
        self.a = nnx.Param(jax.random.uniform(rngs.params(), (*in_shape, rank), jnp.float32,
                                              -bound, bound),
                           logical_axes=(*in_names, "lora_rank"))
        self.b = nnx.Param(jnp.zeros((rank, *out_shape), jnp.float32),
                           logical_axes=("lora_rank", *out_names))


def equations(equation: str, n_in: int) -> tuple[str, str]:
    """The base projection's einsum (``"bsd,dhk->bshk"``, whose weight's first ``n_in``
    dims are contracted) -> the two einsums of its adapter, through the rank ``r``."""
    inputs, out = equation.split("->")
    x_sub, w_sub = inputs.split(",")
    contracted, produced = w_sub[:n_in], w_sub[n_in:]
    kept = "".join(c for c in x_sub if c not in contracted)
    assert "r" not in equation, equation
    return f"{x_sub},{contracted}r->{kept}r", f"{kept}r,r{produced}->{out}"


def is_adapter(path: Sequence[Any]) -> bool:
    return any(str(getattr(k, "key", k)).startswith(PREFIX) for k in path)


def adapters_off(params: Any) -> Any:
    """``params`` with every adapter zeroed: exactly the base model's output (PEFT's
    ``disable_adapter``), without a copy of the base."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.zeros_like(a) if is_adapter(path) else a, params)


# Parameters the step moves by a rule of its own, never by the optimizer (its update is
# zeroed: ndjax.step.train_step): DeepSeek V3's load-balancing bias
# (ndjax.models.moe.update_score_bias). Under LoRA they go with the adapters.
STEPPED = ("score_bias",)


def split(params: dict, adapters_only: bool, saved: Sequence[str] = ()
          ) -> tuple[dict, dict]:
    """(trainable, frozen) parts of a nested parameter dict: with ``adapters_only``, the
    adapters (and the top-level parameters ``saved``: ``LoraConfig.saved_params``) and
    the rest; else everything and nothing."""
    if not adapters_only:
        return params, {}
    flat = traverse_util.flatten_dict(params)
    # What the step moves by a rule of its own (STEPPED) goes with the adapters, so that
    # checkpoints hold it.
    trained = {k for k in flat if is_adapter(k) or k[0] in saved or k[-1] in STEPPED}
    train = {k: v for k, v in flat.items() if k in trained}
    frozen = {k: v for k, v in flat.items() if k not in trained}
    return traverse_util.unflatten_dict(train), traverse_util.unflatten_dict(frozen)


def trainable(params: Any, adapters_only: bool, saved: Sequence[str] = ()) -> Any:
    """``split``'s trainable part alone."""
    return split(params, adapters_only, saved)[0]


def merge(frozen: dict, trainable: dict) -> dict:
    """The whole parameter dict from ``split``'s two parts."""
    if not frozen:
        return trainable
    return traverse_util.unflatten_dict({**traverse_util.flatten_dict(frozen),
                                         **traverse_util.flatten_dict(trainable)})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dropout:
    """One layer's LoRA dropout in one train step.

    The mask of an element is a function of the step's seed, the layer, the target
    and the token's place in the step's batch alone (``token_ids``: row x seq_len +
    position in the unpermuted row), never of where the element is computed. So every
    layout draws the same masks: the batch split over devices, the sequence permuted
    for ring attention (zigzag) or cut into micro-batches, the layers scanned or not.
    Each token's mask is drawn from its own key, ``fold_in(key, token_id)``; under
    partitionable threefry (jax's default) the bits of a sharded array do not depend
    on its sharding.
    """

    key: jax.Array        # this layer's key (typed)
    token_ids: jax.Array  # (b, s) uint32
    rate: float = dataclasses.field(metadata=dict(static=True))

    def at_layer(self, layer: jax.Array) -> Dropout:
        return dataclasses.replace(self, key=jax.random.fold_in(self.key, layer))

    def __call__(self, x: jax.Array, target: str) -> jax.Array:
        """``x`` (b, s, ...) with the elements dropped for ``target``'s adapter zeroed
        and the rest scaled by 1 / (1 - rate), as ``torch.nn.Dropout`` does."""
        key = jax.random.fold_in(self.key, tuple(TARGETS).index(target))
        keep = 1.0 - self.rate

        def token_mask(token):
            return jax.random.bernoulli(jax.random.fold_in(key, token), keep, x.shape[2:])
        mask = jax.vmap(jax.vmap(token_mask))(self.token_ids)
        return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))


def step_dropout(rate: float, seed: int, step: jax.Array, batch: int, seq_len: int,
                 permutation: Any = None) -> Dropout | None:
    """The step's ``Dropout`` (None when ``rate`` is 0): keyed by the seed and the step
    counter, so a resumed run draws the masks the uninterrupted one would.
    ``permutation``: the host's permutation of the sequence axis (ring attention's
    zigzag; ``x_device = x[:, permutation]``), so a token's id is its unpermuted
    position."""
    if not rate:
        return None
    position = jnp.arange(seq_len, dtype=jnp.uint32)
    if permutation is not None:
        position = jnp.asarray(permutation, jnp.uint32)
    rows = jnp.arange(batch, dtype=jnp.uint32)[:, None] * jnp.uint32(seq_len)
    key = jax.random.fold_in(jax.random.key(seed), step)
    return Dropout(key=key, token_ids=rows + position[None, :], rate=rate)


def adapted(out: jax.Array, adapter: Adapter | None, equation: str, x: jax.Array, n_in: int,
            dtype: Any, scale: float, n_kv_heads: int | None = None,
            dropout: Dropout | None = None, target: str = "") -> jax.Array:
    """``out`` (the base projection of ``x`` by ``equation``, whose weight's first ``n_in``
    dims are contracted) plus the adapter's ``scale * (x A) B``; ``out`` itself when the
    projection has no adapter. Both matmuls go through ``layers.project``: the adapters
    are gathered for use and given float32 gradients like any weight. ``dropout``:
    ``x`` seen by the adapter through ``target``'s mask."""
    if adapter is None:
        return out
    from ndjax.models.layers import project, use_param

    eq_a, eq_b = equations(equation, n_in)
    if dropout is not None:
        x = dropout(x, target)
    h = project(eq_a, x, *use_param(adapter.a, dtype, param_dtype=jnp.float32))
    delta = project(eq_b, h, *use_param(adapter.b, dtype, n_kv_heads, param_dtype=jnp.float32))
    return out + delta * jnp.asarray(scale, delta.dtype)


def make(cfg: Any, rngs: nnx.Rngs, target: str, weight: nnx.Param, n_in: int
         ) -> Adapter | None:
    """The adapter of ``weight`` (target ``target``) if ``cfg.lora`` targets it."""
    lora = cfg.lora
    if lora is None or target not in lora.targets:
        return None
    shape, names = weight[...].shape, weight.get_metadata()["logical_axes"]
    return Adapter(rngs, shape[:n_in], names[:n_in], shape[n_in:], names[n_in:], lora.rank)


# Each target's base weight: (the module holding it, its name there, the dims its
# input has: the weight's leading ones).
BASE_WEIGHTS = {"q": ("attn", "wq", 1), "k": ("attn", "wk", 1), "v": ("attn", "wv", 1),
                "o": ("attn", "wo", 2), "gate": ("mlp", "w_gate", 1), "up": ("mlp", "w_up", 1),
                "down": ("mlp", "w_down", 1)}


def adapter_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each of one layer's adapted projections, by target: those of
    ``cfg.lora.targets`` the model has (a mixture of experts has no dense MLP)."""
    q, kv = cfg.n_heads * cfg.hd, cfg.n_kv_heads * cfg.hd
    # Latent attention (DeepSeek V3) takes o's adapter alone, on its v_head_dim-wide heads.
    o = cfg.n_heads * (cfg.v_head_dim or cfg.hd) if cfg.kv_lora_rank else q
    sizes = {"o": (o, cfg.dim)} if cfg.kv_lora_rank else {
        "q": (cfg.dim, q), "k": (cfg.dim, kv), "v": (cfg.dim, kv), "o": (q, cfg.dim)}
    if not cfg.n_experts:
        sizes.update(gate=(cfg.dim, cfg.ffn_dim), up=(cfg.dim, cfg.ffn_dim),
                     down=(cfg.ffn_dim, cfg.dim))
    return {t: sizes[t] for t in cfg.lora.targets if t in sizes}


def num_adapter_params(cfg: Any) -> int:
    """The adapters' parameters, all layers: what a LoRA run trains."""
    return cfg.n_layers * sum(cfg.lora.rank * (n_in + n_out)
                              for n_in, n_out in adapter_shapes(cfg).values())


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * A B`` of stacked adapters (layers, in..., r) and (layers, r, out...) ->
    (layers, in..., out...) in float32: what the adapter adds to the base weight."""
    layers, rank = a.shape[0], a.shape[-1]
    flat = jnp.einsum("lir,lro->lio", a.reshape(layers, -1, rank).astype(jnp.float32),
                      b.reshape(layers, rank, -1).astype(jnp.float32))
    return scale * flat.reshape(*a.shape[:-1], *b.shape[2:])


def merged(params: dict, cfg: Any) -> dict:
    """The parameters with every adapter folded into its base weight, ``W + scale A B``
    in float32 (the other weights as stored), the adapters gone: the model a plain
    transformers checkpoint describes. Without LoRA, ``params`` itself."""
    if cfg.lora is None:
        return params
    params = dequantized(params, cfg.lora.quant)
    frozen = traverse_util.flatten_dict(split(params, True)[1])
    # Each stack of layers (decoder.stacks: "layers", and DeepSeek V3's "dense_layers").
    for stack in (k for k in params if k.endswith("layers")):
        for target in cfg.lora.targets:
            module, name, _ = BASE_WEIGHTS[target]
            adapter = params[stack][module].get(PREFIX + target)
            if adapter is None:
                continue
            key = (stack, module, name)
            frozen[key] = jax.jit(
                lambda w, a, b: w.astype(jnp.float32) + delta(a, b, cfg.lora.scale),
                out_shardings=getattr(frozen[key], "sharding", None))(
                frozen[key], adapter["a"], adapter["b"])
    return traverse_util.unflatten_dict(frozen)
