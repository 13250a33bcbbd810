"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen 2 MoE, GPT-OSS): a linear router,
top-k experts per token, each expert a gated MLP, computed dropless with grouped matmuls;
and where the family has one (Qwen 2 MoE), a shared expert, a dense MLP every token
runs through, scaled by a sigmoid gate of its own. GPT-OSS adds biases to the router
and to each expert's three projections and clamps its experts' SwiGLU (``gated``).

Routing, in float32: ``softmax(x @ router (+ bias))`` over the experts, the top
``experts_per_token`` of them per token (``jax.lax.top_k``), their weights
renormalised to sum to one where the family does (``norm_topk_prob``: Mixtral
always, Qwen3-MoE as its config says; GPT-OSS's softmax over the top-k logits is
this renormalisation).

Dispatch is dropless unless ``model.capacity_factor`` is set: every (token, chosen
expert) pair is computed. In capacity mode each expert takes at most ceil(factor x
seq_len x k / experts) of a row's pairs, the row's earliest first
(``within_capacity``); the others give zeros, so their tokens keep the residual alone,
and the share dropped is reported (``expert_dropped``). Capacity is per row, so the
same pairs are dropped however the batch is split (a split sequence is refused), and
under ``mesh.expert`` the exchange's receive buffer shrinks to that bound. The pairs are
sorted by expert, each expert's run of rows goes through its gate, up and down
matrices as grouped matmuls (one per projection, the group sizes the experts' token
counts: ``ndjax.ops.grouped_matmul``, ``model.moe_impl``), and the rows are unsorted,
weighted and summed over the k choices. Under a mesh the top-k and the dispatch run
in a ``shard_map`` over the data axes, so that each device chooses, sorts and
computes its own tokens (left to the partitioner, ``top_k`` and the sort gather the
whole batch first), and over the axes that split the experts' width (tensor), as
the dense MLP's are split: gate and up column-parallel, down row-parallel, its
partial sums summed after the map (a Mosaic GPU kernel has no partitioning rule, so
the partitioner would gather its weights whole).

The expert weights enter the ``shard_map`` gathered (``layers.use_param``) as one
copy per device (``per_device``), so that each device's partial gradient leaves it
unsummed and is reduce-scattered in float32 into the storage layout, as the dense
weights' are (``layers.project``). Unlike those, each device's partial is formed in
the compute dtype (the grouped matmul's transpose), so in bfloat16 it is rounded
once before the float32 sum.

The expert weights are stacked, ``[experts, dim, width]`` and ``[experts, width,
dim]``, with the logical axis ``experts`` on the stacked dimension (the rule
tables keep it unsplit for now). The router's statistics (assignments and
probabilities summed over tokens, per expert, and the router z-loss's sum) leave
each layer for the load-balancing loss (``aux_loss``) and the z-loss
(``router_z_loss``), which the decoder forms over all layers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec

from ndjax.models.layers import ACTIVATION_FNS, add_bias, init_param, project, use_param
from ndjax.ops.grouped_matmul import grouped_matmul, resolved
from ndjax.ops.ragged_exchange import exchange, exclusive_cumsum
from ndjax.parallel import mesh as mesh_lib
from ndjax.parallel import platforms
from ndjax.parallel.rules import (
    ParamUse,
    active,
    axes_of,
    constrain,
    data_axes,
    stacked_lead,
    stacked_sum,
    suspended,
)
from ndjax.runtime.errors import ConfigError

ROUTER_LOGITS = ("act_batch", "act_seq", "act_experts")
# Statistics kept per layer (leading axis: the layers) rather than summed over them.
PER_LAYER = "layer_"
# The features' statistic that update_score_bias reads: each MoE layer's assignments.
EXPERT_COUNTS = "expert_counts"


def route(probs: jax.Array, k: int, renormalise: bool, choice: jax.Array | None = None,
          groups: int = 1, top_groups: int = 1, scale: float = 1.0
          ) -> tuple[jax.Array, jax.Array]:
    """Router scores (..., experts) -> (the top-k experts (..., k) int32, their weights
    (..., k): the scores, renormalised to sum to 1 where ``renormalise``, times
    ``scale``).

    DeepSeek V3's routing: the experts are chosen by ``choice`` (the scores plus the
    load-balancing bias; None: the scores) among the ``top_groups`` of ``groups`` equal
    groups whose two best choice scores sum highest, and weighted by their scores."""
    if choice is None and groups == 1:
        weights, experts = jax.lax.top_k(probs, k)
    else:
        choice = probs if choice is None else choice
        if groups > 1:
            per = choice.shape[-1] // groups
            grouped = choice.reshape(*choice.shape[:-1], groups, per)
            best = jnp.sum(jax.lax.top_k(grouped, min(2, per))[0], axis=-1)
            kept = jnp.sum(jax.nn.one_hot(jax.lax.top_k(best, top_groups)[1], groups), axis=-2)
            choice = jnp.where(jnp.repeat(kept, per, axis=-1) > 0, choice, -jnp.inf)
        experts = jax.lax.top_k(choice, k)[1]
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalise:
        # (transformers' DeepSeek V3 adds 1e-20: no float32 sum of k scores notices it)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights * scale if scale != 1.0 else weights


Glu = Callable[[jax.Array, jax.Array], jax.Array]


def gated(cfg) -> Glu:
    """The experts' (gate, up) -> hidden: ``act(gate) * up``, or GPT-OSS's clamped form
    (``swiglu_limit``): gate clamped above at the limit and up to +-limit, then
    ``(up + 1) * gate * sigmoid(alpha * gate)``, as transformers' GptOssExperts."""
    if cfg.swiglu_limit is None:
        return _plain(cfg.activation)
    limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def clamped(gate, up):
        # where, not minimum: at the limit itself the gradient passes, as torch's clamp.
        gate = jnp.where(gate > limit, limit, gate).astype(gate.dtype)
        up = jnp.where(up > limit, limit, jnp.where(up < -limit, -limit, up)).astype(up.dtype)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))
    return clamped


