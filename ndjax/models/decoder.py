"""The decoder every family builds: embeddings, a stack of blocks, a final norm and
an LM head, speaking only logical axis names.

A family (``ndjax.models.registry``) chooses the block's options in its
``DecoderConfig``: q/k/v biases (Qwen 2.5), per-head q/k norms (Qwen 3, Gemma 3),
Gemma's ``(1 + w)`` norms, norms after attention and the MLP, scaled embeddings,
the MLP's activation or a mixture of experts in its place (Mixtral, Qwen3-MoE:
``ndjax.models.moe``), the attention's scale and sliding window, and which layers
are local (windowed, with their own rotary base) or global
(``sliding_window_pattern``).

The stack is one block with stacked parameters (leading ``layers`` axis) run by
``lax.scan``, so compile time does not grow with depth. Layers of different types
(Gemma 3: five local, one global) are scanned in groups of the pattern's period,
each layer of a group with its own static attention spec, so that a kernel can
skip what a window excludes; layers past the last whole period run after the
scan. ``scan_layers=False`` runs the same stacked parameters in a Python loop.

Weights are stored in ``param_dtype`` (float32 by default) and cast to the
compute dtype at use. Layouts follow Hugging Face's conventions (rotate-half
RoPE, q/k/v/o per head) so that checkpoints convert by reshapes only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ndjax.models import lora as lora_lib
from ndjax.models import mla, quant
from ndjax.models.layers import (
    ACTIVATION_FNS,
    RMSNorm,
    Rope,
    RopeScaling,
    add_bias,
    apply_rope,
    embed_lookup,
    init_param,
    project,
    rope_tables,
    use_param,
)
from ndjax.models.moe import PER_LAYER, MoE, aux_metrics
from ndjax.ops.attention import HEADS, KV_HEADS, AttentionSpec, attention
from ndjax.ops.layer_scan import scan_full_remat
from ndjax.parallel import pipeline
from ndjax.parallel.rules import Weight, constrain, gathered, params_gathered

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
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
    # The family's block (ndjax.models.registry.Family.fixed and .options say which
    # a family has and which a config may change).
    family: str = "llama"
    qkv_bias: bool = False          # biases on q, k, v (Qwen 2.5)
    o_bias: bool = False            # a bias on the attention's output projection (GPT-OSS)
    # Multi-head latent attention (DeepSeek V3, ndjax.models.mla) where kv_lora_rank > 0:
    # keys and values from a kv_lora_rank latent, queries from a q_lora_rank one (0: a
    # plain projection); head_dim = the no-rope dims + rope_head_dim rotary ones, values
    # v_head_dim wide; the rotary dims in interleaved pairs where rope_interleave.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # A learned logit per query head in each row's softmax, with no value (GPT-OSS's sinks).
    attn_sinks: bool = False
    qk_norm: bool = False           # RMSNorm over each head of q and k before RoPE
    norm_plus_one: bool = False     # norms scale by (1 + w) (Gemma)
    post_norms: bool = False        # norms on the attention's and MLP's outputs too
    activation: str = "silu"        # of the gated MLP: a key of layers.ACTIVATION_FNS
    embed_scale: bool = False       # embeddings times sqrt(dim) (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2; None: head_dim's
    sliding_window: int | None = None  # keys a local layer's query sees, itself included
    # With a window: every n-th layer is global (Gemma 3: 6); None: every layer local.
    sliding_window_pattern: int | None = None
    local_rope_theta: float | None = None  # local layers' base, unscaled; None: as global
    attn_softcap: float | None = None
    # Mixture of experts (ndjax.models.moe): every layer's MLP is n_experts SwiGLU experts,
    # experts_per_token of them per token; 0: the dense MLP.
    n_experts: int = 0
    experts_per_token: int = 0      # top-k
    moe_ffn_dim: int = 0            # each expert's width; 0: ffn_dim's (Mixtral)
    norm_topk_prob: bool = False    # the top-k weights renormalised to sum to 1
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the loss
    # Qwen 2 MoE's shared expert: a SwiGLU MLP this wide that every token runs through
    # beside its top-k, its output scaled by sigmoid(x . w_shared_gate); 0: none.
    shared_expert_dim: int = 0
    # The shared expert's output scaled by a sigmoid gate of its own (Qwen 2 MoE), or
    # added as it is (DeepSeek V3's shared experts).
    shared_expert_gate: bool = True
    # The first layers' MLP dense (ffn_dim wide), the others' experts (DeepSeek V3's
    # first_k_dense_replace): a stack of their own (``Decoder.dense_layers``).
    first_k_dense: int = 0
    # DeepSeek V3's routing (ndjax.models.moe.route): sigmoid scores, the experts chosen
    # by the scores plus a load-balancing bias (score_bias) that moves by
    # score_bias_rate after each step, among topk_group of n_group groups, their
    # weights times routed_scaling_factor.
    router_score: str = "softmax"   # softmax | sigmoid
    score_bias: bool = False
    score_bias_rate: float = 0.0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router_bias: bool = False       # a bias on the router's logits (GPT-OSS)
    expert_bias: bool = False       # biases on each expert's gate, up and down (GPT-OSS)
    # GPT-OSS's experts: gate clamped above and up to +-limit, then
    # (up + 1) * gate * sigmoid(alpha * gate); None: the activation's plain gated MLP.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    moe_impl: str = "auto"          # the experts' grouped matmuls: ndjax.ops.grouped_matmul
    # None: dropless. Else each expert takes at most ceil(capacity_factor x seq_len x
    # experts_per_token / n_experts) of a row's (token, expert) pairs, earliest first
    # (ndjax.models.moe.within_capacity); the rest are dropped.
    capacity_factor: float | None = None
    # LoRA adapters on the projections it targets (ndjax.models.lora); None: none.
    lora: lora_lib.LoraConfig | None = None
    init_std: float = 0.02
    dtype: Any = jnp.float32      # compute dtype
    param_dtype: Any = jnp.float32  # storage dtype of the parameters
    scan_layers: bool = True
    remat: str = "none"           # see REMAT_POLICIES
    attn_impl: str = "auto"       # a kernel of ndjax.ops.attention.KERNELS, or auto
    cp_layout: str = "zigzag"     # ring attention's sequence layout: zigzag | contiguous
    cp_impl: str = "auto"         # context parallelism: ring | all_to_all | auto
    attn_kv_tile: int = 512       # ring attention's key tile: memory O(local_len x tile)
    attn_max_docs: int = 64       # documents per row the cudnn kernel makes room for
    # Pipeline parallelism (ndjax.parallel.pipeline): the layers cut into ``stages`` runs
    # over the mesh's stage axis, the rows into ``microbatches``.
    stages: int = 1
    microbatches: int = 1
    # Chunks of layers per stage (the circular schedule where > 1): the pipelined stack's
    # parameters are stored in ``pipeline.storage_order`` (``layer_order``).
    virtual_stages: int = 1
    # Each stage's layers gathered over the data axes once per step, not once per tick.
    pipeline_gather_once: bool = False
    # gpipe (circular where virtual_stages > 1) | 1f1b: pipeline.schedule's ``kind``.
    pipeline_schedule: str = "gpipe"

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The rotary dims of a query or key head: MLA's rope_head_dim, else all."""
        return self.rope_head_dim if self.kv_lora_rank else self.hd

    @property
    def expert_dim(self) -> int:
        """Each expert's width (MoE)."""
        return self.moe_ffn_dim or self.ffn_dim

    @property
    def types(self) -> tuple[str, ...]:
        """Each layer's type, full_attention or sliding_attention."""
        if not self.sliding_window:
            return (FULL,) * self.n_layers
        every = self.sliding_window_pattern
        return tuple(FULL if every and (i + 1) % every == 0 else SLIDING
                     for i in range(self.n_layers))

    def spec(self, layer_type: str) -> AttentionSpec:
        scale = (None if self.query_pre_attn_scalar is None
                 else self.query_pre_attn_scalar ** -0.5)
        if self.kv_lora_rank:  # explicit: MLA pads v, q and k for the kernels
            scale = mla.score_scale(self)
        window = self.sliding_window if layer_type == SLIDING else None
        return AttentionSpec(window=window, softcap=self.attn_softcap, scale=scale,
                             sinks=self.attn_sinks)

    @property
    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        """The distinct attention specs of the layers (what a kernel must honour)."""
        return tuple(dict.fromkeys(self.spec(t) for t in self.types))

    def rope(self, layer_type: str) -> Rope:
        if layer_type == SLIDING and self.local_rope_theta is not None:
            return Rope(self.local_rope_theta)
        return Rope(self.rope_theta, self.rope_scaling)

    @property
    def period(self) -> int:
        """The shortest repeating pattern of ``types``; the scan runs groups of it."""
        types = self.types
        return next(p for p in range(1, len(types) + 1)
                    if all(t == types[i % p] for i, t in enumerate(types)))

