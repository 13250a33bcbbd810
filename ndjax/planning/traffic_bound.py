"""The least traffic a layout's train step can have, from its shardings alone: what the
planner uses to leave out compiles of layouts that cannot rank (``planner.make_plan``).

Per device and step, in the ring bytes ``roofline.traffic`` counts for a compiled step,
split the same way into groups inside one node and groups across nodes. Only what the
program cannot avoid is counted, each once:

* **Weight gathers.** Every weight (two or more dims) goes from its storage layout to its
  compute layout through ``rules.gather``: an all-gather over the storage axes the compute
  layout drops, of the gathered shard, in the narrower of its dtype and the compute dtype.
  A layer's weights twice: no remat policy saves them, so its backward pass gathers
  them again (staged layers: see below). grad_accum's per-micro-batch gathers are not
  counted.
* **Gradient reductions.** A trained weight's gradient is summed over every data axis
  that split the tokens: a reduce-scatter over the gathered axes of its float32 gathered
  shard, then an all-reduce over the other data axes of its float32 storage shard (the
  least bytes of any order of the two).
* **Tensor parallelism's activations.** The attention's and a dense MLP's output
  projections contract a split dimension: per layer, one all-reduce (or its
  reduce-scatter and all-gather) of the block's output, per device's tokens, in the
  compute dtype, and one of its input's gradient in the backward pass (under LoRA the
  first layer's need not run). Remat's reruns of the forward's are not counted.

* **The experts' exchange** (``mesh.expert``): per MoE layer, each device's (token, expert)
  pairs to their experts' devices and back, two all-to-alls over the expert axis in the
  compute dtype, counted as ``parallel.collectives`` counts a ragged all-to-all (the
  pairs a device has; in capacity mode ``min(1, capacity_factor)`` of them), and their
  two transposes in the backward pass when every parameter is trained.
* **Pipeline stages** (``mesh.stage``): a device runs its stage's layers only, at every
  tick, the bubble's on zeros (the per-layer terms above count those ticks), and holds
  its stage's share of the stacked weights (never gathered over ``stage``). At every
  tick (V M + S - 1 of them a step, bubble ticks included) the pipeline's program
  (``ndjax.parallel.pipeline``) gathers the chunk of those weights it runs (once a
  step under ``model.pipeline_gather_once``) and reduce-scatters their gradients:
  XLA does not hoist either out of the tick loop. It all-reduces the gradients over
  replicas at every tick too where a chunk has two layers or more; with one, the
  layers' loop is gone and XLA moves that sum out of the tick loop (counted once;
  ``tests/test_gpu_compile.py`` compiles both). And at every tick each device sends
  its share of a micro-batch's residual stream to the next stage and, backward, its
  gradient back: two collective permutes over ``stage`` a tick.

Context parallelism's exchange of keys and values, the vocabulary-parallel head and loss,
and every bookkeeping reduction are left out: the bound is below what a compiled step
sends (``tests/test_plan.py`` checks it on every layout it compiles,
``tests/test_gpu_compile.py`` on the GPU compiler's programs).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from ndjax.hardware import roofline
from ndjax.models import moe
from ndjax.models.layers import STACKED_AXES
from ndjax.parallel import pipeline


def _axes(spec: Any) -> set[str]:
    out: set[str] = set()
    for entry in spec:
        if entry is not None:
            out.update((entry,) if isinstance(entry, str) else entry)
    return out


def _groups(mesh: Any, axes: set[str], position: dict[int, int]) -> list[tuple[int, ...]]:
    """The device groups (positions) of a collective over ``axes`` of ``mesh``."""
    names = list(mesh.axis_names)
    moved = [names.index(a) for a in names if a in axes]
    kept = [names.index(a) for a in names if a not in axes]
    ids = np.vectorize(lambda d: position[d.id])(mesh.devices)
    grouped = np.transpose(ids, kept + moved).reshape(-1, math.prod(mesh.shape[a] for a in axes))
    return [tuple(int(p) for p in g) for g in grouped]


def least_traffic(exp: Any, devices: Any, devices_per_node: int) -> roofline.Link:
    """The least traffic of ``exp``'s train step (see the module docstring), its groups'
    nodes counted over ``devices`` (the planner's, in ``jax.devices()`` order)."""
    position = {d.id: i for i, d in enumerate(devices)}
    mesh, rules, cfg = exp.mesh, exp.rules, exp.model_cfg
    inside: dict[str, float] = {}
    across: dict[str, float] = {}

    spans: dict[frozenset[str], int] = {}  # the same few axis sets serve every leaf

    def send(kind: str, axes: set[str], ring_bytes: float) -> None:
        if not axes or not ring_bytes:
            return
        key = frozenset(axes)
        if key not in spans:
            spans[key] = max(roofline.nodes_of(g, devices_per_node)
                             for g in _groups(mesh, axes, position))
        where = across if spans[key] > 1 else inside
        where[kind] = where.get(kind, 0.0) + ring_bytes

    def size(axes: set[str]) -> int:
        return math.prod(mesh.shape[a] for a in axes)

    # The staged weights' gathers and reductions run at each tick, a chunk of them each
    # (the whole stage's weights once per round); the gathers once a step where
    # model.pipeline_gather_once.
    rounds = _ticks(cfg) / max(cfg.virtual_stages, 1)
    trained = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        exp.trainable(exp.param_shapes))}
    compute_bytes = np.dtype(cfg.dtype).itemsize
    leaves = zip(jax.tree_util.tree_leaves_with_path(exp.param_shapes),
                 jax.tree.leaves(exp.param_names, is_leaf=lambda x: isinstance(x, tuple)),
                 jax.tree.leaves(exp.state_sharding.params), strict=True)
    for (path, shape), names, storage in leaves:
        # A stack's layer axis (split over ``stage``): each device keeps its own layers.
        names_stacked = bool(names) and names[0] in STACKED_AXES
        lead = _axes(tuple(storage.spec)[:1]) if names_stacked else set()
        names = names[1:] if names_stacked else names
        if len(names) < 2:
            continue  # norm scales and the like: not gathered through rules.gather
        stored = _axes(storage.spec) - lead
        gathered_spec = rules.compute_spec(rules.stored_names(names, cfg.n_kv_heads)
                                           if "kv_heads" in names else names)
        kept = _axes(gathered_spec)
        gathered_over = stored - kept
        elements = math.prod(shape.shape) / size(kept | lead)
        g = size(gathered_over)
        narrow = min(shape.dtype.itemsize, compute_bytes)
        times = rounds if lead else 1
        replica_sums = times if lead and _layers_per_chunk(cfg) > 1 else 1
        if lead:  # staged: at every tick, or once a step
            gathers = 1 if cfg.pipeline_gather_once else rounds
        else:
            # A layer's gathered weights are not activations no remat policy saves
            # (decoder.REMAT_POLICIES): its backward pass gathers them again.
            gathers = 2 if names_stacked and cfg.stages == 1 else 1
        send("all-gather", gathered_over, gathers * (g - 1) / g * elements * narrow)
        if jax.tree_util.keystr(path) not in trained:
            continue
        send("reduce-scatter", gathered_over, times * (g - 1) / g * elements * 4)
        replicas = set(rules.data_axes) - stored - kept
        r = size(replicas)
        send("all-reduce", replicas, replica_sums * 2 * (r - 1) / r * elements / g * 4)
    every_param = len(trained) == len(jax.tree.leaves(exp.param_shapes))
    _tensor_activations(exp, send, size, every_param)
    _expert_exchange(exp, send, size, 4 if every_param else 2)
    _stage_sends(exp, send, size)
    return roofline.Link(inside, across)


