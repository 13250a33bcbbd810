"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE): a linear router, top-k experts per
token, each expert a SwiGLU MLP, computed dropless with grouped matmuls.

Routing, in float32: ``softmax(x @ router)`` over the experts, the top
``experts_per_token`` of them per token (``jax.lax.top_k``), their weights
renormalised to sum to one where the family does (``norm_topk_prob``: Mixtral
always, Qwen3-MoE as its config says).

Dispatch is dropless: every (token, chosen expert) pair is computed. The pairs are
sorted by expert, each expert's run of rows goes through its gate, up and down
matrices with ``jax.lax.ragged_dot`` (one grouped matmul per projection, the group
sizes the experts' token counts), and the rows are unsorted, weighted and summed
over the k choices. Under a mesh the top-k and the dispatch run in a ``shard_map``
over the data axes, so that each device chooses, sorts and computes its own tokens
(left to the partitioner, ``top_k`` and the sort gather the whole batch first); the
tensor axis is left to the partitioner, which splits the experts' width as it
splits the dense MLP's (gate and up column-parallel, down row-parallel, one
all-reduce of the output).

The expert weights are used gathered (``layers.use_param``) and differentiated
through the ``shard_map``: their gradient is all-reduced over the data axes in the
compute dtype and then cut to the storage layout, where the dense weights'
(``layers.project``) is reduce-scattered in float32. Exact in float32; in bfloat16
the per-device sums are rounded before they are added. A custom VJP as
``layers.embed_lookup``'s would give them the dense weights' path (not done yet).

The expert weights are stacked, ``[experts, dim, width]`` and ``[experts, width,
dim]``, with the logical axis ``experts`` on the stacked dimension (the rule
tables keep it unsplit for now). The router's statistics (assignments and
probabilities summed over tokens, per expert) leave each layer for the
load-balancing loss (``aux_loss``), which the decoder forms over all layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from ndjax.models.layers import ACTIVATION_FNS, init_param, project, use_param
from ndjax.rules import active, constrain, data_axes, suspended

ROUTER_LOGITS = ("act_batch", "act_seq", "act_experts")


def route(probs: jax.Array, k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """Router probabilities (..., experts) -> (the top-k experts (..., k) int32, their
    weights (..., k), renormalised to sum to 1 where ``renormalise``)."""
    weights, experts = jax.lax.top_k(probs, k)
    if renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights


def dispatch(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
             w_up: jax.Array, w_down: jax.Array, activation: str = "silu") -> jax.Array:
    """Every token of ``x`` (..., dim) through its ``experts`` (..., k), weighted by
    ``weights`` (..., k) and summed: grouped matmuls over the (token, expert) pairs
    sorted by expert. ``w_gate``, ``w_up``: (E, dim, width); ``w_down``: (E, width, dim)."""
    n_experts, dim = w_gate.shape[0], x.shape[-1]
    k = experts.shape[-1]
    tokens = x.reshape(-1, dim)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # the pairs, expert by expert
    rows = tokens[order // k]
    sizes = jnp.zeros((n_experts,), jnp.int32).at[flat].add(1)
    gate = jax.lax.ragged_dot(rows, w_gate, sizes)
    up = jax.lax.ragged_dot(rows, w_up, sizes)
    out = jax.lax.ragged_dot(ACTIVATION_FNS[activation](gate) * up, w_down, sizes)
    out = out[jnp.argsort(order)].reshape(*experts.shape, dim)  # back in token order
    mixed = jnp.einsum("...kd,...k->...d", out, weights.astype(out.dtype),
                       preferred_element_type=jnp.float32)
    return mixed.astype(x.dtype)


class MoE(nnx.Module):
    """The MoE MLP: (b, s, dim) -> ((b, s, dim), router statistics per expert)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, f, e, std, pd = cfg.dim, cfg.expert_dim, cfg.n_experts, cfg.init_std, cfg.param_dtype
        self.router = init_param(rngs, (d, e), ("embed", "experts"), std, pd)
        self.w_gate = init_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), std, pd)
        self.w_up = init_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), std, pd)
        self.w_down = init_param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"), std, pd)
        self.cfg = cfg

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        cfg = self.cfg
        logits = constrain(project("bsd,de->bse", x.astype(jnp.float32),
                                   *use_param(self.router, jnp.float32,
                                              param_dtype=cfg.param_dtype)), ROUTER_LOGITS)
        probs = jax.nn.softmax(logits, axis=-1)  # float32, as the logits
        w = [use_param(v, cfg.dtype, param_dtype=cfg.param_dtype)[0]
             for v in (self.w_gate, self.w_up, self.w_down)]
        n, k = cfg.n_experts, cfg.experts_per_token

        def local(x, probs, *w):
            """One device's tokens: top-k, dispatch, and its count of assignments per
            expert (leading axis 1, stacked over the devices). top_k runs here too: left
            to the partitioner, it gathers the whole batch's probabilities first."""
            with suspended():
                experts, weights = route(probs, k, cfg.norm_topk_prob)
                out = dispatch(x, experts, weights, *w, cfg.activation)
                assigned = jnp.zeros((n,), jnp.float32).at[experts.reshape(-1)].add(1.0)
                return out, assigned[None]
        rules = active()
        axes = data_axes(rules) if rules is not None else ()
        if axes:
            rows = tuple(rules.spec(("act_batch", "act_seq")))
            rows = rows + (None,) * (2 - len(rows))
            tok = PartitionSpec(*rows, None)
            out, assigned = jax.shard_map(
                local, mesh=rules.mesh, axis_names=set(axes),
                in_specs=(tok, tok, *(PartitionSpec(),) * 3),
                out_specs=(tok, PartitionSpec(axes)), check_vma=False)(x, probs, *w)
        else:
            out, assigned = local(x, probs, *w)
        stats = {"assigned": jnp.sum(assigned, axis=0), "probs": jnp.sum(probs, axis=(0, 1))}
        return out, stats


def aux_metrics(stats: dict[str, jax.Array], n_experts: int, k: int, rows: float
                ) -> dict[str, jax.Array]:
    """The load-balancing loss of Switch Transformer as Mixtral's and Qwen3-MoE's
    ``load_balancing_loss_func`` forms it, over every layer's router at once: the
    experts' share of assignments times their mean probability, summed, times the
    experts; ``stats`` summed over the layers, ``rows`` = layers x tokens. With it,
    each expert's load (its assignments over the mean, summed over the layers; 1:
    balanced), least and most."""
    share = stats["assigned"] / rows
    aux = n_experts * jnp.sum(share * (stats["probs"] / rows))
    load = stats["assigned"] / (rows * k / n_experts)
    return {"aux_loss": aux, "expert_load_min": jnp.min(load),
            "expert_load_max": jnp.max(load)}