# What each remat policy saves for the backward pass; everything else in a layer
# is recomputed. Policies say what to save, never what to refuse, so nothing is
# kept by accident: the weights a layer gathers for compute (FSDP) and their
# compute-dtype casts are not activations, appear in no list, and are gathered
# again in the backward pass instead of being kept for all layers at once (a
# full unsharded copy of the model per device). ``checkpoint_name`` tags below
# mark the candidates.
ACTIVATIONS = ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "attn_lse",
               "attn_block_out", "mlp_norm", "mlp_gate", "mlp_up", "mlp_out",
               # MoE: the router's logits and each (token, expert) pair's output (its
               # experts' gate and up are mlp_gate, mlp_up).
               "router_logits", "moe_out")
_save = jax.checkpoint_policies.save_only_these_names

# The policies that keep only each layer's input (ndjax.ops.layer_scan).
FULL_REMAT = ("full", "offload")

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
    # "full", with each layer's input kept in the host's pinned memory between the
    # passes (ndjax.ops.layer_scan; scanned layers only): the device keeps one
    # layer's activations.
    "offload": jax.checkpoint_policies.nothing_saveable,
    # Save the projections (the expensive matmuls), recompute norms, RoPE,
    # softmax and the SwiGLU elementwise work.
    "save_proj": _save("q_proj", "k_proj", "v_proj", "attn_out", "attn_lse", "mlp_gate",
                       "mlp_up", "mlp_out", "router_logits", "moe_out"),
    # Save only the attention output: about half of "save_proj"'s memory,
    # recomputes the QKV and MLP matmuls.
    "save_attn": _save("attn_out", "attn_lse"),
}