def _ticks(cfg: Any) -> int:
    """The chunk passes each stage runs a step (of one grad_accum slice) each way; 1
    without stages."""
    if cfg.stages == 1:
        return 1
    return pipeline.schedule(cfg.stages, cfg.microbatches, cfg.virtual_stages,
                             cfg.pipeline_schedule).passes


def _layers_per_chunk(cfg: Any) -> float:
    """The layers one pipeline chunk runs (a stage's under GPipe and 1F1B)."""
    return (cfg.n_layers - cfg.first_k_dense) / (cfg.stages * max(cfg.virtual_stages, 1))


def _layers_per_device(cfg: Any, moe_only: bool = False) -> float:
    """The layers a device runs, in whole passes over its tokens: with pipeline stages,
    its stage's share of the staged ones at every tick, the bubble's on zeros
    (``GPipe.passes``), and DeepSeek V3's dense first layers (run before the stages, on
    every device; not with ``moe_only``)."""
    dense = 0 if moe_only else cfg.first_k_dense
    if cfg.stages <= 1:
        return dense + cfg.n_layers - cfg.first_k_dense
    return dense + _layers_per_chunk(cfg) * _ticks(cfg) / cfg.microbatches


def _stage_sends(exp: Any, send: Any, size: Any) -> None:
    """At each tick, a micro-batch's residual stream to the next stage, its gradient back."""
    rules, cfg, t = exp.rules, exp.model_cfg, exp.settings.train
    if cfg.stages <= 1:
        return
    rows = t.batch_size // t.grad_accum // cfg.microbatches  # a micro-batch's
    shard = (rows * t.seq_len * cfg.dim / size(set(rules.axes_of("act_batch")))
             / size(set(rules.axes_of("act_res_seq"))) / size(set(rules.axes_of("act_embed"))))
    ticks = _ticks(cfg) * t.grad_accum
    send("collective-permute", {"stage"}, 2 * ticks * shard * np.dtype(cfg.dtype).itemsize)


