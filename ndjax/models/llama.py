"""Llama 3 in Flax NNX, speaking only logical axis names.

Every parameter carries ``logical_axes`` metadata; key activations are
constrained by logical name through ``ndjax.rules``. The decoder stack is one
block with stacked parameters (leading ``layers`` axis) run by ``lax.scan``, so
compile time does not grow with depth; ``scan_layers=False`` runs the same
stacked parameters in a Python loop (the default for small models on CPU:
``default_scan_layers``).

Weights are stored in ``param_dtype`` (float32 by default) and cast to the
compute dtype at use. Layouts follow Hugging Face's conventions (rotate-half
RoPE, q/k/v/o per head) so that checkpoints convert by reshapes only.
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

from ndjax.ops.attention import HEADS, KV_HEADS, attention
from ndjax.ops.layer_scan import scan_full_remat
from ndjax.rules import (
    ParamUse,
    Weight,
    active,
    constrain,
    data_axes,
    gather,
    param_use,
    partials_out,
    partials_spec,
    partials_sum,
    scatter,
)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 frequency scaling (``rope_scaling`` of type ``llama3`` in HF)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    head_dim: int | None = None  # defaults to dim // n_heads
    rope_theta: float = 500_000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: Any = jnp.float32      # compute dtype
    param_dtype: Any = jnp.float32  # storage dtype of the parameters
    scan_layers: bool = True
    remat: str = "none"           # see REMAT_POLICIES
    attn_impl: str = "auto"       # a kernel of ndjax.ops.attention.KERNELS, or auto
    cp_layout: str = "zigzag"     # ring attention's sequence layout: zigzag | contiguous
    attn_kv_tile: int = 512       # ring attention's key tile: memory O(local_len x tile)
    attn_max_docs: int = 64       # documents per row the cudnn kernel makes room for

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads


PRESETS: dict[str, dict[str, Any]] = {
    # CPU demo, about 10M parameters.
    "tiny": dict(vocab_size=2048, dim=256, n_layers=8, n_heads=8, n_kv_heads=4,
                 ffn_dim=1024, rope_theta=10_000.0),
    # Dimensions of the public Llama 3.2 1B, Llama 3.1 8B and 70B models.
    "llama3_1b": dict(vocab_size=128_256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, head_dim=64, tie_embeddings=True,
                      rope_scaling=RopeScaling(factor=32.0)),
    "llama3_8b": dict(vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14_336, rope_scaling=RopeScaling(factor=8.0)),
    "llama3_70b": dict(vocab_size=128_256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_dim=28_672, rope_scaling=RopeScaling(factor=8.0)),
}

# What each remat policy saves for the backward pass; everything else in a layer
# is recomputed. Policies say what to save, never what to refuse, so nothing is
# kept by accident: the weights a layer gathers for compute (FSDP) and their
# compute-dtype casts are not activations, appear in no list, and are gathered
# again in the backward pass instead of being kept for all layers at once (a
# full unsharded copy of the model per device). ``checkpoint_name`` tags below
# mark the candidates.
ACTIVATIONS = ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "attn_lse",
               "attn_block_out", "mlp_norm", "mlp_gate", "mlp_up", "mlp_out")
_save = jax.checkpoint_policies.save_only_these_names

# model.scan_layers unset: up to this many layers run unrolled on a CPU.
CPU_UNROLL_MAX_LAYERS = 8


def default_scan_layers(n_layers: int, platform: str) -> bool:
    """Whether the layers are scanned when ``model.scan_layers`` is unset.

    Scanned everywhere but on a CPU with at most ``CPU_UNROLL_MAX_LAYERS`` layers.
    There, the scan's own work is a tenth of the step: it zero-fills the stacked
    residuals it saves for the backward pass, writes and reads them one layer at a
    time, and runs each layer's independent matmuls with less overlap;
    ``bench/cpu_vs_torch.py``'s model trains ~13% faster unrolled. Unrolled, the
    compile time grows with depth, but up to 8 layers it stays within that of the
    scan (``bench/compile_time.py``). Large models, and any step compiled for a
    GPU, keep the scan: its memory is the one to plan with.
    """
    return platform != "cpu" or n_layers > CPU_UNROLL_MAX_LAYERS


REMAT_POLICIES = {
    # No rematerialisation of matmuls: every named activation is saved (the
    # dense kernel's attention probabilities too); only cheap elementwise work
    # (RoPE, SwiGLU) is redone from them. Names, not "every dot": a dot inside
    # the tiled attention kernel's loop would be saved for every tile, O(seq^2).
    "none": _save(*ACTIVATIONS, "attn_probs"),
    # Only each layer's input is kept (the scan carry); the whole layer is
    # recomputed in the backward pass.
    "full": jax.checkpoint_policies.nothing_saveable,
    # Save the projections (the expensive matmuls), recompute norms, RoPE,
    # softmax and the SwiGLU elementwise work.
    "save_proj": _save("q_proj", "k_proj", "v_proj", "attn_out", "attn_lse", "mlp_gate",
                       "mlp_up", "mlp_out"),
    # Save only the attention output: about half of "save_proj"'s memory,
    # recomputes the QKV and MLP matmuls.
    "save_attn": _save("attn_out", "attn_lse"),
}


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float,
           dtype: Any) -> nnx.Param:
    # Drawn in float32 and rounded once, so a bfloat16 model starts from the
    # float32 model's values rounded (the same random stream for both).
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, logical_axes=names)


def _use(var: nnx.Param, dtype, n_kv_heads: int | None = None, param_dtype: Any = None
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
    value = var[...]
    names = var.get_metadata()["logical_axes"]
    # Inside the layer scan a variable holds one layer's slice, while its
    # metadata still names the stacked ``layers`` axis.
    if len(names) == value.ndim + 1 and names[0] == "layers":
        names = names[1:]
    use = param_use(names, dtype, n_kv_heads)
    as_stored = value if param_dtype is None else value.astype(param_dtype)
    return checkpoint_name(gather(as_stored, use), "gathered_weight"), value, use


def _weight(var: nnx.Param, dtype, n_kv_heads: int | None = None) -> jax.Array:
    """A parameter gathered to its compute layout and cast, for forward-only uses (the
    KV-cache decode)."""
    return _use(var, dtype, n_kv_heads)[0]


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


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any = jnp.float32):
        self.scale = nnx.Param(jnp.ones((dim,), dtype), logical_axes=("norm",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...]).astype(x.dtype)


def rope_frequencies(cfg: LlamaConfig) -> jax.Array:
    """Inverse frequencies, with Llama 3 scaling applied as Hugging Face does."""
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.hd, 2, dtype=jnp.float32) / cfg.hd))
    s = cfg.rope_scaling
    if s is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)


def rope_tables(cfg: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin (b, s, head_dim) of each token's position, for ``apply_rope``."""
    freqs = positions[..., None].astype(jnp.float32) * rope_frequencies(cfg)
    freqs = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: (b, s, heads, hd); cos/sin: (b, s, hd)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x32 * cos[:, :, None] + rotated * sin[:, :, None]).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, hd, std = cfg.dim, cfg.hd, cfg.init_std
        pd = cfg.param_dtype
        self.wq = _param(rngs, (d, cfg.n_heads, hd), ("embed", "q_heads", "head_dim"), std, pd)
        self.wk = _param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std,
                         pd)
        self.wv = _param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std,
                         pd)
        self.wo = _param(rngs, (cfg.n_heads, hd, d), ("q_heads", "head_dim", "embed"), std, pd)
        self.dtype = cfg.dtype
        self.cfg = cfg

    def __call__(self, x, cos, sin, segment_ids):
        q, k, v = self.qkv(x, cos, sin)
        return self.output(attention(q, k, v, segment_ids, self.cfg))

    def qkv(self, x, cos, sin):
        """Queries, keys and values of ``x``, rotated (the KV-cache decode reuses it)."""
        dt, n_kv, pd = self.dtype, self.cfg.n_kv_heads, self.cfg.param_dtype
        q = project("bsd,dhk->bshk", x, *_use(self.wq, dt, param_dtype=pd))
        k = project("bsd,dhk->bshk", x, *_use(self.wk, dt, n_kv, pd))
        v = project("bsd,dhk->bshk", x, *_use(self.wv, dt, n_kv, pd))
        q = checkpoint_name(constrain(q, HEADS), "q_proj")
        k = checkpoint_name(constrain(k, KV_HEADS), "k_proj")
        v = checkpoint_name(constrain(v, KV_HEADS), "v_proj")
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out):
        """The attention's output (b, s, heads, head_dim) projected back to the model dim."""
        out = checkpoint_name(constrain(out, HEADS), "attn_out")
        return project("bshk,hkd->bsd", out,
                       *_use(self.wo, self.dtype, param_dtype=self.cfg.param_dtype))


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, f, std = cfg.dim, cfg.ffn_dim, cfg.init_std
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), std, cfg.param_dtype)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), std, cfg.param_dtype)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), std, cfg.param_dtype)
        self.dtype = cfg.dtype
        self.param_dtype = cfg.param_dtype

    def __call__(self, x):
        dt, pd = self.dtype, self.param_dtype
        names = ("act_batch", "act_seq", "act_mlp")
        gate = checkpoint_name(constrain(project(
            "bsd,df->bsf", x, *_use(self.w_gate, dt, param_dtype=pd)), names), "mlp_gate")
        up = checkpoint_name(constrain(project(
            "bsd,df->bsf", x, *_use(self.w_up, dt, param_dtype=pd)), names), "mlp_up")
        h = jax.nn.silu(gate) * up
        return project("bsf,fd->bsd", h, *_use(self.w_down, dt, param_dtype=pd))