class Attention(nnx.Module):
    # The matmuls' weights (what QLoRA stores quantized).
    weight_names = ("wq", "wk", "wv", "wo")

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, hd, std = cfg.dim, cfg.hd, cfg.init_std
        pd = cfg.param_dtype
        self.wq = init_param(rngs, (d, cfg.n_heads, hd), ("embed", "q_heads", "head_dim"), std,
                             pd)
        self.wk = init_param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"),
                             std, pd)
        self.wv = init_param(rngs, (d, cfg.n_kv_heads, hd), ("embed", "kv_heads", "head_dim"),
                             std, pd)
        self.wo = init_param(rngs, (cfg.n_heads, hd, d), ("q_heads", "head_dim", "embed"), std,
                             pd)
        if cfg.qkv_bias:
            self.bq = nnx.Param(jnp.zeros((cfg.n_heads, hd), pd),
                                logical_axes=("q_heads", "head_dim"))
            self.bk = nnx.Param(jnp.zeros((cfg.n_kv_heads, hd), pd),
                                logical_axes=("kv_heads", "head_dim"))
            self.bv = nnx.Param(jnp.zeros((cfg.n_kv_heads, hd), pd),
                                logical_axes=("kv_heads", "head_dim"))
        if cfg.o_bias:
            self.bo = nnx.Param(jnp.zeros((d,), pd), logical_axes=("embed",))
        if cfg.attn_sinks:
            # transformers draws them like the weights (GptOssPreTrainedModel).
            self.sinks = init_param(rngs, (cfg.n_heads,), ("q_heads",), std, pd)
        if cfg.qk_norm:
            norm = dict(plus_one=cfg.norm_plus_one, names=("head_dim",))
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, pd, **norm)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, pd, **norm)
        self.dtype = cfg.dtype
        self.cfg = cfg

    def add_adapters(self, cfg: DecoderConfig, rngs: nnx.Rngs) -> None:
        """The LoRA adapters ``cfg.lora`` asks for (after every base weight is drawn, so
        that the base is the same with and without them)."""
        for name, n_in in (("q", 1), ("k", 1), ("v", 1), ("o", 2)):
            setattr(self, "lora_" + name,
                    lora_lib.make(cfg, rngs, name, getattr(self, "w" + name), n_in))

    def __call__(self, x, cos, sin, segment_ids, spec: AttentionSpec,
                 dropout: lora_lib.Dropout | None = None):
        q, k, v = self.qkv(x, cos, sin, dropout)
        return self.output(attention(q, k, v, segment_ids, self.cfg, spec,
                                     sinks=self.sink_logits()), dropout)

    def sink_logits(self) -> jax.Array | None:
        """The heads' sink logits in float32 (``attn_sinks``), else None."""
        if not self.cfg.attn_sinks:
            return None
        return constrain(self.sinks[...].astype(jnp.float32), ("act_heads",))

    def _project(self, x, name: str, n_kv: int | None, dropout: lora_lib.Dropout | None):
        cfg = self.cfg
        out = project("bsd,dhk->bshk", x,
                      *use_param(getattr(self, "w" + name), cfg.dtype, n_kv, cfg.param_dtype))
        out = _adapted(cfg, out, getattr(self, "lora_" + name, None), "bsd,dhk->bshk", x, 1,
                       n_kv, dropout, name)
        if cfg.qkv_bias:
            out = add_bias(out, *use_param(getattr(self, "b" + name), cfg.dtype, n_kv,
                                           cfg.param_dtype))
        return out

    def qkv(self, x, cos, sin, dropout: lora_lib.Dropout | None = None):
        """Queries, keys and values of ``x``, normed and rotated (the KV-cache decode
        reuses it)."""
        n_kv = self.cfg.n_kv_heads
        q = checkpoint_name(constrain(self._project(x, "q", None, dropout), HEADS), "q_proj")
        k = checkpoint_name(constrain(self._project(x, "k", n_kv, dropout), KV_HEADS),
                            "k_proj")
        v = checkpoint_name(constrain(self._project(x, "v", n_kv, dropout), KV_HEADS),
                            "v_proj")
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def output(self, out, dropout: lora_lib.Dropout | None = None):
        """The attention's output (b, s, heads, head_dim) projected back to the model dim."""
        out = checkpoint_name(constrain(out, HEADS), "attn_out")
        y = project("bshk,hkd->bsd", out,
                    *use_param(self.wo, self.dtype, param_dtype=self.cfg.param_dtype))
        y = _adapted(self.cfg, y, getattr(self, "lora_o", None), "bshk,hkd->bsd", out, 2,
                     dropout=dropout, target="o")
        if self.cfg.o_bias:
            y = add_bias(y, *use_param(self.bo, self.dtype, param_dtype=self.cfg.param_dtype))
        return y


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, f, std = cfg.dim, cfg.ffn_dim, cfg.init_std
        self.w_gate = init_param(rngs, (d, f), ("embed", "mlp"), std, cfg.param_dtype)
        self.w_up = init_param(rngs, (d, f), ("embed", "mlp"), std, cfg.param_dtype)
        self.w_down = init_param(rngs, (f, d), ("mlp", "embed"), std, cfg.param_dtype)
        self.dtype = cfg.dtype
        self.param_dtype = cfg.param_dtype
        self.activation = cfg.activation
        self.cfg = cfg

    def add_adapters(self, cfg: DecoderConfig, rngs: nnx.Rngs) -> None:
        for name in ("gate", "up", "down"):
            setattr(self, "lora_" + name,
                    lora_lib.make(cfg, rngs, name, getattr(self, "w_" + name), 1))

    def _project(self, name: str, equation: str, x, dropout: lora_lib.Dropout | None):
        out = project(equation, x, *use_param(getattr(self, "w_" + name), self.dtype,
                                               param_dtype=self.param_dtype))
        return _adapted(self.cfg, out, getattr(self, "lora_" + name, None), equation, x, 1,
                        dropout=dropout, target=name)

    def __call__(self, x, dropout: lora_lib.Dropout | None = None):
        names = ("act_batch", "act_seq", "act_mlp")
        gate = checkpoint_name(constrain(self._project("gate", "bsd,df->bsf", x, dropout),
                                         names), "mlp_gate")
        up = checkpoint_name(constrain(self._project("up", "bsd,df->bsf", x, dropout), names),
                             "mlp_up")
        h = ACTIVATION_FNS[self.activation](gate) * up
        return self._project("down", "bsf,fd->bsd", h, dropout)