def _tensor_activations(exp: Any, send: Any, size: Any, every_param: bool) -> None:
    """One reduction a layer of each block output whose projection contracts a dimension
    split over non-data axes (the attention's heads; a dense MLP's width), and one in
    the backward pass of its input's gradient, which the split projections in front
    of it form as partial sums (with only adapters trained, the first layer's input
    needs none)."""
    rules, cfg, t = exp.rules, exp.model_cfg, exp.settings.train
    data = set(rules.data_axes)
    tokens = t.batch_size * t.seq_len / size(data)
    block_out = tokens * cfg.dim * np.dtype(cfg.dtype).itemsize
    split = [set(rules.axes_of("q_heads")) - data]
    if not cfg.n_experts:
        split.append(set(rules.axes_of("mlp")) - data)
    reductions = 2 * _layers_per_device(cfg) - (0 if every_param else 1)
    for axes in split:
        k = size(axes)
        send("all-reduce", axes, reductions * 2 * (k - 1) / k * block_out)


def _expert_exchange(exp: Any, send: Any, size: Any, per_layer: int) -> None:
    """``per_layer`` all-to-alls a layer over the axis that splits the experts, each of
    a device's own (token, expert) pairs (see the module docstring)."""
    rules, cfg, t = exp.rules, exp.model_cfg, exp.settings.train
    split = set(moe.expert_axes(rules)) if cfg.n_experts else set()
    if not split:
        return
    token_axes = set(rules.axes_of("act_batch")) | set(rules.axes_of("act_seq"))
    pairs = t.batch_size * t.seq_len / size(token_axes) * cfg.experts_per_token
    if cfg.capacity_factor is not None:
        pairs *= min(1.0, cfg.capacity_factor)
    g = size(split)
    rows = pairs * cfg.dim * np.dtype(cfg.dtype).itemsize
    send("all-to-all", split, _layers_per_device(cfg, moe_only=True) * per_layer * (g - 1) / g
         * rows)