def _plain(activation: str) -> Glu:
    act = ACTIVATION_FNS[activation]
    return lambda gate, up: act(gate) * up


def _glu(activation: str | Glu) -> Glu:
    return _plain(activation) if isinstance(activation, str) else activation


def _row_bias(b: jax.Array, row_expert: jax.Array, in_group: jax.Array, dtype) -> jax.Array:
    """Each grouped row's expert's bias (rows, width); zeros on rows in no group, which
    the grouped matmuls leave zero."""
    return jnp.where(in_group[:, None], b[jnp.where(in_group, row_expert, 0)], 0).astype(dtype)


def _expert_mlp(matmul, rows, w_gate, w_up, w_down, glu: Glu, biases, row_expert, in_group):
    """The experts' MLP of grouped ``rows`` (named as the dense MLP's, so that the remat
    policies save or rerun them alike). ``biases``: None, or (gate's, up's, down's, a
    0/1 factor on down's: one of the devices that split the width adds it)."""
    gate, up = matmul(rows, w_gate), matmul(rows, w_up)
    if biases is not None:
        gate = gate + _row_bias(biases[0], row_expert, in_group, gate.dtype)
        up = up + _row_bias(biases[1], row_expert, in_group, up.dtype)
    gate, up = checkpoint_name(gate, "mlp_gate"), checkpoint_name(up, "mlp_up")
    out = matmul(glu(gate, up), w_down)
    if biases is not None:
        out = out + (_row_bias(biases[2], row_expert, in_group, out.dtype)
                     * biases[3].astype(out.dtype))
    return out


def capacity(cfg, seq_len: int) -> int | None:
    """The most (token, expert) pairs of one row an expert takes (model.capacity_factor:
    ceil(factor x seq_len x k / experts)); None: dropless."""
    if cfg.capacity_factor is None:
        return None
    return max(1, math.ceil(cfg.capacity_factor * seq_len * cfg.experts_per_token
                            / cfg.n_experts))


def within_capacity(experts: jax.Array, n_experts: int, limit: int) -> jax.Array:
    """(rows, seq, k) experts -> (rows, seq, k) bool: whether each (token, expert) pair is
    among its row's first ``limit`` pairs for that expert, in (position, choice) order.
    Per row, so that what is kept does not depend on how the batch is split."""
    b = experts.shape[0]
    onehot = jax.nn.one_hot(experts.reshape(b, -1), n_experts, dtype=jnp.int32)
    before = jnp.cumsum(onehot, axis=1) - onehot  # the row's earlier pairs, per expert
    return (jnp.sum(before * onehot, axis=-1) < limit).reshape(experts.shape)


