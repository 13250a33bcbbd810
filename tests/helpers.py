"""Shared test helpers: run a few train steps of an Experiment, compare with one device."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
from conftest import TINY_MODEL, tiny_config

from ndjax.data.loader import make_loader
from ndjax.data.synthetic import SyntheticSource
from ndjax.experiment import Experiment
from ndjax.models import lora
from ndjax.parallel import rules as rules_lib
from ndjax.step.train_step import loss_and_grads, step_dropout


def train_py_flags() -> list[str]:
    """``tiny_config()`` as train.py ``--config.*`` flags, so that runs of train.py
    in a subprocess train exactly what the in-process tests train."""
    c = tiny_config()
    # scan_layers too: unset, a CPU run unrolls a small model's layers, another
    # program whose float32 sums need not match the scanned one's bit for bit.
    flags = [f"--config.model.{k}={c.model[k]}" for k in (*TINY_MODEL, "scan_layers")]
    flags += [f"--config.train.{k}={c.train[k]}" for k in
              ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "schedule", "eps")]
    return flags + [f"--config.data.source={c.data.source}"]


def host_batches(config, steps):
    t = config.train
    if config.data.source != "synthetic":  # files: the whole batch, as one process would
        with make_loader(config, config.model.vocab_size, rows=(0, t.batch_size),
                         prefetch=0) as loader:
            return [loader.batch(i) for i in range(steps)]
    source = SyntheticSource(config.model.vocab_size, t.seq_len, t.seed)
    return [source.rows(i, 0, t.batch_size) for i in range(steps)]


def with_overrides(config, overrides=None):
    """``config`` with ``{"group.key": value}`` overrides applied (in place)."""
    for name, value in (overrides or {}).items():
        group, key = name.split(".")
        config[group][key] = value
    return config


def run_steps(exp: Experiment, initial_state=None, steps: int | None = None,
              grads: list | None = None):
    """Runs the compiled step; returns (losses, final params on the host, in layer order).

    ``initial_state`` (host arrays) is placed in this layout's shardings, so
    every layout starts from bit-identical parameters. ``grads``: a list the first
    step's gradients are appended to (``step_gradients``), read before the next step
    donates that state.
    """
    steps = exp.config.train.steps if steps is None else steps
    if initial_state is None:
        state = exp.init_state()
    else:
        # In layer order, as a checkpoint has it: into the layout's (a circular
        # pipeline's stored order), and back for what is returned.
        state = exp.in_storage_order(jax.device_put(initial_state, exp.state_sharding))
    losses = []
    for i, batch in enumerate(host_batches(exp.config, steps)):
        state, metrics = exp.compiled_step(state, exp.device_batch(batch))
        losses.append(float(metrics["loss"]))
        if i == 0 and grads is not None:
            grads.append(step_gradients(exp, exp.in_layer_order(state.opt_state),
                                        metrics["grad_norm"]))
    return np.array(losses), jax.device_get(exp.in_layer_order(state.params))


def step_gradients(exp: Experiment, opt_state, grad_norm):
    """The gradients the train step took in its first step, on the host, read back from
    AdamW's first moment after it: mu_1 = (1 - b1) x the clipped gradient, and the clip
    scaled it by clip_norm / grad_norm (the step's metric, before clipping) where the
    norm was over. What the real step computed, in its layout, with no second compile;
    exact to a few float32 roundings (far below GRAD_RTOL)."""
    t = exp.config.train
    adam = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState)) if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1 and int(adam[0].count) == 1, adam
    norm = float(grad_norm)
    scale = 1.0 / (1.0 - t.b1) * (norm / t.clip_norm if 0 < t.clip_norm < norm else 1.0)
    return jax.tree.map(lambda m: np.asarray(m, np.float64) * scale, jax.device_get(adam[0].mu))


_references: dict = {}


def reference(model_overrides, rules="default", overrides=None):
    """Single-device run of ``tiny_config``: initial state (host), losses, final params.
    ``overrides``: other fields by dotted name (e.g. chat data, see ``with_overrides``).

    Cached per process, so every layout test of a session shares one reference.
    """
    return _reference(model_overrides, rules, overrides)[:3]


def _reference(model_overrides, rules="default", overrides=None):
    """``reference``'s run and its first step's gradients."""
    key = (json.dumps(model_overrides, sort_keys=True), rules,
           tuple(sorted((overrides or {}).items())))
    if key not in _references:
        config = with_overrides(tiny_config(model=model_overrides, rules=rules), overrides)
        exp = Experiment.from_config(config, jax.devices()[:1])
        init = jax.device_get(exp.init_state())
        grads = []
        losses, params = run_steps(exp, init, grads=grads)
        _references[key] = (init, losses, params, grads[0])
    return _references[key]


def first_step_grads(exp: Experiment, initial_state):
    """The float32 gradients of the first step's loss, from ``initial_state`` (host),
    computed in ``exp``'s layout (the step's own ``loss_and_grads``), on the host: of
    what trains (every parameter, or under LoRA the adapters)."""
    params = exp.in_storage_order(jax.device_put(initial_state.params,
                                                 exp.state_sharding.params))
    batch = exp.device_batch(host_batches(exp.config, 1)[0])
    trainable, frozen = lora.split(params, exp.adapters_only)

    def features(p, *args, **kwargs):
        return exp.features(lora.merge(frozen, p), *args, **kwargs)

    def fn(trainable, batch):  # with the first step's LoRA dropout, as the step has it
        dropout = step_dropout(exp.step_options, initial_state.step, batch)
        return loss_and_grads(features, exp.step_options, trainable, batch, dropout=dropout)

    with rules_lib.use(exp.rules):
        return jax.device_get(exp.in_layer_order(jax.jit(fn)(trainable, batch)[2]))


# First-step gradients, per parameter: |layout - one device| <= GRAD_RTOL x the
# largest |gradient| of that parameter. Layouts sum in another order (measured:
# 8.6e-7 of the largest at most, fsdp x tensor and CP x TP); 1e-5 leaves 10x.
GRAD_RTOL = 1e-5


def assert_same_training(exp, model_overrides, overrides=None):
    """``exp`` trains like the single-device run: its 3 AdamW steps' losses (rtol 1e-5)
    and its first step's gradients (GRAD_RTOL of each parameter's largest). Parameters
    after Adam are not compared: Adam divides by sqrt(v), so an entry whose gradient is
    near 0 turns summation-order noise into a visible parameter difference."""
    init, ref_losses, _, ref_grads = _reference(model_overrides, overrides=overrides)
    grads = []
    losses, params = run_steps(exp, init, grads=grads)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads[0]),
                               jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, want, rtol=0, atol=GRAD_RTOL * np.abs(want).max(),
                                   err_msg=jax.tree_util.keystr(path))
    # The run must have trained for real, or equality would prove nothing.
    def leaf(p):
        return p["layers"]["attn"]["lora_q"]["b"] if exp.adapters_only else p["embed"]
    assert not np.allclose(leaf(params), leaf(init.params), atol=1e-3)
    return init, params


def partitioned_hlo(lowered) -> str:
    """The step's HLO right after SPMD partitioning, as a GPU would get it.

    XLA's CPU backend later widens bfloat16 collectives and in-place updates to
    float32 (its float-normalization-bf16 pass), so the final CPU HLO cannot show
    which dtype a GPU's all-gathers move; the partitioner's output can.
    """
    import glob
    import os
    import tempfile

    from jax._src import compilation_cache

    # A hit in the persistent compilation cache (tests/conftest.py) would compile
    # nothing and dump nothing: the dump options are not part of its key. jax
    # decides once whether the cache is used, so that answer is reset around the
    # switch (reset_cache is private; tested with jax 0.10 and 0.12).
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        with tempfile.TemporaryDirectory() as d:
            lowered.compile({"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"})
            [path] = glob.glob(os.path.join(d, "*after_spmd-partitioning*.txt"))
            with open(path) as f:
                return f.read()
    finally:
        jax.config.update("jax_enable_compilation_cache", cached)
        compilation_cache.reset_cache()
