"""Multi-head latent attention (MLA): DeepSeek V2 / V3's attention, as transformers'
``DeepseekV3Attention`` computes it.

Queries come from a latent of ``q_lora_rank`` dims (``wq_a``, an RMSNorm, ``wq_b``), or
straight from the residual stream (``wq``) where ``q_lora_rank`` is 0. Keys and values
come from one latent of ``kv_lora_rank`` dims per token (``wkv_a``'s first outputs, an
RMSNorm, ``wkv_b``), and each key's last ``rope_head_dim`` dims from one rotary head
that every head shares (``wkv_a``'s last outputs). Per head, a query or key is
``head_dim = nope + rope_head_dim`` wide: its ``nope`` dims carry no position, its rope
dims are rotated (in interleaved pairs where ``rope_interleave``, DeepSeek's layout;
else rotate-half); a value is ``v_head_dim`` wide, and ``wo`` projects the heads' values
back. The scores' scale is ``head_dim ** -0.5``, times ``mscale(factor,
mscale_all_dim) ** 2`` under YaRN with ``mscale_all_dim`` (``DecoderConfig.spec``).
The two latents' norms have transformers' fixed eps, ``LATENT_NORM_EPS``, whatever
``rms_norm_eps``.

The attention kernels (``ndjax.ops.attention``) take values as wide as the queries:
values narrower than ``head_dim`` (V3: 128 of 192) are padded with zeros to it and the
output cut back (``padded``). Every kernel, and ring and all-to-all context
parallelism, then computes MLA exactly, at the cost of values and outputs
``head_dim / v_head_dim`` times as wide inside attention (1.5x for V3: the PV matmul,
the values a ring passes on, the output and its gradient), and of keys expanded
to every head (``expand``).

Parameters (logical axes; ``Family.hf_names`` gives transformers' names):

==========  =========================  ======================================  ============
ndjax       shape                      logical axes                            transformers
==========  =========================  ======================================  ============
wq          (dim, heads, head_dim)     embed, q_heads, head_dim                q_proj
wq_a        (dim, q_lora_rank)         embed, q_lora                           q_a_proj
q_a_norm    (q_lora_rank,)             norm                                    q_a_layernorm
wq_b        (q_lora_rank, heads,       q_lora, q_heads, head_dim               q_b_proj
            head_dim)
wkv_a       (dim, kv_lora_rank +       embed, kv_lora_rope                     kv_a_proj_
            rope_head_dim)                                                     with_mqa
kv_a_norm   (kv_lora_rank,)            norm                                    kv_a_layernorm
wkv_b       (kv_lora_rank, heads,      kv_lora, q_heads, head_dim              kv_b_proj
            nope + v_head_dim)
wo          (heads, v_head_dim, dim)   q_heads, head_dim, embed                o_proj
==========  =========================  ======================================  ============

(``wq`` where q_lora_rank is 0, else ``wq_a``, ``q_a_norm``, ``wq_b``.) transformers'
``attention_bias`` is ``qkv_bias`` (biases on ``q_a_proj``, where there is one, and on
``kv_a_proj_with_mqa``: ``bq_a``, ``bkv_a``) with ``o_bias`` (``bo``). The rule presets
shard the latent ranks (``q_lora``, ``kv_lora``) over the FSDP axes, as ``embed``, and
the heads over ``tensor``; every tensor shard computes the whole latents.

The KV-cache decode (``ndjax.models.decode``) caches each token's normed latent and its
rotated rotary key, ``kv_lora_rank + rope_head_dim`` numbers (``latent``), and expands
the cache through ``wkv_b`` at each step (``expand``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from ndjax.models import lora as lora_lib
from ndjax.models.layers import RMSNorm, add_bias, apply_rope, init_param, project, use_param
from ndjax.ops.attention import HEADS, KV_HEADS, AttentionSpec, attention
from ndjax.parallel.rules import constrain
from ndjax.runtime.errors import ConfigError

# ``cfg`` below is a ``decoder.DecoderConfig`` (the decoder imports this module).
_Config = Any

# transformers' DeepseekV3RMSNorm default, which q_a_layernorm and kv_a_layernorm keep.
LATENT_NORM_EPS = 1e-6
# A latent (b, s, rank): every tensor shard holds all of it.
LATENT = ("act_batch", "act_seq", None)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' ``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def score_scale(cfg: _Config) -> float:
    """The scores' factor: ``head_dim ** -0.5``, times ``yarn_mscale(factor,
    mscale_all_dim) ** 2`` where the rotary scaling sets ``mscale_all_dim``
    (transformers' ``yarn_apply_mscale``)."""
    scale = cfg.hd ** -0.5
    s = cfg.rope_scaling
    if s is not None and s.mscale_all_dim:
        m = yarn_mscale(s.factor, s.mscale_all_dim)
        scale = scale * m * m
    return scale


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on interleaved pairs ``(x0, x1), (x2, x3), ...``, each turned by one frequency,
    as transformers' ``apply_rotary_pos_emb_interleave``: the result is laid out
    de-interleaved, the pairs' first elements then their second ones (queries and keys
    alike, so their dot products are the interleaved rotation's). x: (b, s, heads, d);
    cos/sin: (b, s, d), ``rope_tables``' (the two halves equal)."""
    x32 = x.astype(jnp.float32)
    half = cos.shape[-1] // 2
    c, s = cos[:, :, None, :half], sin[:, :, None, :half]
    pairs = x32.reshape(*x.shape[:-1], half, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def padded(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k (..., head_dim) and v (..., v_head_dim) padded with zeros to the wider of the
    two, for the kernels, which take them equally wide: zero dims change no score (the
    scale is explicit, ``score_scale``) and add zero columns to the output, which the
    caller cuts off (``[..., :v_head_dim]``)."""
    width = max(q.shape[-1], v.shape[-1])

    def pad(x):
        extra = width - x.shape[-1]
        return x if not extra else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])
    return pad(q), pad(k), pad(v)


def num_params(cfg: _Config, *, matmul_only: bool = False) -> int:
    """One layer's MLA parameters (``matmul_only``: the matmuls' weights alone, without
    the latents' norms and the biases)."""
    d, h, hd = cfg.dim, cfg.n_heads, cfg.hd
    q_rank, kv_rank, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_head_dim
    nope, v = hd - rope, cfg.v_head_dim or hd
    weights = ((d * q_rank + q_rank * h * hd) if q_rank else d * h * hd) + (
        d * (kv_rank + rope) + kv_rank * h * (nope + v) + h * v * d)
    if matmul_only:
        return weights
    norms = q_rank + kv_rank
    biases = (q_rank + kv_rank + rope) * cfg.qkv_bias + d * cfg.o_bias
    return weights + norms + biases


class MLA(nnx.Module):
    """Multi-head latent attention with ``decoder.Attention``'s interface, so that a
    ``decoder.Block`` holds either (``DecoderConfig.kv_lora_rank`` > 0: this one)."""

    def __init__(self, cfg: _Config, rngs: nnx.Rngs):
        d, h, hd, std, pd = cfg.dim, cfg.n_heads, cfg.hd, cfg.init_std, cfg.param_dtype
        q_rank, kv_rank, rope = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.rope_head_dim
        self.nope, self.v_dim = hd - rope, cfg.v_head_dim or hd
        if not 0 < rope < hd or rope % 2:
            raise ValueError(f"MLA: rope_head_dim={rope} must be even and in (0, head_dim="
                             f"{hd})")
        if cfg.n_kv_heads != h:
            raise ValueError(f"MLA: n_kv_heads={cfg.n_kv_heads} must be n_heads={h}")
        # In transformers' order of drawing (q, kv, o).
        if q_rank:
            self.wq_a = init_param(rngs, (d, q_rank), ("embed", "q_lora"), std, pd)
            self.q_a_norm = RMSNorm(q_rank, LATENT_NORM_EPS, pd)
            self.wq_b = init_param(rngs, (q_rank, h, hd), ("q_lora", "q_heads", "head_dim"),
                                   std, pd)
        else:
            self.wq = init_param(rngs, (d, h, hd), ("embed", "q_heads", "head_dim"), std, pd)
        self.wkv_a = init_param(rngs, (d, kv_rank + rope), ("embed", "kv_lora_rope"), std, pd)
        self.kv_a_norm = RMSNorm(kv_rank, LATENT_NORM_EPS, pd)
        self.wkv_b = init_param(rngs, (kv_rank, h, self.nope + self.v_dim),
                                ("kv_lora", "q_heads", "head_dim"), std, pd)
        self.wo = init_param(rngs, (h, self.v_dim, d), ("q_heads", "head_dim", "embed"), std,
                             pd)
        if cfg.qkv_bias:  # transformers' attention_bias (q_proj has none)
            if q_rank:
                self.bq_a = nnx.Param(jnp.zeros((q_rank,), pd), logical_axes=("q_lora",))
            self.bkv_a = nnx.Param(jnp.zeros((kv_rank + rope,), pd),
                                   logical_axes=("kv_lora_rope",))
        if cfg.o_bias:
            self.bo = nnx.Param(jnp.zeros((d,), pd), logical_axes=("embed",))
        self.dtype = cfg.dtype
        self.cfg = cfg

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The matmuls' weights (what QLoRA stores quantized)."""
        q = ("wq_a", "wq_b") if self.cfg.q_lora_rank else ("wq",)
        return (*q, "wkv_a", "wkv_b", "wo")

    def add_adapters(self, cfg: _Config, rngs: nnx.Rngs) -> None:
        """LoRA adapters: on ``wo`` (target o) alone; q, k and v are refused."""
        other = [lora_lib.TARGETS[t] for t in cfg.lora.targets if t in ("q", "k", "v")]
        if other:
            raise ConfigError(
                f"model.lora.target_modules: {', '.join(other)} are not projections of "
                f"multi-head latent attention (model.kv_lora_rank={cfg.kv_lora_rank}), which "
                "takes adapters on o_proj only; name o_proj and the MLP's, e.g. "
                "'o_proj,gate_proj,up_proj,down_proj'.")
        self.lora_o = lora_lib.make(cfg, rngs, "o", self.wo, 2)

    def _use(self, name: str):
        return use_param(getattr(self, name), self.dtype, param_dtype=self.cfg.param_dtype)

    def _bias(self, x: jax.Array, name: str) -> jax.Array:
        return add_bias(x, *self._use(name)) if hasattr(self, name) else x

    def _rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        rotate = apply_rope_interleaved if self.cfg.rope_interleave else apply_rope
        return rotate(x, cos, sin)

    def queries(self, x, cos, sin) -> jax.Array:
        """(b, s, heads, head_dim): each head's nope dims, then its rotated rope dims."""
        if self.cfg.q_lora_rank:
            latent = self._bias(project("bsd,dr->bsr", x, *self._use("wq_a")), "bq_a")
            latent = checkpoint_name(constrain(latent, LATENT), "q_proj")
            q = project("bsr,rhk->bshk", self.q_a_norm(latent), *self._use("wq_b"))
        else:
            q = project("bsd,dhk->bshk", x, *self._use("wq"))
        q = checkpoint_name(constrain(q, HEADS), "q_proj")
        q = jnp.concatenate([q[..., :self.nope], self._rope(q[..., self.nope:], cos, sin)],
                            axis=-1)
        return constrain(q, HEADS)

    def latent(self, x, cos, sin) -> tuple[jax.Array, jax.Array]:
        """(the normed key-value latent (b, s, kv_lora_rank), the rotated rotary key
        (b, s, rope_head_dim)): what the KV cache holds of each token."""
        kv = self._bias(project("bsd,dr->bsr", x, *self._use("wkv_a")), "bkv_a")
        kv = checkpoint_name(constrain(kv, LATENT), "k_proj")
        rank = self.cfg.kv_lora_rank
        k_rot = self._rope(kv[:, :, None, rank:], cos, sin)[:, :, 0]
        return constrain(self.kv_a_norm(kv[..., :rank]), LATENT), constrain(k_rot, LATENT)

    def expand(self, latent: jax.Array, k_rot: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``latent``'s keys (b, s, heads, head_dim), the shared ``k_rot`` in each head's
        last dims, and values (b, s, heads, v_head_dim)."""
        kv = project("bsr,rhk->bshk", latent, *self._use("wkv_b"))
        k_nope = checkpoint_name(constrain(kv[..., :self.nope], KV_HEADS), "k_proj")
        v = checkpoint_name(constrain(kv[..., self.nope:], KV_HEADS), "v_proj")
        k_rot = jnp.broadcast_to(k_rot[:, :, None], (*k_nope.shape[:3], k_rot.shape[-1]))
        return constrain(jnp.concatenate([k_nope, k_rot], axis=-1), KV_HEADS), v

    def qkv(self, x, cos, sin, dropout: lora_lib.Dropout | None = None):
        """Queries, keys and values of ``x``, rotated; values v_head_dim wide. (No adapters
        on them: ``dropout`` is unused.)"""
        return (self.queries(x, cos, sin), *self.expand(*self.latent(x, cos, sin)))

    def __call__(self, x, cos, sin, segment_ids, spec: AttentionSpec,
                 dropout: lora_lib.Dropout | None = None):
        q, k, v = self.qkv(x, cos, sin, dropout)
        out = attention(*padded(q, k, v), segment_ids, self.cfg, spec)
        return self.output(out[..., :self.v_dim], dropout)

    def sink_logits(self) -> None:
        return None

    def output(self, out, dropout: lora_lib.Dropout | None = None):
        """The attention's output (b, s, heads, v_head_dim) projected back to the model
        dim."""
        out = checkpoint_name(constrain(out, HEADS), "attn_out")
        y = project("bshk,hkd->bsd", out, *self._use("wo"))
        adapter = getattr(self, "lora_o", None)
        if adapter is not None:
            y = lora_lib.adapted(y, adapter, "bshk,hkd->bsd", out, 2, self.dtype,
                                 self.cfg.lora.scale, dropout=dropout, target="o")
        return self._bias(y, "bo")
