"""Pipeline parallelism over the mesh's ``stage`` axis, as one SPMD program.

The decoder's layers are cut into ``stages`` x ``virtual`` runs of equal length (chunks).
Their stacked parameters' leading axis (logical name ``layers``) is split over ``stage``
by the rule table, contiguously: stage s holds the s-th block of the storage order. GPipe
(``virtual`` 1) stores the layers in order, so stage s holds chunk s. The circular
schedule stores them so that stage s holds chunks s, s + S, s + 2S, ... (``storage_order``):
a micro-batch goes round the stages ``virtual`` times. No weight moves in either.

The batch is cut into micro-batches. At each tick every stage runs its chunk on the
micro-batch in front of it: one function vmapped over the stage axis with
``spmd_axis_name="stage"``, which XLA partitions onto the stages' devices. Then the
residual stream moves one stage on, a collective permute between neighbours.

The embedding, the final norm, the LM head and the loss run outside the pipeline on
every stage's devices (replicated over ``stage``), as MaxText's pipeline runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ndjax.parallel import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class GPipe:
    """GPipe's schedule: micro-batch m enters stage 0 at tick m and leaves the last
    stage at tick m + stages - 1; the backward pass is the forward's reverse. Every
    micro-batch's activations stay alive until its backward pass (the remat policy
    decides how much of them)."""

    stages: int
    microbatches: int
    name = "GPipe"

    @property
    def virtual(self) -> int:
        """Chunks of layers per stage: one."""
        return 1

    @property
    def ticks(self) -> int:
        return self.virtual * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of stage-ticks with no micro-batch to run: (S - 1) / (V M + S - 1)."""
        return (self.stages - 1) / self.ticks

    @property
    def passes(self) -> int:
        """The chunk passes each stage runs forward in a step, and as many backward."""
        return self.ticks


@dataclasses.dataclass(frozen=True)
class Circular(GPipe):
    """The circular (interleaved) schedule, MaxText's and Megatron's forward order:
    each stage holds ``virtual`` chunks of L / (S V) layers, and a micro-batch goes
    round the stages ``virtual`` times. Round v of micro-batch m is on stage s at tick
    v M + m + s, so every stage is busy from tick s to tick V M + s - 1 and the bubble
    is (S - 1) / (V M + S - 1): V times fewer idle ticks, each V times shorter. A
    micro-batch leaves the last stage M - S + 1 ticks before stage 0 takes it again,
    hence M >= S. Each tick saves its chunks' inputs alone, V M + S - 1 of them, and
    the backward pass runs each chunk's forward again (a chunk's weights are picked by
    tick, and the scan would otherwise save every tick's pick)."""

    virtual_stages: int = 2
    name = "Circular"

    @property
    def virtual(self) -> int:
        return self.virtual_stages


@dataclasses.dataclass(frozen=True)
class OneFOneB(GPipe):
    """1F1B in one SPMD program (``run_with_loss``): from tick S - 1 on, each tick every
    stage runs one micro-batch's forward and an earlier one's backward, so a micro-batch's
    activations are freed once its gradient has passed, not after all M forwards.

    Micro-batch m's forward is on stage s at tick m + s; the last stage then forms its
    loss and starts its backward in the same tick, which reaches stage s at tick
    m + 2(S - 1) - s. Stage s holds 2(S - s) - 1 micro-batches' chunk inputs at most:
    ``held`` = min(M, 2S - 1) on stage 0, whatever M. (Asynchronous 1F1B holds S - s:
    there a hop costs one forward or one backward, here a tick of both, since every
    stage runs the same program.) The first S - 1 ticks run forwards only and the last
    S - 1 backwards only, so the devices idle (S - 1) / (M + S - 1) of the step, as
    GPipe's. The backward pass runs each chunk's forward again from its input."""

    name = "1F1B"

    @property
    def ticks(self) -> int:
        return self.microbatches + 2 * (self.stages - 1)

    @property
    def bubble(self) -> float:
        """(S - 1) / (M + S - 1): S - 1 forward-only and S - 1 backward-only ticks."""
        return (self.stages - 1) / (self.microbatches + self.stages - 1)

    @property
    def passes(self) -> int:
        return self.microbatches + self.stages - 1

    @property
    def held(self) -> int:
        """The most micro-batches whose chunk inputs a stage holds at once (stage 0's)."""
        return min(self.microbatches, 2 * self.stages - 1)