def shared_expert(cfg: DecoderConfig, rngs: nnx.Rngs) -> MLP | None:
    """A mixture of experts' shared expert (``shared_expert_dim``), a dense MLP of
    that width; None where it has none."""
    if not cfg.shared_expert_dim:
        return None
    return MLP(dataclasses.replace(cfg, ffn_dim=cfg.shared_expert_dim), rngs)


def _adapted(cfg: DecoderConfig, out, adapter, equation: str, x, n_in: int,
             n_kv_heads: int | None = None, dropout: lora_lib.Dropout | None = None,
             target: str = ""):
    if adapter is None:
        return out
    return lora_lib.adapted(out, adapter, equation, x, n_in, cfg.dtype, cfg.lora.scale,
                            n_kv_heads, dropout, target)


RESIDUAL = ("act_batch", "act_res_seq", "act_embed")
HIDDEN = ("act_batch", "act_seq", "act_embed")


@dataclasses.dataclass(frozen=True)
class HeadLoss:
    """A loss summed from the final hidden states: ``fn(x (b, s, dim), LM head (a
    rules.Weight), rows)`` -> (the loss's sum, other sums), ``rows`` arrays with the
    batch as leading axis (targets, loss mask). Given to ``Decoder.features``, which
    applies it to the whole batch, or, under the 1F1B pipeline, to each micro-batch as
    it leaves the last stage."""

    fn: Callable[[jax.Array, Weight, Any], tuple[jax.Array, ...]]
    rows: Any


@dataclasses.dataclass(frozen=True)
class Stack:
    """Consecutive layers of one kind, their parameters stacked: the Decoder's attribute
    (and parameter key) ``name``, layers ``first`` .. ``first + count - 1`` of the model,
    whose MLP is a mixture of experts where ``moe``."""

    name: str
    first: int
    count: int
    moe: bool

    @property
    def stop(self) -> int:
        return self.first + self.count


def stacks(cfg: DecoderConfig) -> tuple[Stack, ...]:
    """The model's stacks in layer order: one, ``layers``; or DeepSeek V3's dense first
    layers (``first_k_dense``) as ``dense_layers`` and its MoE ones as ``layers``."""
    moe = bool(cfg.n_experts)
    if not cfg.first_k_dense:
        return (Stack("layers", 0, cfg.n_layers, moe),)
    k = cfg.first_k_dense
    return (Stack("dense_layers", 0, k, False), Stack("layers", k, cfg.n_layers - k, moe))


def layer_order(cfg: DecoderConfig) -> np.ndarray | None:
    """The model's layer (of the last stack's, from 0) at each position of that stack's
    stored parameters, or None where they are stored in layer order (every layout but
    the circular pipeline's: ``pipeline.storage_order``)."""
    if cfg.virtual_stages == 1:
        return None
    return pipeline.storage_order(stacks(cfg)[-1].count, cfg.stages, cfg.virtual_stages)


def reorder_layers(tree: Any, cfg: DecoderConfig, to_storage: bool) -> Any:
    """``tree``'s arrays under the last stack's key (parameters, their LoRA adapters,
    the optimizer's moments) from layer order to ``layer_order``'s (``to_storage``) or
    back. Checkpoints, Hugging Face files and PEFT adapters are in layer order; the
    train state of a circular pipeline is in its storage order. Host or device arrays."""
    order = layer_order(cfg)
    if order is None:
        return tree
    index = order if to_storage else np.argsort(order)
    name = stacks(cfg)[-1].name

    def move(path, a):
        under = any(getattr(k, "key", None) == name for k in path)
        return a[index] if under and getattr(a, "ndim", 0) and a.shape[0] == len(index) else a
    return jax.tree_util.tree_map_with_path(move, tree)


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs, moe: bool | None = None):
        """``moe``: the MLP a mixture of experts (None: where the model has experts)."""
        norm = dict(plus_one=cfg.norm_plus_one)
        eps, pd = cfg.rms_norm_eps, cfg.param_dtype
        self.attn_norm = RMSNorm(cfg.dim, eps, pd, **norm)
        self.attn = mla.MLA(cfg, rngs) if cfg.kv_lora_rank else Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.dim, eps, pd, **norm)
        moe = bool(cfg.n_experts) if moe is None else moe
        self.mlp = MoE(cfg, rngs, shared_expert(cfg, rngs)) if moe else MLP(cfg, rngs)
        if cfg.post_norms:
            self.post_attn_norm = RMSNorm(cfg.dim, eps, pd, **norm)
            self.post_mlp_norm = RMSNorm(cfg.dim, eps, pd, **norm)
        self.post_norms = cfg.post_norms
        if cfg.lora is not None:
            self.attn.add_adapters(cfg, rngs)
            if not isinstance(self.mlp, MoE):
                self.mlp.add_adapters(cfg, rngs)
        if cfg.lora is not None and cfg.lora.quant is not None:
            # QLoRA: the frozen base weights (every projection, as bitsandbytes
            # quantizes every linear layer but the LM head) stored quantized, drawn
            # first as the unquantized model draws them.
            quant.quantize_weights(self.attn, self.attn.weight_names, cfg.lora.quant)
            quant.quantize_weights(self.mlp, ("w_gate", "w_up", "w_down"), cfg.lora.quant)
            if getattr(self.mlp, "shared", None) is not None:  # Qwen 2 MoE's shared expert
                quant.quantize_weights(self.mlp.shared, ("w_gate", "w_up", "w_down"),
                                       cfg.lora.quant)

    def __call__(self, x, cos, sin, segment_ids, spec: AttentionSpec,
                 dropout: lora_lib.Dropout | None = None):
        return self.around(x, lambda h: self.attn(h, cos, sin, segment_ids, spec, dropout),
                           real=segment_ids > 0, dropout=dropout)

    def around(self, x, attend, real=None, dropless: bool = False,
               dropout: lora_lib.Dropout | None = None) -> tuple[jax.Array, dict]:
        """The block with ``attend`` (normed input -> attention's projected output) as
        its attention: the KV-cache decode passes one that reads and writes the cache,
        and ``dropless`` (generation computes every token, whatever capacity the model
        trains with). -> (output, the MoE router's statistics: ``moe.MoE``, over the
        tokens ``real`` marks, a row's padding left out; {} for a dense MLP)."""
        h = checkpoint_name(constrain(self.attn_norm(x), HIDDEN), "attn_norm")
        attn = attend(h)
        if self.post_norms:
            attn = self.post_attn_norm(attn)
        x = constrain(x + checkpoint_name(attn, "attn_block_out"), RESIDUAL)
        h = checkpoint_name(constrain(self.mlp_norm(x), HIDDEN), "mlp_norm")
        out, stats = (self.mlp(h, real, dropless) if isinstance(self.mlp, MoE)
                      else (self.mlp(h, dropout), {}))
        if self.post_norms:
            out = self.post_mlp_norm(out)
        return constrain(x + checkpoint_name(out, "mlp_out"), RESIDUAL), stats