RESIDUAL = ("act_batch", "act_res_seq", "act_embed")
HIDDEN = ("act_batch", "act_seq", "act_embed")


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps, cfg.param_dtype)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cos, sin, segment_ids):
        return self.around(x, lambda h: self.attn(h, cos, sin, segment_ids))

    def around(self, x, attend):
        """The block with ``attend`` (normed input -> attention's projected output) as
        its attention: the KV-cache decode passes one that reads and writes the cache."""
        h = checkpoint_name(constrain(self.attn_norm(x), HIDDEN), "attn_norm")
        attn = checkpoint_name(attend(h), "attn_block_out")
        x = constrain(x + attn, RESIDUAL)
        h = checkpoint_name(constrain(self.mlp_norm(x), HIDDEN), "mlp_norm")
        out = checkpoint_name(self.mlp(h), "mlp_out")
        return constrain(x + out, RESIDUAL)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        if cfg.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={cfg.remat!r}: choose one of {sorted(REMAT_POLICIES)}")
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", "embed"), cfg.init_std,
                            cfg.param_dtype)

        @nnx.vmap(in_axes=0, out_axes=0,
                  transform_metadata={nnx.PARTITION_NAME: "layers", "logical_axes": "layers"})
        def stacked(key):
            return Block(cfg, nnx.Rngs(params=key))

        self.layers = stacked(jax.random.split(rngs.params(), cfg.n_layers))
        self.final_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps, cfg.param_dtype)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"),
                                  cfg.init_std, cfg.param_dtype)

    def features(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array
                 ) -> tuple[jax.Array, Weight]:
        """tokens, positions, segment_ids: (b, s) int32 -> (final hidden states (b, s, dim)
        in the compute dtype, LM head (dim, vocab): a ``rules.Weight``, gathered to its
        compute layout and as stored).

        The loss applies the head chunk by chunk (``ndjax.ops.cross_entropy``) so that
        the whole batch's logits never exist at once, and gives the head's gradient to
        the stored head, summed in float32. Tied embeddings are gathered once, for the
        lookup and the head; each of the two gradients reaches the storage layout on
        its own, unrounded.
        """
        cfg = self.cfg
        embed = _use(self.embed, cfg.dtype, param_dtype=cfg.param_dtype)
        x = constrain(embed_lookup(embed[0], tokens, *embed[1:]), RESIDUAL)

        cos, sin = rope_tables(cfg, positions)

        graphdef, stacked_state = nnx.split(self.layers)

        def layer(h, layer_state, consts):
            return nnx.merge(graphdef, layer_state)(h, *consts)

        consts = (cos, sin, segment_ids)
        # The segment ids ride in the scan's carry, not as a constant of the body:
        # jax hoists work that depends only on a scan's constants out of the loop,
        # and for the tiled attention kernel that work is every key tile's mask,
        # stacked: O(seq^2) memory (tests/test_attention.py).
        body = jax.checkpoint(
            lambda carry, p: ((layer(carry[0], p, (cos, sin, carry[1])), carry[1]), None),
            policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers and cfg.remat == "full":
            x = scan_full_remat(layer, x, stacked_state, consts)
        elif cfg.scan_layers:
            (x, _), _ = jax.lax.scan(body, (x, segment_ids), stacked_state)
        else:
            for i in range(cfg.n_layers):
                (x, _), _ = body((x, segment_ids), jax.tree.map(lambda a, i=i: a[i], stacked_state))

        x = constrain(self.final_norm(x), HIDDEN)
        if cfg.tie_embeddings:
            return x, Weight(*embed).T
        return x, Weight(*_use(self.lm_head, cfg.dtype, param_dtype=cfg.param_dtype))

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        """tokens, positions, segment_ids: (b, s) int32 -> logits (b, s, vocab) float32.

        For inspection and conversion tests; training never builds all the logits.
        """
        x, head = self.features(tokens, positions, segment_ids)
        logits = jnp.einsum("bsd,dv->bsv", x, head.gathered,
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab"))


def config_from_preset(name: str, **overrides: Any) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"model.preset={name!r}: choose one of {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[name], **overrides})


def logical_axes(state: nnx.State) -> dict:
    """Nested dict of logical axis names (tuples), mirroring the parameter dict."""
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tuple(var.get_metadata()["logical_axes"])
    return out


def num_params(cfg: LlamaConfig, *, embeddings: bool = True) -> int:
    d, f, hd = cfg.dim, cfg.ffn_dim, cfg.hd
    per_layer = d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * d * f + 2 * d
    n = cfg.n_layers * per_layer + d
    if embeddings:
        n += cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return n