SCHEDULES = ("gpipe", "1f1b")


def schedule(stages: int, microbatches: int, virtual: int = 1, kind: str = "gpipe") -> GPipe:
    """``kind`` 1f1b: ``OneFOneB``; gpipe: GPipe for one chunk per stage, else the
    circular schedule."""
    if kind == "1f1b":
        return OneFOneB(stages, microbatches)
    return GPipe(stages, microbatches) if virtual == 1 else Circular(stages, microbatches,
                                                                      virtual)


def storage_order(count: int, stages: int, virtual: int) -> np.ndarray:
    """The layer (of ``count``, in order) at each position of the stacked parameters'
    leading axis, which ``stage`` splits into contiguous blocks: stage s's block holds
    chunks s, s + S, ..., s + (V - 1) S of ``count / (S V)`` layers. The identity for
    GPipe (``virtual`` 1)."""
    k = count // (stages * virtual)
    return np.arange(count).reshape(virtual, stages, k).transpose(1, 0, 2).reshape(-1)


def _split_rows(a: jax.Array, m: int) -> jax.Array:
    """(b, ...) -> (m, b/m, ...): micro-batch i is rows i, i + m, i + 2m, ..., so each
    holds an equal share of every data shard's rows (a data shard's rows are contiguous)."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _join_rows(a: jax.Array) -> jax.Array:
    """``_split_rows``' inverse."""
    return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])


def _constrain_staged(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """x (stages, *names): split over ``stage`` along its first axis, the rest by the rules."""
    rules = rules_lib.active()
    if rules is None:
        return x
    spec = rules.spec(names)
    return jax.lax.with_sharding_constraint(x, PartitionSpec("stage", *spec))


def _per_stage(mask: jax.Array, ndim: int) -> jax.Array:
    """A (stages,) mask broadcastable against (stages, ...) arrays of ``ndim`` dims."""
    return mask.reshape(-1, *([1] * (ndim - 1)))


def _kept(buf: jax.Array, slot: jax.Array, value: jax.Array, mask: jax.Array,
          x_names: tuple[str | None, ...]) -> jax.Array:
    """``buf`` (stages, slots, ...) with ``value`` (stages, ...) in slot ``slot`` of the
    stages in ``mask``: each stage writes its own copy, nothing crosses stages."""
    return _constrain_staged(buf.at[:, slot].set(
        jnp.where(_per_stage(mask, value.ndim), value, buf[:, slot])), (None, *x_names))


# (one stage's parameters, h (mb, ...), one micro-batch's per-row inputs) -> (h, stats):
# stats a dict of arrays; keys starting with ``per_layer`` have the stage's layers as their
# leading axis, the others are sums.
StageFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, dict]]