def _add_stats(a: dict, b: dict) -> dict:
    """Two runs of layers' statistics: summed, but the per-layer ones
    (``moe.PER_LAYER``), which follow each other. Either may be {} (dense layers)."""
    if not a or not b:
        return a or b
    return {k: (jnp.concatenate([a[k], b[k]]) if k.startswith(PER_LAYER) else a[k] + b[k])
            for k in a}


def _layer_slice(stacked: Any, start: int, stop: int, group: int | None = None) -> Any:
    """Layers ``start .. stop-1`` of the stacked parameters; ``group``: reshaped to
    (groups, group, ...) for the scan over whole periods."""
    def cut(a):
        a = a[start:stop]
        return a if group is None else a.reshape(a.shape[0] // group, group, *a.shape[1:])
    return jax.tree.map(cut, stacked)


def _stacked_blocks(cfg: DecoderConfig, moe: bool, axis: str):
    """keys (layers, ...) -> Blocks with stacked parameters, one layer per key; their
    leading axis has the logical name ``axis`` (the stack's name: the rules split
    ``layers`` over pipeline stages, ``dense_layers`` never)."""
    @nnx.vmap(in_axes=0, out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: axis, "logical_axes": axis})
    def stacked(key):
        return Block(cfg, nnx.Rngs(params=key), moe)
    return stacked