def _sort_kept(flat: jax.Array, keep: jax.Array | None, n_experts: int) -> jax.Array:
    """The pairs' order: the kept ones expert by expert, the dropped ones after them
    (in no group: computed as no row, returned as zeros)."""
    key = flat if keep is None else jnp.where(keep.reshape(-1), flat, n_experts)
    return jnp.argsort(key, stable=True)


def _counts(flat: jax.Array, keep: jax.Array | None, n_experts: int) -> jax.Array:
    ones = (jnp.ones(flat.shape, jnp.int32) if keep is None
            else keep.reshape(-1).astype(jnp.int32))
    return jnp.zeros((n_experts,), jnp.int32).at[flat].add(ones)


def dispatch(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
             w_up: jax.Array, w_down: jax.Array, activation: str | Glu = "silu",
             impl: str = "xla", keep: jax.Array | None = None,
             biases: tuple | None = None) -> jax.Array:
    """Every token of ``x`` (..., dim) through its ``experts`` (..., k), weighted by
    ``weights`` (..., k) and summed: grouped matmuls over the (token, expert) pairs
    sorted by expert. ``w_gate``, ``w_up``: (E, dim, width); ``w_down``: (E, width, dim);
    ``impl``: the grouped matmuls' (``ndjax.ops.grouped_matmul``); ``keep`` (..., k):
    the pairs computed (capacity mode, ``within_capacity``), the others give zeros;
    ``activation``: a name, or (gate, up) -> hidden (``gated``); ``biases``: the
    experts' (``_expert_mlp``)."""
    n_experts, dim = w_gate.shape[0], x.shape[-1]
    k = experts.shape[-1]
    tokens = x.reshape(-1, dim)
    flat = experts.reshape(-1)
    order = _sort_kept(flat, keep, n_experts)  # the pairs, expert by expert
    rows = tokens[order // k]
    sizes = _counts(flat, keep, n_experts)
    # Named as the dense MLP's, so that the remat policies save or rerun them alike.
    matmul = functools.partial(grouped_matmul, sizes=sizes, impl=impl)
    in_group = jnp.arange(order.shape[0]) < jnp.sum(sizes)  # the kept pairs sort first
    # Each pair's output, which the routing weights' gradient reads (k x dim per token).
    # The dropped pairs (capacity mode) sort last, in no group: zeros (the grouped
    # matmuls' contract, ndjax.ops.grouped_matmul), and so are their gradients.
    out = checkpoint_name(_expert_mlp(matmul, rows, w_gate, w_up, w_down, _glu(activation),
                                      biases, flat[order], in_group), "moe_out")
    out = out[jnp.argsort(order)].reshape(*experts.shape, dim)  # back in token order
    mixed = jnp.einsum("...kd,...k->...d", out, weights.astype(out.dtype),
                       preferred_element_type=jnp.float32)
    return mixed.astype(x.dtype)


def dispatch_over(axis: str, ways: int, x: jax.Array, experts: jax.Array,
                  weights: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                  activation: str | Glu = "silu", impl: str = "xla",
                  platform: str = "cpu", keep: jax.Array | None = None,
                  limit: int | None = None, biases: tuple | None = None) -> jax.Array:
    """``dispatch`` with the experts split ``ways`` ways over the mesh axis ``axis``
    (inside a ``shard_map`` manual over it): this device holds experts ``[i E/ways,
    (i + 1) E/ways)`` (``w_*``: those), and each (token, expert) pair travels to its
    expert's device and back in two ragged all-to-alls (``ops.ragged_exchange``), the
    counts exchanged first (an all-gather of (ways x E/ways) counts per device).

    Dropless at static shapes: a device may receive every pair of every device, so
    its buffer has ``ways x`` its own pairs' rows, the received ones first. A grouped
    matmul kernel still visits rows in no group (jax's Mosaic kernels run every block
    of their rows), so the buffer is computed in ``ways`` chunks of this device's
    pair count, and a chunk that holds no received row is skipped (``lax.cond``):
    balanced routing computes one or two chunks, the worst case all of them.

    In capacity mode (``keep``, ``within_capacity`` of ``limit`` pairs per row and
    expert) the dropped pairs are not sent, and a device receives at most ``ways x
    rows x E/ways x limit`` pairs: its buffer is that, when smaller."""
    local, dim, k = w_gate.shape[0], x.shape[-1], experts.shape[-1]
    tokens, flat = x.reshape(-1, dim), experts.reshape(-1)
    order = _sort_kept(flat, keep, ways * local)  # the kept pairs, expert by expert
    rows = tokens[order // k]
    pairs = rows.shape[0]
    per_device = _counts(flat, keep, ways * local).reshape(ways, local)
    counts = jax.lax.all_gather(per_device, axis)      # (from, to, expert of to)
    me = jax.lax.axis_index(axis)
    mine = counts[:, me]                               # (from, my expert): what I receive
    send, recv = jnp.sum(per_device, axis=1), jnp.sum(mine, axis=1)
    before_me = jnp.arange(ways)[:, None] < me         # the senders ahead of me
    to_total = jnp.sum(counts, axis=2)                 # (from, to)
    out_at = jnp.sum(jnp.where(before_me, to_total, 0), axis=0)  # my runs' place, per to
    per_sender = pairs if limit is None else min(pairs, x.shape[0] * local * limit)
    buffer = per_sender * ways
    got = exchange(rows, buffer, exclusive_cumsum(send), send, out_at, recv, axis, platform)
    # Received: run by run (sender order), each sorted by my experts. Regrouped expert
    # by expert across the senders; the buffer's unfilled rows last, in no group.
    run_ends = jnp.cumsum(mine.reshape(-1))            # (from, expert) runs, sender-major
    run = jnp.searchsorted(run_ends, jnp.arange(buffer), side="right")
    key = jnp.where(run < ways * local, (run % local) * ways + run // local, ways * local)
    regroup = jnp.argsort(key, stable=True)
    grouped = got[regroup]
    sizes = jnp.sum(mine, axis=0)
    matmul = functools.partial(_in_chunks, sizes=sizes, impl=impl, chunks=ways)
    grouped_key = key[regroup]  # my local expert of each grouped row, times ways
    # The buffer's unfilled rows are in no group: zeros, as their gradients.
    out = _expert_mlp(matmul, grouped, w_gate, w_up, w_down, _glu(activation), biases,
                      grouped_key // ways, grouped_key < ways * local)[jnp.argsort(regroup)]
    # Back: my runs return to their senders, to the rows they came from.
    mine_before = jnp.sum(jnp.where(jnp.arange(ways)[None, :] < me, to_total, 0), axis=1)
    back = exchange(out, pairs, exclusive_cumsum(recv), recv, mine_before, send, axis,
                    platform)
    back = checkpoint_name(back, "moe_out")
    back = back[jnp.argsort(order)].reshape(*experts.shape, dim)  # back in token order
    mixed = jnp.einsum("...kd,...k->...d", back, weights.astype(back.dtype),
                       preferred_element_type=jnp.float32)
    return mixed.astype(x.dtype)


def _in_chunks(x: jax.Array, w: jax.Array, sizes: jax.Array, impl: str, chunks: int
               ) -> jax.Array:
    """``grouped_matmul(x, w, sizes)`` over ``chunks`` equal runs of ``x``'s rows, each
    with the part of every group inside it; a run with none is zeros, not computed."""
    rows = x.shape[0] // chunks
    start = exclusive_cumsum(sizes)
    end = start + sizes
    out = []
    for c in range(chunks):
        lo, hi = c * rows, (c + 1) * rows
        part = jnp.clip(end, lo, hi) - jnp.clip(start, lo, hi)
        out.append(jax.lax.cond(
            jnp.sum(part) > 0,
            lambda x, part: grouped_matmul(x, w, part, impl),
            lambda x, part: jnp.zeros((rows, w.shape[-1]), x.dtype),
            x[lo:hi], part))
    return jnp.concatenate(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def per_device(w: jax.Array, stored: jax.Array, use: ParamUse, axes: tuple[str, ...]
               ) -> jax.Array:
    """``w`` (a parameter in its compute layout, ``gather(stored, use)``) as one copy per
    device of the data axes ``axes``, stacked along ``rules.stacked_lead``: a value of
    each device's own for a ``shard_map`` over those axes, so that its gradient leaves
    the map per device rather than all-reduced inside it in the compute dtype.
    Backward, those partial gradients are summed in float32 into the storage layout
    (``rules.stacked_sum``: a reduce-scatter) and go to ``stored``, as the dense
    weights' do (``layers.project``)."""
    rules = active()
    lead = stacked_lead(use, axes)
    sizes = tuple(math.prod(rules.mesh.shape[a] for a in axes_of(x)) for x in lead)
    compute = tuple(use.compute.spec) if use.compute is not None else ()
    return jax.lax.with_sharding_constraint(
        jnp.broadcast_to(w, (*sizes, *w.shape)),
        NamedSharding(rules.mesh, PartitionSpec(*lead, *compute)))


def _per_device_fwd(w, stored, use, axes):
    return per_device(w, stored, use, axes), jnp.zeros((0,), stored.dtype)


def _per_device_bwd(use, axes, dtype_of_stored, g):
    return None, stacked_sum(g, use, axes, dtype_of_stored.dtype)


per_device.defvjp(_per_device_fwd, _per_device_bwd)


class MoE(nnx.Module):
    """The MoE MLP: (b, s, dim) -> ((b, s, dim), router statistics per expert)."""

    def __init__(self, cfg, rngs: nnx.Rngs, shared: nnx.Module | None = None):
        """``shared``: the shared expert (Qwen 2 MoE), a dense MLP every token runs
        through, gated per token by ``sigmoid(x . shared_gate)``; None: none."""
        d, f, e, std, pd = cfg.dim, cfg.expert_dim, cfg.n_experts, cfg.init_std, cfg.param_dtype
        self.router = init_param(rngs, (d, e), ("embed", "experts"), std, pd)
        self.w_gate = init_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), std, pd)
        self.w_up = init_param(rngs, (e, d, f), ("experts", "embed", "expert_mlp"), std, pd)
        self.w_down = init_param(rngs, (e, f, d), ("experts", "expert_mlp", "embed"), std, pd)
        if cfg.router_bias:
            self.router_bias = nnx.Param(jnp.zeros((e,), pd), logical_axes=("experts",))
        if cfg.expert_bias:
            self.b_gate = nnx.Param(jnp.zeros((e, f), pd), logical_axes=("experts", "expert_mlp"))
            self.b_up = nnx.Param(jnp.zeros((e, f), pd), logical_axes=("experts", "expert_mlp"))
            self.b_down = nnx.Param(jnp.zeros((e, d), pd), logical_axes=("experts", "embed"))
        self.shared = shared
        if shared is not None and cfg.shared_expert_gate:
            self.shared_gate = init_param(rngs, (d,), ("embed",), std, pd)
        if cfg.score_bias:
            # DeepSeek V3's e_score_correction_bias: float32 whatever the parameters', as
            # its steps of score_bias_rate are small; trained by no optimizer.
            self.score_bias = nnx.Param(jnp.zeros((e,), jnp.float32), logical_axes=("experts",))
        self.cfg = cfg

    def __call__(self, x: jax.Array, real: jax.Array | None = None, dropless: bool = False
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``real`` (b, s): 1 on tokens, 0 on a row's padding, which the router's
        statistics leave out as transformers' attention mask does (None: all tokens).
        Every position is computed either way. ``dropless``: every pair computed even
        in capacity mode (model.capacity_factor), as generation does."""
        cfg = self.cfg
        real = (jnp.ones(x.shape[:2], jnp.float32) if real is None
                else real.astype(jnp.float32))
        logits = project("bsd,de->bse", x.astype(jnp.float32),
                         *use_param(self.router, jnp.float32, param_dtype=cfg.param_dtype))
        if cfg.router_bias:
            logits = add_bias(logits, *use_param(self.router_bias, jnp.float32,
                                                 param_dtype=cfg.param_dtype))
        logits = checkpoint_name(constrain(logits, ROUTER_LOGITS), "router_logits")
        # float32, as the logits: softmax, or DeepSeek V3's sigmoid scores
        probs = (jax.nn.sigmoid(logits) if cfg.router_score == "sigmoid"
                 else jax.nn.softmax(logits, axis=-1))
        # What the experts are chosen by: the scores, plus DeepSeek V3's load-balancing
        # bias, which no gradient reaches (``update_score_bias`` moves it).
        choice = probs
        if cfg.score_bias:
            choice = probs + jax.lax.stop_gradient(self.score_bias[...].astype(jnp.float32))
        params = (self.w_gate, self.w_up, self.w_down)
        if cfg.expert_bias:
            params += (self.b_gate, self.b_up, self.b_down)
        used = [use_param(v, cfg.dtype, param_dtype=cfg.param_dtype) for v in params]
        ranks = [u[0].ndim for u in used]
        glu = gated(cfg)
        n, k = cfg.n_experts, cfg.experts_per_token
        impl = resolved(cfg)
        limit = None if dropless else capacity(cfg, x.shape[1])

        def local(x, probs, choice, real, *w):
            """One device's tokens: top-k, dispatch, and its count of assignments per
            expert (leading axis 1, stacked over the devices). top_k runs here too: left
            to the partitioner, it gathers the whole batch's probabilities first."""
            # This device's copy (per_device).
            w = [a.reshape(a.shape[a.ndim - r:]) for a, r in zip(w, ranks)]
            # Down's bias is added once: by the first of the devices that split the width.
            here = jnp.ones((), jnp.float32)
            for a in width:
                here = here * (jax.lax.axis_index(a) == 0)
            biases = (*w[3:], here) if cfg.expert_bias else None
            with suspended():
                experts, weights = route(probs, k, cfg.norm_topk_prob,
                                         choice if cfg.score_bias else None, cfg.n_group,
                                         cfg.topk_group, cfg.routed_scaling_factor)
                keep = None if limit is None else within_capacity(experts, n, limit)
                if split:
                    out = dispatch_over(split[0], ways, x, experts, weights, *w[:3], glu,
                                        impl, platform, keep, limit, biases)
                else:
                    out = dispatch(x, experts, weights, *w[:3], glu, impl, keep, biases)
                assigned = jnp.zeros((n,), jnp.float32).at[experts.reshape(-1)].add(
                    jnp.repeat(real.reshape(-1), k))
                # The real tokens' pairs left out (capacity mode), per device.
                dropped = (jnp.zeros(()) if keep is None else
                           jnp.sum(jnp.where(keep, 0.0, real[..., None])))
                return out, jnp.concatenate([assigned, dropped[None]])[None]
        rules = active()
        axes = data_axes(rules) if rules is not None else ()
        # The axes that split the experts themselves (mesh.expert): a data axis for the
        # tokens, and the weights stay split over it where they are used.
        split = expert_axes(rules) if rules is not None else ()
        ways = math.prod(rules.mesh.shape[a] for a in split) if split else 1
        platform = platforms.current()  # (inside the shard_map no rules are active)
        # The axes that split the experts' width (tensor), manual too: a custom call
        # (model.moe_impl='mosaic') has no partitioning rule, and left to the
        # partitioner its weights were gathered whole around it on every device.
        width = tuple(dict.fromkeys(a for u in used for a in _compute_axes(u[2])
                                    if a not in split))
        w_axes = tuple(a for a in axes if a not in split)  # the weights' per-device copies
        if axes or width:
            rows = tuple(rules.spec(("act_batch", "act_seq")))
            rows = rows + (None,) * (2 - len(rows))
            tok = PartitionSpec(*rows, None)
            w = [per_device(g, stored, use, w_axes) for g, stored, use in used]
            w_specs = [PartitionSpec(*stacked_lead(u[2], w_axes), *_compute_spec(u[2]))
                       for u in used]
            # Split over its width, each device's down projection is a partial sum:
            # stacked along a leading dimension over those axes, summed outside.
            part = PartitionSpec(width, *tok) if width else tok
            # The tokens go in one copy per device of the width axes too, so that their
            # gradient is summed outside the map by the partitioner, not by a psum inside
            # it: XLA's CPU compiler aborts on that bfloat16 psum (all-reduce-promotion).
            x_spec, x_in = tok, x
            if width:
                x_spec = PartitionSpec(width, *tok)
                copies = math.prod(rules.mesh.shape[a] for a in width)
                x_in = jax.lax.with_sharding_constraint(
                    jnp.broadcast_to(x, (copies, *x.shape)), NamedSharding(rules.mesh, x_spec))

            def mapped(xm, *args):
                out, assigned = local(xm[0] if width else xm, *args)
                return (out[None] if width else out), assigned
            # Pipelined, manual over ``stage`` too: the pipeline vmaps the layers over it
            # (spmd_axis_name), and jax splits a vmapped shard_map's operands over that
            # axis only where the shard_map is manual over it. Not otherwise: manual over
            # the size-1 axis, XLA's CPU compiler fails a check on the bfloat16 step.
            stage = ("stage",) if mesh_lib.stages(rules.mesh) > 1 else ()
            out, assigned = jax.shard_map(
                mapped, mesh=rules.mesh, axis_names=set(axes + width + stage),
                in_specs=(x_spec, tok, tok, PartitionSpec(*rows), *w_specs),
                out_specs=(part, PartitionSpec(axes or None)),
                check_vma=False)(x_in, probs, choice, real, *w)
            if width:
                out = jnp.sum(out.astype(jnp.float32), axis=0).astype(x.dtype)
        else:
            out, assigned = local(x, probs, choice, real, *(u[0] for u in used))
        if self.shared is not None and cfg.shared_expert_gate:
            gate = project("bsd,d->bs", x, *use_param(self.shared_gate, cfg.dtype,
                                                      param_dtype=cfg.param_dtype))
            out = out + (jax.nn.sigmoid(gate)[..., None] * self.shared(x)).astype(out.dtype)
        elif self.shared is not None:  # DeepSeek's shared experts: ungated
            out = out + self.shared(x).astype(out.dtype)
        # ST-MoE's router z-loss term per token: the squared log-partition of its logits.
        z = jnp.square(jax.nn.logsumexp(logits, axis=-1))
        counted = jnp.sum(assigned, axis=0)  # the devices' (assignments, dropped pairs)
        if cfg.router_score == "sigmoid":  # the load-balancing loss's shares sum to 1
            probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        stats = {"assigned": counted[:n], "dropped": counted[n],
                 "probs": jnp.sum(probs * real[..., None], axis=(0, 1)), "rows": jnp.sum(real),
                 "z": jnp.sum(z * real)}
        if cfg.score_bias:  # each layer's own, for update_score_bias
            stats[PER_LAYER + "assigned"] = counted[None, :n]
        return out, stats


def update_score_bias(params: dict, counts: jax.Array, rate: float | jax.Array) -> dict:
    """DeepSeek V3's auxiliary-loss-free balancing, after a step: each MoE layer's
    ``score_bias`` moves by ``rate`` towards balance, down for an expert that took more
    than the layer's mean of (token, expert) assignments in the step's batch, up for
    one that took fewer (``counts``: (MoE layers, experts), the batch's, the same on
    every layout)."""
    mlp = params["layers"]["mlp"]
    bias = mlp["score_bias"]
    step = rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
    return {**params, "layers": {**params["layers"], "mlp": {
        **mlp, "score_bias": (bias + step.astype(bias.dtype))}}}


def expert_axes(rules) -> tuple[str, ...]:
    """The mesh axes (size > 1) that split the experts; one at most (the exchange runs
    over one axis): ConfigError otherwise."""
    if not any(name == "experts" for name, _ in rules.table):
        return ()  # a table for dense models only
    split = rules.axes_of("experts")
    if len(split) > 1:
        raise ConfigError(f"rules: 'experts' maps to mesh axes {split}; the experts' "
                          "exchange runs over one axis. Map 'experts' to 'expert' alone.")
    return split


def _compute_spec(use: ParamUse) -> tuple:
    return tuple(use.compute.spec) if use.compute is not None else ()


def _compute_axes(use: ParamUse) -> tuple[str, ...]:
    """The mesh axes that split a weight where it is used (after FSDP's gather)."""
    return tuple(a for s in _compute_spec(use) for a in axes_of(s))


def aux_metrics(stats: dict[str, jax.Array], n_experts: int, k: int) -> dict[str, jax.Array]:
    """The load-balancing loss of Switch Transformer as Mixtral's and Qwen3-MoE's
    ``load_balancing_loss_func`` forms it, over every layer's router at once (padding
    left out, as its attention mask does): the experts' share of assignments times
    their mean probability, summed, times the experts; ``stats`` summed over the
    layers (``rows``: layers x tokens). With it, each expert's load (its assignments
    over the mean, summed over the layers; 1: balanced), least and most. And ST-MoE's
    router z-loss (``router_z_loss``): the mean over layers and tokens of the squared
    logsumexp of the router's logits, which keeps the logits small."""
    rows = jnp.maximum(stats["rows"], 1.0)
    share = stats["assigned"] / rows
    aux = n_experts * jnp.sum(share * (stats["probs"] / rows))
    load = stats["assigned"] / (rows * k / n_experts)
    out = {"aux_loss": aux, "router_z_loss": stats["z"] / rows,
           "expert_load_min": jnp.min(load), "expert_load_max": jnp.max(load),
           "expert_dropped": stats["dropped"] / (rows * k)}
    if PER_LAYER + "assigned" in stats:  # (MoE layers, experts): update_score_bias's counts
        out[EXPERT_COUNTS] = stats[PER_LAYER + "assigned"]
    return out