def run(plan: GPipe, stage_fn: StageFn, params: Any, x: jax.Array, per_row: Any,
        x_names: tuple[str | None, ...], per_layer: str) -> tuple[jax.Array, dict]:
    """``x`` (b, ...) through every stage -> (the last stage's output (b, ...), the stats
    summed over micro-batches: those under ``per_layer`` keys (L, ...) in the parameters'
    storage order).

    ``params``: the stacked layers' parameters, leading axis L = S x V x L/(S V) in
    ``storage_order``. ``per_row``: arrays with the batch as leading axis (rotary
    tables, segment ids), cut into micro-batches as ``x`` is. ``x_names``: ``x``'s
    logical axes.
    """
    s, m, v = plan.stages, plan.microbatches, plan.virtual
    staged = jax.tree.map(lambda a: a.reshape(s, v, a.shape[0] // (s * v), *a.shape[1:]),
                          params)
    xs = rules_lib.constrain(_split_rows(x, m), (None, *x_names))
    rows = jax.tree.map(lambda a: _split_rows(a, m), per_row)
    stage_ids = jnp.arange(s)

    def chunk_fn(chunks, rnd, h, consts):
        """One stage: its chunk of round ``rnd`` (a chunk of its own: no weight moves)."""
        chunk = jax.tree.map(lambda a: a[0] if v == 1 else
                             jax.lax.dynamic_index_in_dim(a, rnd, keepdims=False), chunks)
        return stage_fn(chunk, h, consts)

    if v > 1:
        # The scan would save each tick's pick of weights (and what the layers derive
        # from them) for the backward pass: M copies of a stage's weights. Each tick
        # keeps the chunk's input alone, and the backward pass runs the chunk again.
        chunk_fn = jax.checkpoint(chunk_fn, prevent_cse=False,
                                  policy=jax.checkpoint_policies.nothing_saveable)
    stages = jax.vmap(chunk_fn, spmd_axis_name="stage")

    def per_stage(mask: jax.Array) -> jax.Array:
        return _per_stage(mask, xs.ndim)

    def kept(buf: jax.Array, slot: jax.Array, value: jax.Array, mask: jax.Array) -> jax.Array:
        return _kept(buf, slot, value, mask, x_names)

    def inputs_at(t, state, buf):
        """Stage 0 takes micro-batch t in the first round, and in a later round what the
        last stage gave for it (kept in stage 0's slots of ``buf``); stage i > 0 what
        stage i - 1 gave at tick t - 1. Also ``buf`` updated."""
        first = xs[jnp.minimum(t, m - 1)][None]
        shifted = jnp.roll(state, 1, axis=0)  # a collective permute over ``stage``
        if v > 1:
            # What reaches stage 0 is the last stage's output of tick t - 1, micro-batch
            # (t - s) % m's; it waits on stage 0 until that micro-batch's next round, m - s
            # ticks on (written first: with m == s it is taken at once).
            buf = kept(buf, (t - s) % m, shifted, stage_ids == 0)
            first = jnp.where(t < m, first, buf[:, t % m])
        return _constrain_staged(jnp.where(per_stage(stage_ids == 0), first, shifted),
                                 x_names), buf

    def tick(carry, t):
        state, buf, stats = carry
        work = t - stage_ids                     # each stage's (round, micro-batch)
        rnd, mb = jnp.clip(work // m, 0, v - 1), jnp.clip(work % m, 0, m - 1)
        valid = (work >= 0) & (work < v * m)
        consts = jax.tree.map(lambda a: a[mb], rows)
        h, buf = inputs_at(t, state, buf)
        h, st = stages(staged, rnd, h, consts)
        h = _constrain_staged(h, x_names)
        # The last stage's output in its last round is micro-batch (t - (s - 1)) % m's
        # output, kept in the last stage's slots and sent to the other stages once, after
        # the last tick (each tick sending it would cross the stages in the bubble too,
        # and a conditional around the send copies the buffer at every tick).
        done = (stage_ids == s - 1) & valid & (rnd == v - 1)
        buf = kept(buf, jnp.clip(t - (s - 1), 0, v * m - 1) % m, h, done)
        stats = {k: acc + _masked_sum(st[k], valid, rnd, v, k.startswith(per_layer))
                 for k, acc in stats.items()}
        return (h, buf, stats), None

    state0 = _constrain_staged(jnp.zeros((s, *xs.shape[1:]), x.dtype), x_names)
    shapes = jax.eval_shape(stages, staged, jnp.zeros(s, jnp.int32), state0,
                            jax.tree.map(lambda a: a[jnp.zeros(s, jnp.int32)], rows))[1]
    # Per-layer stats (stages, chunk's layers, ...) accumulate per round: (S, V, L/(S V)).
    stats0 = {k: jnp.zeros((s, v, *a.shape[1:]) if k.startswith(per_layer) else a.shape[1:],
                           a.dtype) for k, a in shapes.items()}
    # Each stage's m micro-batch slots: the first stage's hold micro-batches between
    # rounds, the last stage's the output.
    buf0 = _constrain_staged(jnp.zeros((s, *xs.shape), x.dtype), (None, *x_names))
    (_, buf, stats), _ = jax.lax.scan(tick, (state0, buf0, stats0), jnp.arange(plan.ticks))
    out = rules_lib.constrain(buf[s - 1], (None, *x_names))  # to every stage, once
    stats = {k: (a.reshape(-1, *a.shape[3:]) if k.startswith(per_layer) else a)
             for k, a in stats.items()}
    return rules_lib.constrain(_join_rows(out), x_names), stats


def _masked_sum(a: jax.Array, valid: jax.Array, rnd: jax.Array, virtual: int,
                keep_stages: bool) -> jax.Array:
    """A tick's stats (stages, ...) from the stages that held a micro-batch: summed over
    the stages, or (``keep_stages``: per-layer stats) kept per stage, in the slot of
    the round each stage ran (stages, virtual, ...)."""
    a = jnp.where(valid.reshape(-1, *([1] * (a.ndim - 1))), a, jnp.zeros_like(a))
    if not keep_stages:
        return jnp.sum(a, axis=0)
    if virtual == 1:
        return a[:, None]
    one_hot = jax.nn.one_hot(rnd, virtual, dtype=a.dtype)  # (stages, virtual)
    return one_hot.reshape(*one_hot.shape, *([1] * (a.ndim - 1))) * a[:, None]


# (head parameters (differentiated), head constants, h (mb, ...), one micro-batch's
# per-row inputs) -> (the loss summed over the micro-batch, other sums): the part of the
# loss after the last stage (final norm, LM head, cross-entropy), per micro-batch.
HeadFn = Callable[[Any, Any, jax.Array, Any], tuple[jax.Array, ...]]


def run_with_loss(plan: OneFOneB, stage_fn: StageFn, params: Any, x: jax.Array,
                  per_row: Any, x_names: tuple[str | None, ...], per_layer: str,
                  head_fn: HeadFn, head_params: Any, head_consts: Any, head_rows: Any,
                  param_names: list | None = None) -> tuple[tuple[jax.Array, ...], dict]:
    """``x`` (b, ...) through every stage and ``head_fn`` -> (``head_fn``'s sums over the
    batch, the stages' stats as ``run`` gives them), under the 1F1B schedule: its
    gradient is formed in the forward pass, each micro-batch's backward running as soon
    as its loss is known (a custom VJP hands it on, scaled by the loss's cotangent).
    Without a gradient (an eval step) the batch runs GPipe's forward.

    Only the first of ``head_fn``'s sums may be differentiated, and the stats not at all
    (the router's losses are formed over the whole batch, which 1F1B never holds).
    ``head_consts`` (the LM head gathered to its compute layout) are not differentiated.
    ``param_names``: logical axes of ``params``' leaves (or None), for the gradient sums'
    layout; ``head_rows`` are cut into micro-batches as ``per_row``. Arguments otherwise
    as ``run``'s.
    """
    p_leaves, p_tree = jax.tree.flatten(params)
    h_leaves, h_tree = jax.tree.flatten(head_params)
    names = param_names if param_names is not None and len(param_names) == len(p_leaves) \
        else [None] * len(p_leaves)

    def forward_only(p_leaves, x, h_leaves, head_consts, per_row, head_rows):
        out, stats = run(GPipe(plan.stages, plan.microbatches), stage_fn,
                         p_tree.unflatten(p_leaves), x, per_row, x_names, per_layer)
        return tuple(head_fn(h_tree.unflatten(h_leaves), head_consts, out, head_rows)), stats

    def fwd(p_leaves, x, h_leaves, head_consts, per_row, head_rows):
        value = jax.custom_derivatives.custom_vjp_primal_tree_values
        sums, stats, grads = _one_f_one_b(
            plan, stage_fn, head_fn, p_tree, value(p_leaves), [a.perturbed for a in p_leaves],
            value(x), h_tree, value(h_leaves), [a.perturbed for a in h_leaves],
            value(head_consts), value(per_row), value(head_rows), x_names, per_layer, names)
        return (sums, stats), grads

    def bwd(grads, cotangents):
        d_sums, d_stats = cotangents
        moved = [c for c in jax.tree.leaves((d_sums[1:], d_stats), is_leaf=_is_zero)
                 if not _is_zero(c)]
        if moved:
            raise ValueError("the 1F1B pipeline differentiates its loss alone; a gradient "
                             "reached its other sums or the stages' statistics (the "
                             "router's losses, formed over the whole batch)")
        g = d_sums[0]
        d_params, d_x, d_head = grads
        if _is_zero(g):
            return (None,) * 6

        def scale(a):
            return None if a is None else (a * g).astype(a.dtype)
        return ([scale(a) for a in d_params], scale(d_x), [scale(a) for a in d_head],
                None, None, None)

    run_1f1b = jax.custom_vjp(forward_only)
    run_1f1b.defvjp(fwd, bwd, symbolic_zeros=True)
    return run_1f1b(p_leaves, x, h_leaves, head_consts, per_row, head_rows)


def _is_zero(a: Any) -> bool:
    return isinstance(a, jax.custom_derivatives.SymbolicZero)


def _pick(leaves: list, mask: list[bool], keep: bool) -> list:
    return [a for a, m in zip(leaves, mask) if m == keep]


def _join(diff: list, fixed: list, mask: list[bool]) -> list:
    """``_pick``'s inverse: the leaves in order, from the differentiated and the rest."""
    d, f = iter(diff), iter(fixed)
    return [next(d) if m else next(f) for m in mask]


def _one_f_one_b(plan: OneFOneB, stage_fn: StageFn, head_fn: HeadFn, p_tree: Any,
                 p_leaves: list,
                 p_diff: list[bool], x: jax.Array, h_tree: Any, h_leaves: list,
                 h_diff: list[bool], head_consts: Any, per_row: Any, head_rows: Any,
                 x_names: tuple[str | None, ...], per_layer: str, names: list
                 ) -> tuple[tuple, dict, tuple]:
    """The 1F1B ticks: (sums, stats, (the parameters', x's and the head parameters'
    gradients of the first sum; None where not differentiated))."""
    s, m, r = plan.stages, plan.microbatches, plan.held
    staged = [a.reshape(s, a.shape[0] // s, *a.shape[1:]) for a in p_leaves]
    diff, fixed = _pick(staged, p_diff, True), _pick(staged, p_diff, False)
    diff_names = _pick(names, p_diff, True)
    h_fixed = _pick(h_leaves, h_diff, False)
    xs = rules_lib.constrain(_split_rows(x, m), (None, *x_names))
    rows = jax.tree.map(lambda a: _split_rows(a, m), per_row)
    h_rows = jax.tree.map(lambda a: _split_rows(a, m), head_rows)
    ids = jnp.arange(s)
    nd = xs.ndim - 1  # a staged activation's dims: (stages, mb rows, ...)

    def forward(chunk, h, consts):
        return stage_fn(p_tree.unflatten(chunk), h, consts)

    def backward(d, f, h, consts, cotangent):
        """One stage's backward: its chunk run again from the input it kept, then
        (its differentiated parameters' gradient, its input's)."""
        def chunk_out(d, h):
            return stage_fn(p_tree.unflatten(_join(d, f, p_diff)), h, consts)[0]
        return jax.vjp(chunk_out, d, h)[1](cotangent)

    forwards = jax.vmap(forward, spmd_axis_name="stage")
    read_slot = jax.vmap(lambda buf, i: jax.lax.dynamic_index_in_dim(buf, i, keepdims=False),
                         spmd_axis_name="stage")
    backwards = jax.vmap(backward, spmd_axis_name="stage")

    def head(h_d, h, rows):
        out = head_fn(h_tree.unflatten(_join(h_d, h_fixed, h_diff)), head_consts, h, rows)
        return out[0], tuple(out[1:])

    def in_storage(acc: list) -> list:
        """The gradient sums in the parameters' layout (each stage its own layers)."""
        rules = rules_lib.active()
        if rules is None:
            return acc
        return [a if n is None else jax.lax.with_sharding_constraint(
            a, PartitionSpec("stage", None, *rules.spec(tuple(n[1:])))) for a, n in
            zip(acc, diff_names)]

    def tick(carry, t, forward_on: bool, backward_on: bool):
        state, cot, saved, acc, h_acc, d_xs, stats, sums = carry
        if forward_on:
            work = t - ids  # stage s runs micro-batch t - s forward
            valid = (work >= 0) & (work < m)
            consts = jax.tree.map(lambda a: a[jnp.clip(work, 0, m - 1)], rows)
            first = xs[jnp.minimum(t, m - 1)][None]
            h = _constrain_staged(jnp.where(_per_stage(ids == 0, nd + 1), first,
                                            jnp.roll(state, 1, axis=0)), x_names)
            # Micro-batch t - s's input on stage s, in slot (micro-batch + s) % r: the
            # same slot on every stage (t % r); a stage's backward reads its own.
            saved = _kept(saved, t % r, h, valid, x_names)
            state, st = forwards(staged, h, consts)
            state = _constrain_staged(state, x_names)
            stats = {k: a + _masked_sum(st[k], valid, ids, 1, k.startswith(per_layer))
                     for k, a in stats.items()}
        if backward_on:
            work = t - 2 * (s - 1) + ids  # stage s runs micro-batch t - 2(S-1) + s backward
            valid = (work >= 0) & (work < m)
            arriving = jnp.roll(cot, -1, axis=0)  # stage s + 1's, a collective permute
            if forward_on:
                # The last stage's output of this tick is micro-batch t - (S - 1)'s: its
                # loss, and the gradient that starts its backward pass on that stage.
                mb = t - (s - 1)
                last = rules_lib.constrain(state[s - 1], x_names)
                h_row = jax.tree.map(lambda a: a[mb], h_rows)
                h_d = _pick(h_leaves, h_diff, True)
                loss, pull, others = jax.vjp(lambda h_d, last: head(h_d, last, h_row),
                                             h_d, last, has_aux=True)
                d_head, d_last = pull(jnp.ones_like(loss))
                h_acc = [a + g.astype(a.dtype) for a, g in zip(h_acc, d_head)]
                sums = (sums[0] + loss, *(a + b for a, b in zip(sums[1:], others)))
                arriving = jnp.where(_per_stage(ids == s - 1, nd + 1), d_last[None],
                                     arriving)
            arriving = _constrain_staged(arriving, x_names)
            consts = jax.tree.map(lambda a: a[jnp.clip(work, 0, m - 1)], rows)
            # Micro-batch work's input, written at slot (work + s) % r: a slot of its own
            # on each stage.
            kept_in = _constrain_staged(read_slot(saved, (work + ids) % r), x_names)
            d_params, d_h = backwards(diff, fixed, kept_in, consts, arriving)
            acc = in_storage([a + jnp.where(_per_stage(valid, g.ndim), g, 0).astype(a.dtype)
                              for a, g in zip(acc, d_params)])
            cot = _constrain_staged(jnp.where(_per_stage(valid, nd + 1), d_h, 0), x_names)
            # Stage 0's input gradient is the embedding's, kept in stage 0's slots.
            d_xs = _kept(d_xs, jnp.clip(t - 2 * (s - 1), 0, m - 1), cot,
                         (ids == 0) & valid, x_names)
        return (state, cot, saved, acc, h_acc, d_xs, stats, sums), None

    state0 = _constrain_staged(jnp.zeros((s, *xs.shape[1:]), x.dtype), x_names)
    consts0 = jax.tree.map(lambda a: a[jnp.zeros(s, jnp.int32)], rows)
    stat_shapes = jax.eval_shape(forwards, staged, state0, consts0)[1]
    stats0 = {k: jnp.zeros((s, 1, *a.shape[1:]) if k.startswith(per_layer) else a.shape[1:],
                           a.dtype) for k, a in stat_shapes.items()}
    sum_shapes = jax.eval_shape(
        lambda: head(_pick(h_leaves, h_diff, True), xs[0],
                     jax.tree.map(lambda a: a[0], h_rows)))
    sums0 = tuple(jnp.zeros(a.shape, a.dtype) for a in (sum_shapes[0], *sum_shapes[1]))
    f32 = lambda a: jnp.zeros(a.shape, jnp.promote_types(a.dtype, jnp.float32))  # noqa: E731
    carry = (state0, state0,
             _constrain_staged(jnp.zeros((s, r, *xs.shape[1:]), x.dtype), (None, *x_names)),
             in_storage([f32(a) for a in diff]), [f32(a) for a in _pick(h_leaves, h_diff, True)],
             _constrain_staged(jnp.zeros((s, *xs.shape), x.dtype), (None, *x_names)),
             stats0, sums0)
    # Ticks 0 .. S-2 run forwards only, S-1 .. M+S-2 both, M+S-1 .. M+2S-3 backwards only.
    for first, stop, f_on, b_on in ((0, s - 1, True, False), (s - 1, m + s - 1, True, True),
                                    (m + s - 1, plan.ticks, False, True)):
        carry, _ = jax.lax.scan(lambda c, t, f_on=f_on, b_on=b_on: tick(c, t, f_on, b_on),
                                carry, jnp.arange(first, stop))
    _, _, _, acc, h_acc, d_xs, stats, sums = carry
    stats = {k: (a.reshape(-1, *a.shape[3:]) if k.startswith(per_layer) else a)
             for k, a in stats.items()}
    d_params = [a.reshape(-1, *a.shape[2:]).astype(p.dtype) for a, p in
                zip(acc, _pick(p_leaves, p_diff, True))]
    d_x = rules_lib.constrain(_join_rows(d_xs[0]), x_names)  # to every stage, once
    d_head = [a.astype(p.dtype) for a, p in zip(h_acc, _pick(h_leaves, h_diff, True))]
    grads = (_join(d_params, [None] * len(fixed), p_diff), d_x,
             _join(d_head, [None] * len(h_fixed), h_diff))
    return sums, stats, grads