class Decoder(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        if cfg.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={cfg.remat!r}: choose one of {sorted(REMAT_POLICIES)}")
        if cfg.remat == "offload" and not cfg.scan_layers:
            raise ValueError("model.remat='offload' needs scan_layers (ndjax.ops.layer_scan)")
        self.cfg = cfg
        self.embed = init_param(rngs, (cfg.vocab_size, cfg.dim), ("vocab", "embed"),
                                cfg.init_std, cfg.param_dtype)

        keys = jax.random.split(rngs.params(), cfg.n_layers)
        order = layer_order(cfg)
        for stack in stacks(cfg):
            blocks = _stacked_blocks(cfg, stack.moe, stack.name)
            # Each layer drawn from its key in the model, stored where layer_order puts it.
            own = keys[stack.first:stack.stop]
            setattr(self, stack.name, blocks(own if order is None or stack.name != "layers"
                                             else own[order]))
        self.final_norm = RMSNorm(cfg.dim, cfg.rms_norm_eps, cfg.param_dtype,
                                  plus_one=cfg.norm_plus_one)
        if not cfg.tie_embeddings:
            self.lm_head = init_param(rngs, (cfg.dim, cfg.vocab_size), ("embed", "vocab"),
                                      cfg.init_std, cfg.param_dtype)

    def embed_tokens(self, tokens: jax.Array) -> tuple[jax.Array, tuple]:
        """(the embeddings of ``tokens`` in the compute dtype, scaled where the family
        scales them, as the residual stream; the table's ``use_param`` triple)."""
        cfg = self.cfg
        embed = use_param(self.embed, cfg.dtype, param_dtype=cfg.param_dtype)
        x = embed_lookup(embed[0], tokens, *embed[1:])
        if cfg.embed_scale:
            # Hugging Face rounds the factor to the weights' dtype first.
            x = x * jnp.asarray(math.sqrt(cfg.dim), cfg.dtype)
        return constrain(x, RESIDUAL), embed

    def rope_tables(self, positions: jax.Array) -> dict[str, tuple[jax.Array, jax.Array]]:
        """cos and sin per layer type the model has."""
        cfg = self.cfg
        return {t: rope_tables(cfg.rope(t), cfg.rope_dim, positions)
                for t in dict.fromkeys(cfg.types)}

    def features(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 dropout: lora_lib.Dropout | None = None, head_loss: HeadLoss | None = None
                 ) -> tuple:
        """tokens, positions, segment_ids: (b, s) int32 -> (final hidden states (b, s, dim)
        in the compute dtype, LM head (dim, vocab): a ``rules.Weight``, gathered to its
        compute layout and as stored, the MoE's router metrics: ``moe.aux_metrics``, the
        load-balancing ``aux_loss`` among them; {} for a dense model).

        The router's statistics leave each layer as the scan's per-layer output and
        are summed over the layers, so the loss is formed over all layers' routers at
        once, as transformers' ``load_balancing_loss_func`` forms it.

        The loss applies the head chunk by chunk (``ndjax.ops.cross_entropy``) so that
        the whole batch's logits never exist at once, and gives the head's gradient to
        the stored head, summed in float32. Tied embeddings are gathered once, for the
        lookup and the head; each of the two gradients reaches the storage layout on
        its own, unrounded.

        ``dropout`` (the train step's LoRA dropout): each layer's parameters travel with
        the layer's index, from which its masks are drawn (``lora.Dropout``).

        ``head_loss``: (its sums over the batch, the router's metrics) in place of the
        hidden states and head; the 1F1B pipeline forms it per micro-batch.
        """
        cfg = self.cfg
        x, embed = self.embed_tokens(tokens)
        head = Weight(*embed).T if cfg.tie_embeddings else Weight(
            *use_param(self.lm_head, cfg.dtype, param_dtype=cfg.param_dtype))
        in_pipeline = (head_loss is not None and cfg.stages > 1
                       and cfg.pipeline_schedule == "1f1b")
        if cfg.stages > 1:
            tables = self.rope_tables(positions)
            *before, staged = stacks(cfg)
            stats = {}
            if before:  # DeepSeek V3's dense first layers: on every stage, before the stages
                x, stats = self.layer_stack(x, tables, segment_ids, dropout, 0, staged.first)
            x, part = self.pipelined(x, tables, segment_ids, dropout,
                                     (head_loss, head) if in_pipeline else None)
            stats = _add_stats(stats, part)
        else:
            x, stats = self.layer_stack(x, self.rope_tables(positions), segment_ids, dropout)
        aux = aux_metrics(stats, cfg.n_experts, cfg.experts_per_token) if cfg.n_experts else {}
        if in_pipeline:
            return x, aux  # the loss's sums

        x = constrain(self.final_norm(x), HIDDEN)
        if head_loss is not None:
            return head_loss.fn(x, head, head_loss.rows), aux
        return x, head, aux

    def layer_stack(self, x: jax.Array, tables: dict[str, tuple[jax.Array, jax.Array]],
                    segment_ids: jax.Array, dropout: lora_lib.Dropout | None = None,
                    start: int = 0, stop: int | None = None
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Layers ``start`` .. ``stop - 1`` (default: all) on the residual stream ``x``
        -> (the stream after them, the routers' statistics summed over them; {} for a
        dense model). ``features`` runs every layer; a pipeline stage runs its own
        contiguous range, each layer with its type, index and parameters as in the whole
        stack, and the stages' statistics add up to the whole stack's. The range may
        cross from one ``Stack`` to the next (DeepSeek V3's dense first layers)."""
        stop = self.cfg.n_layers if stop is None else stop
        stats: dict = {}
        for stack in stacks(self.cfg):
            lo, hi = max(start, stack.first), min(stop, stack.stop)
            if lo < hi:
                x, part = self._run_stack(stack, x, tables, segment_ids, dropout, lo, hi)
                stats = _add_stats(stats, part)
        return x, stats

    def pipelined(self, x: jax.Array, tables: dict[str, tuple[jax.Array, jax.Array]],
                  segment_ids: jax.Array, dropout: lora_lib.Dropout | None = None,
                  head: tuple[HeadLoss, Weight] | None = None
                  ) -> tuple[Any, dict[str, jax.Array]]:
        """``layer_stack`` over the last stack's layers (all of them but DeepSeek V3's
        dense first ones) as ``cfg.stages`` pipeline stages of an equal run of layers
        each (``ndjax.parallel.pipeline``). Each stage runs the same layer types
        (``Experiment`` checks that the pattern's period divides a stage's layers).
        Under LoRA dropout each layer's index travels with its parameters and each
        token's id with its micro-batch, so the masks are the unpipelined step's."""
        cfg = self.cfg
        stack = stacks(cfg)[-1]
        _, stacked = nnx.split(getattr(self, stack.name))
        if cfg.pipeline_gather_once:
            # Gathered here, outside the ticks; the layers then use them as they come
            # (rules.params_gathered), and each parameter's gradient, summed over the
            # ticks in that layout, goes back to its storage layout once.
            nnx.replace_by_pure_dict(stacked, jax.tree.map(
                gathered, nnx.to_pure_dict(stacked), logical_axes(stacked)))
        per_chunk = stack.count // (cfg.stages * cfg.virtual_stages)
        order = layer_order(cfg)
        layer_ids = stack.first + jnp.asarray(
            np.arange(stack.count) if order is None else order, jnp.uint32)

        def stage(params, h, rows):
            params, ids = params
            tables, seg, token_ids = rows
            drop = None if dropout is None else dataclasses.replace(dropout, token_ids=token_ids)
            # A chunk's layer types are the stack's first ones (Experiment checks that
            # the pattern's period divides a chunk).
            with params_gathered() if cfg.pipeline_gather_once else contextlib.nullcontext():
                return self._run_stack(stack, h, tables, seg, drop, stack.first,
                                       stack.first + per_chunk, params, ids, staged=True)

        plan = pipeline.schedule(cfg.stages, cfg.microbatches, cfg.virtual_stages,
                                 cfg.pipeline_schedule if head is not None else "gpipe")
        token_ids = None if dropout is None else dropout.token_ids
        per_row = (tables, segment_ids, token_ids)
        if head is None:
            return pipeline.run(plan, stage, (stacked, layer_ids), x, per_row, RESIDUAL,
                                PER_LAYER)
        head_loss, weight = head
        norm_def, norm_state = nnx.split(self.final_norm)

        def head_fn(params, gathered_head, h, rows):
            """The final norm, the LM head and the loss on one micro-batch."""
            norm, value = params
            h = constrain(nnx.merge(norm_def, norm)(h), HIDDEN)
            return head_loss.fn(h, Weight(gathered_head, value, weight.use), rows)

        names = jax.tree.leaves(logical_axes(stacked), is_leaf=lambda a: isinstance(a, tuple))
        return pipeline.run_with_loss(plan, stage, (stacked, layer_ids), x, per_row, RESIDUAL,
                                      PER_LAYER, head_fn, (norm_state, weight.value),
                                      weight.gathered, head_loss.rows, [*names, None])

    def _run_stack(self, stack: Stack, x: jax.Array, tables: dict, segment_ids: jax.Array,
                   dropout: lora_lib.Dropout | None, start: int, stop: int,
                   stacked: Any = None, layer_ids: jax.Array | None = None,
                   staged: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``layer_stack`` over layers ``start .. stop - 1``, all of ``stack``; ``stacked``:
        the layers' parameters in place of the stack's own, and ``layer_ids`` their
        indices in the model (a pipeline stage's). ``staged``: run by the pipeline, in
        its vmap over ``stage``."""
        cfg = self.cfg
        graphdef, own = nnx.split(getattr(self, stack.name))
        if stacked is None and stack.name == "layers" and layer_order(cfg) is not None:
            raise ValueError("the circular pipeline's layers are stored out of layer order "
                             "(layer_order): they run through pipelined() only")
        stacked = own if stacked is None else stacked
        policy = REMAT_POLICIES[cfg.remat]
        consts: tuple = (tables, segment_ids)
        if dropout is not None:  # each layer's masks drawn from its index in the model
            if layer_ids is None:
                layer_ids = jnp.arange(stack.first, stack.stop, dtype=jnp.uint32)
            stacked = (stacked, layer_ids)
            consts = (*consts, dropout)
        at = stack.first  # the model's layer i is the stack's i - at

        def block(layer_type: str):
            """(h, one layer's parameters (with its index under dropout), consts) -> h,
            with the type's static attention spec and rotary tables."""
            def run(h, params, consts):
                tables, seg, *drop = consts
                layer_dropout = None
                if drop:
                    params, index = params
                    layer_dropout = drop[0].at_layer(index)
                return nnx.merge(graphdef, params)(h, *tables[layer_type], seg,
                                                   cfg.spec(layer_type), layer_dropout)
            return run

        add = _add_stats

        def group(pattern: tuple[str, ...], inner: bool):
            """(h, parameters of len(pattern) layers, consts) -> (h, router statistics
            summed over them): the layers of one period. ``inner``: the parameters have
            a leading axis over the pattern."""
            def run(h, params, consts):
                total = {}
                for j, layer_type in enumerate(pattern):
                    p = jax.tree.map(lambda a, j=j: a[j], params) if inner else params
                    h, stats = block(layer_type)(h, p, consts)
                    total = add(total, stats)
                return h, total
            return run

        def full_remat_layer(layer_type: str):
            """``block`` taking its index as the last of its consts (scan_full_remat's
            ``per_layer``)."""
            def run(h, params, consts):
                if dropout is None:
                    return block(layer_type)(h, params, consts)
                return block(layer_type)(h, (params, consts[-1]), consts[:-1])
            return run

        def scanned(pattern, x, params):
            if cfg.remat in FULL_REMAT:
                # Each layer's input kept, each layer recomputed on its own.
                layers = tuple(full_remat_layer(t) for t in pattern)
                params, index = params if dropout is not None else (params, None)
                return scan_full_remat(layers if len(pattern) > 1 else layers[0], x, params,
                                       consts, offload=cfg.remat == "offload",
                                       per_layer=index, kept_prefix=PER_LAYER,
                                       vmapped_over=("stage",) if staged else ())
            run = group(pattern, len(pattern) > 1)
            # The segment ids ride in the scan's carry, not as a constant of the body:
            # jax hoists work that depends only on a scan's constants out of the loop,
            # and for the tiled attention kernel that work is every key tile's mask,
            # stacked: O(seq^2) memory (tests/test_attention.py).
            def step(carry, p):
                h, stats = run(carry[0], p, (tables, carry[1], *consts[2:]))
                return (h, carry[1]), stats
            body = jax.checkpoint(step, policy=policy, prevent_cse=False)
            (x, _), stats = jax.lax.scan(body, (x, segment_ids), params)
            return x, {k: (a.reshape(-1, *a.shape[2:]) if k.startswith(PER_LAYER)
                           else jnp.sum(a, axis=0)) for k, a in stats.items()}

        types, period = cfg.types, cfg.period
        stats: dict = {}
        if cfg.scan_layers:
            whole = start + (stop - start) // period * period
            if whole > start:
                x, part = scanned(types[start:start + period], x,
                                  _layer_slice(stacked, start - at, whole - at,
                                               period if period > 1 else None))
                stats = add(stats, part)
            if whole < stop:  # the layers after the last whole period, as one group
                rest = stop - whole
                x, part = scanned(types[whole:stop], x,
                                  _layer_slice(stacked, whole - at, stop - at,
                                               rest if rest > 1 else None))
                stats = add(stats, part)
        else:
            for i in range(start, stop):
                body = jax.checkpoint(block(types[i]), policy=policy, prevent_cse=True)
                x, part = body(x, jax.tree.map(lambda a, i=i: a[i - at], stacked), consts)
                stats = add(stats, part)
        return x, stats

    def __call__(self, tokens: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array) -> jax.Array:
        """tokens, positions, segment_ids: (b, s) int32 -> logits (b, s, vocab) float32.

        For inspection and conversion tests; training never builds all the logits.
        """
        x, head, _ = self.features(tokens, positions, segment_ids)
        logits = jnp.einsum("bsd,dv->bsv", x, head.gathered,
                            preferred_element_type=jnp.float32)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab"))


def logical_axes(state: nnx.State) -> dict:
    """Nested dict of logical axis names (tuples), mirroring the parameter dict."""
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tuple(var.get_metadata()["logical_axes"])
    return out


def mlp_params(cfg: DecoderConfig, *, active: bool = False, moe: bool | None = None) -> int:
    """One layer's MLP parameters: the dense MLP's, or the MoE's experts and router
    (``active``: only the experts a token runs through, and the router), with their
    biases, the load-balancing bias, and its shared expert and that one's gate where it
    has them. ``moe``: of a layer whose MLP is (not) a mixture of experts; None: the
    model's (``stacks``: DeepSeek V3's first layers are dense)."""
    if not (bool(cfg.n_experts) if moe is None else moe):
        return 3 * cfg.dim * cfg.ffn_dim
    experts = cfg.experts_per_token if active else cfg.n_experts
    shared = (3 * cfg.dim * cfg.shared_expert_dim + cfg.dim * cfg.shared_expert_gate
              if cfg.shared_expert_dim else 0)
    biases = (2 * cfg.expert_dim + cfg.dim) * experts * cfg.expert_bias
    return (3 * cfg.dim * cfg.expert_dim * experts + cfg.dim * cfg.n_experts + shared + biases
            + cfg.n_experts * (cfg.router_bias + cfg.score_bias))


def attention_params(cfg: DecoderConfig, *, matmul_only: bool = False) -> int:
    """One layer's attention parameters (``matmul_only``: its matmuls' weights alone):
    ``Attention``'s, or MLA's (``mla.num_params``)."""
    if cfg.kv_lora_rank:
        return mla.num_params(cfg, matmul_only=matmul_only)
    d, hd = cfg.dim, cfg.hd
    heads = cfg.n_heads + 2 * cfg.n_kv_heads
    weights = d * hd * (cfg.n_heads + heads)
    if matmul_only:
        return weights
    return (weights + heads * hd * cfg.qkv_bias + 2 * hd * cfg.qk_norm + d * cfg.o_bias
            + cfg.n_heads * cfg.attn_sinks)


def num_params(cfg: DecoderConfig, *, embeddings: bool = True, active: bool = False) -> int:
    """The parameters; ``active``: those one token uses (MoE: its top-k experts)."""
    d = cfg.dim
    per_layer = attention_params(cfg) + (4 if cfg.post_norms else 2) * d
    n = cfg.n_layers * per_layer + d + sum(
        s.count * mlp_params(cfg, active=active, moe=s.moe) for s in stacks(cfg))
    if embeddings:
        n += cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    return n


def keys_per_query(seq_len: int, window: int | None) -> float:
    """Keys a query attends to on average in a causal row of ``seq_len`` tokens,
    within ``window`` keys of itself (None: all earlier ones)."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def train_flops_per_token(cfg: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token, forward and backward (3 x forward), a multiply-add
    counted as 2:

        6 * (matmul weights of the blocks + dim * vocab)

    (an MoE layer's: the router and the experts_per_token experts a token runs through)
      + 6 * n_heads * (head_dim + v_head_dim) * sum over layers of
            keys_per_query(seq_len, window)

    (QK^T is 2 * head_dim FLOPs per query-key pair, PV 2 * v_head_dim: MLA's values
    are v_head_dim wide, others' head_dim; the zeros MLA pads its values with for the
    kernels are not counted.) The causal row is
    counted, not the packed documents' shorter ones, as is usual, so that MFU is
    comparable across data sets; a local layer counts the keys in its window.

    Under LoRA the frozen weights form no gradient of their own, only their input's:
    4 (not 6) FLOPs per weight, the LM head's too; each adapter adds its two matmuls,
    6 * rank * (in + out) (``lora.num_adapter_params``). The attention is unchanged.
    """
    hd = cfg.hd
    v_dim = (cfg.v_head_dim or hd) if cfg.kv_lora_rank else hd
    matmul = cfg.n_layers * attention_params(cfg, matmul_only=True) + sum(
        s.count * mlp_params(cfg, active=True, moe=s.moe) for s in stacks(cfg))
    keys = sum(keys_per_query(seq_len, cfg.spec(t).window) for t in cfg.types)
    attention = 6.0 * cfg.n_heads * (hd + v_dim) * keys
    if cfg.lora is None:
        return 6.0 * matmul + head_flops_per_token(cfg) + attention
    return (4.0 * matmul + head_flops_per_token(cfg) + 6.0 * lora_lib.num_adapter_params(cfg)
            + attention)


def head_flops_per_token(cfg: DecoderConfig) -> float:
    """The LM head's share of ``train_flops_per_token``: 6 * dim * vocab, 4 under LoRA."""
    return (6.0 if cfg.lora is None else 4.0) * cfg.dim * cfg.vocab_size
